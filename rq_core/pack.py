"""`rq pack CKPT`: lay out each routed expert's tensors contiguously, 16 KiB aligned, so the pager
fetches one expert with one read. Writes CKPT/experts/ (one page file per MoE layer + index.json
with per-expert CRC32 checksums) atomically.
"""

from __future__ import annotations

import json
import os
import shutil
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import mlx.core as mx
import numpy as np

from rq_core.errors import RQError

ALIGN = 16384
PACK_DIR = "experts"
INDEX = "index.json"
VERSION = 1
_PARTS = ("weight", "scales", "biases")
_NP = {"uint32": np.uint32, "uint8": np.uint8, "float32": np.float32, "float16": np.float16,
       "bfloat16": np.uint16, "int32": np.int32}


@dataclass
class PackResult:
    out: str
    layers: int
    experts: int
    page_bytes: int  # bytes of one expert's page (aligned), largest layer
    bytes_written: int

    def as_dict(self) -> dict:
        return asdict(self)


def expert_banks(model: Any) -> dict[str, Any]:
    """module path -> SwitchGLU-like module (has up_proj/down_proj banks) for every routed-expert bank."""
    from rq_core.models.base import SwitchGLU

    return {p: m for p, m in model.named_modules() if isinstance(m, SwitchGLU)}


def _dtype_name(a: mx.array) -> str:
    return str(a.dtype).split(".")[-1]


def _to_numpy(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a)


def pack(ckpt: str | os.PathLike, *, progress: Optional[Callable[[str, int, int], None]] = None) -> PackResult:
    """Write CKPT/experts/{<layer path>.bin, index.json}."""
    from rq_core.checkpoint import build_model, load_config, load_weights, resolve_model_path

    src = resolve_model_path(ckpt)
    config = load_config(src)
    model = build_model(config, load_weights(src))  # lazy: nothing read until a bank is evaluated
    banks = expert_banks(model)
    if not banks:
        raise RQError(f"{src}: this model has no routed experts to pack")
    tmp = src / f".{PACK_DIR}.tmp-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    index: dict[str, Any] = {"version": VERSION, "alignment": ALIGN, "model_type": config.get("model_type"),
                             "layers": {}}
    total = 0
    max_page = 0
    n_exp = 0
    try:
        for li, (path, sw) in enumerate(banks.items()):
            tensors = []
            for proj in ("gate_proj", "up_proj", "down_proj"):
                if proj not in sw:
                    continue
                lin = sw[proj]
                for part in _PARTS:
                    if part in lin and lin[part] is not None:
                        tensors.append((f"{proj}.{part}", lin[part]))
            mx.eval([t for _, t in tensors])
            arrays = [(n, _to_numpy(t), _dtype_name(t)) for n, t in tensors]
            E = arrays[0][1].shape[0]
            layout, off = [], 0
            for n, a, dt in arrays:
                nb = a[0].nbytes
                layout.append({"name": n, "dtype": dt, "shape": list(a.shape[1:]), "offset": off, "nbytes": nb})
                off += nb
            used = off
            page = -(-used // ALIGN) * ALIGN
            fname = f"{path}.bin"
            crcs = []
            with open(tmp / fname, "wb") as f:
                pad = b"\0" * (page - used)
                for e in range(E):
                    blob = b"".join(a[e].tobytes() for _, a, _ in arrays)
                    crcs.append(zlib.crc32(blob))
                    f.write(blob)
                    f.write(pad)
                f.flush()
                os.fsync(f.fileno())
            index["layers"][path] = {"file": fname, "num_experts": E, "page_bytes": page, "used_bytes": used,
                                     "tensors": layout, "crc32": crcs}
            total += page * E
            max_page = max(max_page, page)
            n_exp += E
            del arrays, tensors
            mx.clear_cache()
            if progress:
                progress("pack", li + 1, len(banks))
        (tmp / INDEX).write_text(json.dumps(index))
        dst = src / PACK_DIR
        if dst.exists():
            old = src / f".{PACK_DIR}.old-{os.getpid()}"
            os.replace(dst, old)
            os.replace(tmp, dst)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, dst)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return PackResult(out=str(src / PACK_DIR), layers=len(banks), experts=n_exp, page_bytes=max_page,
                      bytes_written=total)


def load_index(ckpt: str | os.PathLike) -> dict:
    p = Path(ckpt) / PACK_DIR / INDEX
    if not p.is_file():
        raise RQError(f"{ckpt} has no expert pages (run `rq pack {ckpt}` first)")
    try:
        idx = json.loads(p.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RQError(f"{p} is not valid JSON ({e}): run `rq pack {ckpt}` again")
    if not isinstance(idx, dict) or idx.get("version") != VERSION:
        v = idx.get("version") if isinstance(idx, dict) else None
        raise RQError(f"{p}: unsupported page index version {v!r} (run `rq pack {ckpt}` again)")
    return idx


def decode_page(buf: memoryview | bytes, layout: list[dict]) -> dict[str, np.ndarray]:
    """One expert's tensors (numpy, bf16 as uint16) from its page bytes."""
    out = {}
    for t in layout:
        a = np.frombuffer(buf, dtype=_NP[t["dtype"]], count=t["nbytes"] // np.dtype(_NP[t["dtype"]]).itemsize,
                          offset=t["offset"])
        out[t["name"]] = a.reshape(t["shape"])
    return out
