"""Untrusted text in (files and command-line strings must be UTF-8) and strict JSON out."""

from __future__ import annotations

import json
import math
import os
from typing import Any

from rq_core.errors import RQError


def read_utf8(path: str | os.PathLike, what: str = "") -> str:
    """The file's text; bytes that are not UTF-8 are one RQError, never silently replaced."""
    data = open(path, "rb").read()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise RQError(f"{what or path}: not valid UTF-8 text (byte 0x{data[e.start]:02x} at offset {e.start})") from None


def check_utf8(text: str, what: str) -> str:
    """`text` unchanged if it encodes as UTF-8. Python hands over command-line bytes that are not UTF-8
    as lone surrogates, which the tokenizer and the console cannot take."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        ch = text[e.start]
        shown = f"byte 0x{ord(ch) - 0xDC00:02x}" if 0xDC80 <= ord(ch) <= 0xDCFF else f"character U+{ord(ch):04X}"
        raise RQError(f"{what}: not valid UTF-8 text ({shown} at position {e.start})") from None
    return text


def finite_or_none(obj: Any) -> Any:
    """`obj` with every NaN or infinite float replaced by None (JSON null): NaN is not JSON."""
    if hasattr(obj, "shape") and hasattr(obj, "tolist"):  # numpy / mlx arrays and scalars
        obj = obj.tolist()
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {k: finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    return obj


def dumps_strict(obj: Any, **kw: Any) -> str:
    """json.dumps that never writes NaN/Infinity (ValueError instead)."""
    return json.dumps(obj, allow_nan=False, **kw)
