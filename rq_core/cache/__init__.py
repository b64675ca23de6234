"""The KV caches: fp16 and the compressed IsoQuant / TurboQuant caches."""
