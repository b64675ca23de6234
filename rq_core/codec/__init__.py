"""How K/V vectors become codes: rotations, Lloyd-Max codebooks, bit packing."""
