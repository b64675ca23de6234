"""The GPU kernels: rendering of metal/ sources, launch, compiled-kernel cache, settings."""
