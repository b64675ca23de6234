"""Attention over a compressed cache: the dispatcher and the pure-MLX reference."""
