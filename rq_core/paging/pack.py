"""`rq pack CKPT`: lay out each routed expert's tensors contiguously, aligned (16 KiB; 4 KiB for experts
under 256 KiB, where 16 KiB of padding could cost more than 1/16 of the disk), so the pager fetches one
expert with one read. Writes CKPT/experts/ (or `--out DIR`): one page file per MoE layer +
index.json with per-expert CRC32 checksums and a fingerprint of the tensors each layer came from. The format and
its reading (what checkpoint loading and the pager use) are in rq_core/paging/pages.py.

Replacing a pack is crash-safe: the new pack is written to `.experts.tmp-PID`, the old one renamed to
`.experts.old-PID`, the new one renamed into place. A kill between the two renames leaves the old
pack complete in `.experts.old-PID`; `find_pages` (every load) puts it back, and removes temp folders
of writers that are gone. The checkpoint directory is flock-ed while a writer swaps or a loader cleans up.

`rq pack --move` then stores the routed experts once: each shard holding bank tensors is rewritten without
them (a temp file renamed over it, after the pages are complete), its metadata recording what it held and the
fingerprint those tensors had (so the pager's stale-pages check still holds). Such a checkpoint loads with
lazy placeholders for those banks, filled from the pages (every expert CRC32-checked) on a bank's first call
unless an ExpertPager takes it over. A move killed part-way leaves every shard whole (with or without its
banks), so the checkpoint loads; `rq pack --move` again finishes it, and `rq pack` refuses to re-pack pages
that are the only copy of the experts.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import struct
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import mlx.core as mx
import numpy as np

from rq_core.checkpoint import build_model, load_config, load_weights, resolve_model_path
from rq_core.errors import RQError
from rq_core.paging.pages import (  # noqa: F401  (also the page format's names, for the callers of rq pack's module)
    _NP, INDEX, MOVED_KEY, PACK_DIR, VERSION, _dir_lock, _dtype_name, _only_pack_files, _pid_alive, _shown,
    bank_tensors, check_layer, decode_page, expert_banks, find_pages, load_index, moved_experts, moved_placeholders,
    open_page_file, pages_dir, serve_moved_banks, source_fingerprints, target_dtype)
from rq_core.shards import read_header, weight_files

ALIGN = 16384
SMALL_ALIGN = 4096  # pages of experts under 16 x ALIGN, where 16 KiB of padding could cost over 1/16 of the disk



@dataclass
class PackResult:
    out: str
    layers: int
    experts: int
    page_bytes: int  # bytes of one expert's page (aligned), largest layer
    bytes_written: int

    def as_dict(self) -> dict:
        return asdict(self)


def page_align(used: int) -> int:
    """The alignment of a page of USED bytes: 16 KiB (its padding then at most 1/16 of it), or 4 KiB for an
    expert under 256 KiB."""
    return ALIGN if used >= 16 * ALIGN else SMALL_ALIGN


def _to_numpy(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a)


def _temp_name(dst: Path, kind: str, pid: int) -> Path:
    return dst.parent / f".{dst.name}.{kind}-{pid}"


def _fsync_dir(d: Path) -> None:
    with contextlib.suppress(OSError):
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _check_replaceable(dst: Path) -> None:
    if dst.exists():
        if not dst.is_dir():
            raise RQError(f"{dst} exists and is not a folder (pass --out DIR to write the pages elsewhere)")
        if not _only_pack_files(dst):
            raise RQError(f"{dst} holds files rq pack did not write: move them away, or pass --out DIR")


def _bank_names(banks: dict[str, Any]) -> dict[str, str]:
    return {f"{p}.{n}": p for p, m in banks.items() for n in bank_tensors(m)}


def _loaded_names(model: Any, hdr: dict) -> dict[str, str]:
    """Stored tensor name -> the name it loads under, for one shard's header: the model's `sanitize` of the shard's
    names at once, on lazy placeholders of their shapes (never evaluated), matched back by identity (mlx-lm's
    `switch_mlp.fc1` is Nemotron-H's `up_proj` bank, for one). Tensors sanitize stacks, splits or drops, and every
    name when it fails on a partial layout, keep their stored name: they are not movable banks."""
    stored = {k: mx.zeros(tuple(v["shape"]), mx.float16) for k, v in hdr.items() if k != "__metadata__"}
    same = {k: k for k in stored}
    if not hasattr(model, "sanitize"):
        return same
    try:
        out = model.sanitize(dict(stored))
    except Exception:  # a per-expert or fused layout split across shards: not stacked banks
        return same
    by_id = {id(v): k for k, v in stored.items()}
    for name, v in out.items():
        if id(v) in by_id:
            same[by_id[id(v)]] = name
    return same


def _check_movable(src: Path, model: Any, banks: dict[str, Any]) -> None:
    """RQError unless every bank tensor is stored whole (under a name that loads as it) in a shard that is a file
    of the checkpoint."""
    names, found = _bank_names(banks), set()
    for f in weight_files(src):
        if f.is_symlink():
            raise RQError(f"{f} is a link (a hub cache?): --move rewrites the shards; copy the checkpoint to a "
                          "folder of its own first")
        found |= set(_loaded_names(model, read_header(f)[0]).values()) & set(names)
    moved = moved_experts(src)
    missing = [n for n in names if n not in found and names[n] not in moved]
    if missing:
        raise RQError(f"{src}: its routed experts are not stored as stacked banks ({_shown(missing[0])} is not in "
                      "its shards), so --move cannot take them out (quantize it with `rq quantize` first)")


def _move_banks(src: Path, model: Any, banks: dict[str, Any], fps: dict[str, str]) -> int:
    """Rewrite each shard that holds bank tensors without them (atomically: a temp file renamed over it), recording
    what it held in its metadata; then drop them from the shard index. Returns the bytes taken out."""
    names = _bank_names(banks)
    stored_as: dict[str, str] = {}  # stored name -> loaded name, of every shard read below
    for f in src.iterdir():  # shards a killed move was writing: ours (the name), their writer gone
        m = re.match(r"^\.(.+\.safetensors)\.tmp-(\d+)$", f.name)
        if m and f.is_file() and not f.is_symlink() and not _pid_alive(int(m[2])):
            f.unlink()
    taken = 0
    for f in weight_files(src):
        hdr, start = read_header(f)
        loaded = _loaded_names(model, hdr)
        stored_as.update(loaded)
        take = [k for k in loaded if loaded[k] in names]
        if not take:
            continue
        keep = sorted(((k, v) for k, v in hdr.items() if k != "__metadata__" and k not in take),
                      key=lambda kv: kv[1]["data_offsets"][0])
        meta = dict(hdr.get("__metadata__") or {})
        rec = json.loads(meta.get(MOVED_KEY, "{}"))
        for k in take:  # recorded under the loaded name: inside the bank's path, as loading checks
            p = names[loaded[k]]
            rec.setdefault(p, {"fingerprint": fps[p], "tensors": {}})["tensors"][loaded[k]] = {
                "shape": hdr[k]["shape"], "dtype": hdr[k]["dtype"]}
            taken += hdr[k]["data_offsets"][1] - hdr[k]["data_offsets"][0]
        meta[MOVED_KEY] = json.dumps(rec, sort_keys=True)
        new: dict[str, Any] = {"__metadata__": meta}
        off, spans = 0, []
        for k, v in keep:
            a, b = v["data_offsets"]
            new[k] = {"dtype": v["dtype"], "shape": v["shape"], "data_offsets": [off, off + b - a]}
            spans.append((start + a, b - a))
            off += b - a
        hb = json.dumps(new, separators=(",", ":")).encode()
        hb += b" " * (-len(hb) % 8)
        tmp = f.parent / f".{f.name}.tmp-{os.getpid()}"
        try:
            with open(f, "rb") as fin, open(tmp, "wb") as fout:
                fout.write(struct.pack("<Q", len(hb)) + hb)
                for pos, n in spans:
                    fin.seek(pos)
                    while n:
                        chunk = fin.read(min(n, 64 << 20))
                        if not chunk:
                            raise RQError(f"{f} is truncated")
                        fout.write(chunk)
                        n -= len(chunk)
                fout.flush()
                os.fsync(fout.fileno())
            os.replace(tmp, f)  # the shard with its experts, or without them (recorded): never neither
            _fsync_dir(f.parent)
        except BaseException:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise
    index = src / "model.safetensors.index.json"
    if index.is_file():
        d = json.loads(index.read_text())
        wm = d.get("weight_map")
        if isinstance(wm, dict):  # names of shards a killed move rewrote already: mapped by name alone
            stored_as.update(_loaded_names(model, {k: {"shape": [1]} for k in wm if k not in stored_as}))
        gone = {k for k in wm if stored_as.get(k, k) in names} if isinstance(wm, dict) else set()
        if gone:
            d["weight_map"] = {k: v for k, v in wm.items() if k not in gone}
            tmp = src / f".{index.name}.tmp-{os.getpid()}"
            tmp.write_text(json.dumps(d, indent=1))
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, index)
            _fsync_dir(src)
    return taken


# ------------------------------------------------------------------------------ writing
def write_page_file(d: Path, path: str, arrays: list[tuple[str, np.ndarray, str]], fingerprint: str) -> dict:
    """One MoE layer's page file in folder `d` from its banks' (name, [E, ...] array, dtype name) and the weights'
    fingerprint: expert e's tensors back to back in page e (aligned), fsynced; returns its index.json entry."""
    E = arrays[0][1].shape[0]
    layout, off = [], 0
    for n, a, dt in arrays:
        nb = a[0].nbytes
        layout.append({"name": n, "dtype": dt, "shape": list(a.shape[1:]), "offset": off, "nbytes": nb})
        off += nb
    used = off
    align = page_align(used)
    page = -(-used // align) * align
    fname = f"{path}.bin"
    crcs = []
    with open(d / fname, "wb") as f:
        pad = b"\0" * (page - used)
        for e in range(E):
            blob = b"".join(a[e].tobytes() for _, a, _ in arrays)
            crcs.append(zlib.crc32(blob))
            f.write(blob)
            f.write(pad)
        f.flush()
        os.fsync(f.fileno())
    return {"file": fname, "num_experts": E, "page_bytes": page, "used_bytes": used, "tensors": layout,
            "crc32": crcs, "source": fingerprint}


def pack(ckpt: str | os.PathLike, *, out: Optional[str | os.PathLike] = None,
         progress: Optional[Callable[[str, int, int], None]] = None, move: bool = False) -> PackResult:
    """Write {<layer path>.bin, index.json} into CKPT/experts (or OUT), replacing a previous pack.

    `move`: then rewrite the shards without the routed expert banks, so the checkpoint holds them once (in
    the pages; it still loads all-resident, reading them from there). Each shard is replaced atomically after
    the pages are complete; a move killed half-way leaves a checkpoint that loads, and is finished by running
    it again."""
    src = resolve_model_path(ckpt)
    config = load_config(src)
    if move and out is not None:
        raise RQError("--move keeps the pages in the checkpoint (CKPT/experts): it cannot be combined with --out")
    model = build_model(config, load_weights(src))  # lazy: nothing read until a bank is evaluated
    banks = expert_banks(model)
    if not banks:
        raise RQError(f"{src}: this model has no routed experts to pack")
    moved = moved_experts(src)
    if move:
        _check_movable(src, model, banks)
    if moved:
        if not move:
            raise RQError(f"{src}: its routed experts live only in its pages (packed with --move): there is "
                          "nothing to pack again")
        return _finish_move(src, model, banks)
    dst = pages_dir(src, out)
    if out is not None:
        try:
            dst.parent.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RQError(f"cannot create {dst.parent}: {e.strerror or e}")
    find_pages(src, out)  # a previous writer killed mid-swap: its pack back in place, its temp folders gone
    _check_replaceable(dst)
    fingerprints = source_fingerprints(src, banks)
    tmp = _temp_name(dst, "tmp", os.getpid())
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
    except OSError as e:
        raise RQError(f"cannot write the pages next to {dst} ({e.strerror or e}): pass --out DIR")
    index: dict[str, Any] = {"version": VERSION, "alignment": ALIGN, "model_type": config.get("model_type"),
                             "layers": {}}
    total = 0
    max_page = 0
    n_exp = 0
    try:
        for li, (path, sw) in enumerate(banks.items()):
            tensors = list(bank_tensors(sw).items())
            mx.eval([t for _, t in tensors])
            arrays = [(n, _to_numpy(t), _dtype_name(t)) for n, t in tensors]
            index["layers"][path] = entry = write_page_file(tmp, path, arrays, fingerprints[path])
            E, page = entry["num_experts"], entry["page_bytes"]
            total += page * E
            max_page = max(max_page, page)
            n_exp += E
            del arrays, tensors
            mx.clear_cache()
            if progress:
                progress("pack", li + 1, len(banks))
        with open(tmp / INDEX, "w") as f:  # written last: a folder with an index is a complete pack
            f.write(json.dumps(index))
            f.flush()
            os.fsync(f.fileno())
        _fsync_dir(tmp)
        with _dir_lock(dst.parent, wait=True):
            _check_replaceable(dst)
            if dst.exists():
                # At every instant a loader finds a complete pack: dst, or (between these renames)
                # the old one in .NAME.old-PID, which find_pages also reads and puts back after a kill.
                old = _temp_name(dst, "old", os.getpid())
                os.replace(dst, old)
                os.replace(tmp, dst)
                _fsync_dir(dst.parent)
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.replace(tmp, dst)
                _fsync_dir(dst.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if move:
        _move_banks(src, model, banks, fingerprints)
    return PackResult(out=str(dst), layers=len(banks), experts=n_exp, page_bytes=max_page, bytes_written=total)


def _finish_move(src: Path, model: Any, banks: dict[str, Any]) -> PackResult:
    """`rq pack --move` again on a checkpoint some of whose banks were moved: the pages must be the ones they
    were moved to (they are kept, being their only copy); the banks still in the shards are moved."""
    idx = load_index(src, banks=banks)
    fps = source_fingerprints(src, banks)
    for path, fp in fps.items():
        if idx["layers"][path]["source"] != fp:
            raise RQError(f"the expert pages in {idx['dir']} do not match layer {path} of {src}; its moved experts "
                          "live only in the pages they were moved to: restore those")
    _move_banks(src, model, banks, fps)
    layers = [idx["layers"][p] for p in banks]
    return PackResult(out=idx["dir"], layers=len(layers), experts=sum(m["num_experts"] for m in layers),
                      page_bytes=max(m["page_bytes"] for m in layers), bytes_written=0)
