"""A checkpoint's files: its JSON files and its safetensors shards (the lowest layer: checkpoint loading and the
expert pages both read them)."""

from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any

from rq_core.errors import RQError

# JSON files of a checkpoint are small (a 1T-parameter model's shard index is a few MB); a bigger one is not
# read (it could be a link to anything).
_MAX_JSON_BYTES = 64 << 20


def read_json(path: Path) -> dict:
    if path.stat().st_size > _MAX_JSON_BYTES:
        raise RQError(f"{path} is too large for a checkpoint JSON file (over {_MAX_JSON_BYTES >> 20} MB)")
    try:
        with open(path, encoding="utf-8") as f:
            obj = json.load(f)
    except json.JSONDecodeError as e:
        raise RQError(f"{path} is not valid JSON: {e}")
    except (UnicodeDecodeError, ValueError, RecursionError):  # binary data, a huge number, deep nesting
        raise RQError(f"{path} is not valid JSON (not UTF-8 text, or nested or sized beyond reason)")
    if not isinstance(obj, dict):
        raise RQError(f"{path} should hold a JSON object")
    return obj


def short(v: Any) -> str:
    """repr(v), at most 40 characters (untrusted values in error lines)."""
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


def _shard_name(name: Any, index: Path) -> str:
    """A shard named by the index: a plain file name in the checkpoint folder (the file itself may be a link,
    as in a hub snapshot; the name may not lead elsewhere)."""
    if (not isinstance(name, str) or not name.endswith(".safetensors") or Path(name).name != name
            or any(c in name for c in "/\\\0")):
        raise RQError(f"{index}: weight_map names {short(name)}, not a .safetensors file name in the "
                      "checkpoint folder (no paths)")
    return name


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of a checkpoint (from the shard index when there is one)."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        wm = read_json(index).get("weight_map")
        if not isinstance(wm, dict):
            raise RQError(f"{index}: weight_map should be an object of tensor name -> shard file name")
        files = [path / f for f in sorted({_shard_name(v, index) for v in wm.values()})]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise RQError(f"{path}: shard(s) named in model.safetensors.index.json are missing: {', '.join(missing[:3])}")
    else:
        files = sorted(p for p in path.glob("*.safetensors") if p.is_file())
    if not files:
        raise RQError(f"{path} has no *.safetensors weights")
    return files


def read_header(f: Path) -> tuple[dict, int]:
    """A safetensors file's header and where its data starts."""
    try:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            if n > 100_000_000:
                raise ValueError
            hdr = json.loads(fh.read(n))
        if not isinstance(hdr, dict):
            raise ValueError
    except (struct.error, ValueError, UnicodeDecodeError):
        raise RQError(f"{f} is not a valid safetensors file (bad header)")
    return hdr, 8 + n
