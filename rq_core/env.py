"""Environment switches read on hot paths (every layer of every decode step).

`os.environ.get` encodes the name and decodes the value on each call (~1.3 µs on a 2-core CPU); a decode step reads
a few switches a layer. `get` reads the same live mapping through its underlying dict where CPython keeps one
(POSIX: bytes keys), so a switch set or changed at run time (tests, diagnostics) still takes effect at once.
"""

from __future__ import annotations

import os

_DATA = getattr(os.environ, "_data", None) if os.name == "posix" else None


def get(name: str, default: str) -> str:
    """os.environ.get(name, default), faster."""
    if _DATA is None:
        return os.environ.get(name, default)
    v = _DATA.get(name.encode())
    return default if v is None else os.fsdecode(v)


def has(name: str) -> bool:
    """name in os.environ."""
    return (name in os.environ) if _DATA is None else (name.encode() in _DATA)
