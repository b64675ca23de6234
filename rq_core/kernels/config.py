"""The GPU kernels' settings: one frozen object, read from the environment once.

Every switch the kernels and the attention dispatcher honour is a field here (docs/KERNELS.md lists them). A decode
step reads them in every layer, so they are read from the environment once per process, on first use; code that
needs other settings (checks, `rq profile`, tests) passes a changed copy to `set_config` or `override`.

    RQ_KERNELS=0          no GPU kernels: every attention and append takes the MLX-op reference path
    RQ_ATTN=fused|four|reference
                          a compressed cache's attention: the one-launch fused kernel (default), the four-kernel
                          pipeline `rq profile` times (query rotation, scores, softmax, values, inverse rotation),
                          or the MLX-op reference
    RQ_APPEND=kernel|ops  appending to a compressed cache: one kv_append launch (default) or quantize_kv's MLX ops
    RQ_KERNEL_MINIFY=0    kernel sources as written (compiler messages with their line numbers)
    RQ_KERNEL_CACHE=0     do not keep compiled CUDA kernels in MLX's PTX cache across processes
    RQ_KERNEL_POISON=1    fill every kernel output with NaN (codes: 0xB2D05E00) before it runs, so an element a
                          kernel forgot to write shows up (checks)
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass, replace
from typing import Iterator, Mapping

from rq_core.errors import RQError

ATTENTION_PATHS = ("fused", "four", "reference")
APPEND_PATHS = ("kernel", "ops")


@dataclass(frozen=True)
class KernelConfig:
    kernels: bool = True  # False: no GPU kernels at all
    attention: str = "fused"  # ATTENTION_PATHS
    append: str = "kernel"  # APPEND_PATHS
    minify: bool = True
    disk_cache: bool = True
    poison: bool = False

    def __post_init__(self) -> None:
        if self.attention not in ATTENTION_PATHS:
            raise RQError(f"RQ_ATTN={self.attention!r} is not an attention path "
                          f"(choose {', '.join(ATTENTION_PATHS)})")
        if self.append not in APPEND_PATHS:
            raise RQError(f"RQ_APPEND={self.append!r} is not an append path (choose {' or '.join(APPEND_PATHS)})")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> "KernelConfig":
        def on(name: str, default: bool) -> bool:
            v = environ.get(name)
            if v is None:
                return default
            if v not in ("0", "1"):
                raise RQError(f"{name}={v!r} must be 0 or 1")
            return v == "1"

        return cls(kernels=on("RQ_KERNELS", True), attention=environ.get("RQ_ATTN", "fused"),
                   append=environ.get("RQ_APPEND", "kernel"), minify=on("RQ_KERNEL_MINIFY", True),
                   disk_cache=on("RQ_KERNEL_CACHE", True), poison=on("RQ_KERNEL_POISON", False))


_CONFIG: KernelConfig | None = None


def config() -> KernelConfig:
    """The settings in force: from the environment on first use, or as last set."""
    global _CONFIG
    if _CONFIG is None:
        _CONFIG = KernelConfig.from_env()
    return _CONFIG


def set_config(cfg: KernelConfig | None) -> KernelConfig | None:
    """Put `cfg` in force (None: read the environment again on next use); returns the settings it replaces."""
    global _CONFIG
    old, _CONFIG = _CONFIG, cfg
    return old


@contextlib.contextmanager
def override(**changes: object) -> Iterator[KernelConfig]:
    """The current settings with `changes` in force inside the block."""
    old = set_config(replace(config(), **changes))
    try:
        yield config()
    finally:
        set_config(old)
