"""The expert page format and its reading: where a pack lives (`find_pages`, which also recovers from killed
writers), its index (`load_index`, checked field by field), the pages themselves, and the banks `rq pack --move`
left only in the pages (`moved_experts`; checkpoint loading serves them from here). rq_core/paging/pack.py writes
packs; docs/FORMAT.md describes them.

A pack is untrusted input (it may come from the hub with a checkpoint): `load_index` checks every
field before anything is read, page names must be plain names inside the pack, and the pager checks
fingerprints (stale pages) and checksums (corrupt pages).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import zlib
from pathlib import Path
from typing import Any, Iterator, Optional

import mlx.core as mx
import numpy as np

from rq_core.errors import RQError
from rq_core.models.base import SwitchGLU
from rq_core.shards import read_header, weight_files

MOVED_KEY = "rq_moved_experts"  # shard metadata: the banks `rq pack --move` took out (they live only in the pages)
PACK_DIR = "experts"
INDEX = "index.json"
VERSION = 1
_PARTS = ("weight", "scales", "biases")
_PROJS = ("gate_proj", "up_proj", "down_proj")
_NP = {"uint32": np.uint32, "uint8": np.uint8, "float32": np.float32, "float16": np.float16,
       "bfloat16": np.uint16, "int32": np.int32}
_SAMPLE = 4096  # bytes per fingerprint sample window
_SAMPLES = 4  # windows per tensor: first, 1/3, 2/3, last


def expert_banks(model: Any) -> dict[str, Any]:
    """module path -> SwitchGLU-like module (has up_proj/down_proj banks) for every routed-expert bank."""
    return {p: m for p, m in model.named_modules() if isinstance(m, SwitchGLU)}


def bank_tensors(module: Any) -> dict[str, mx.array]:
    """"proj.part" -> the [E, ...] array, for each tensor of an expert bank (what a page holds)."""
    out = {}
    for proj in _PROJS:
        if proj not in module:
            continue
        lin = module[proj]
        for part in _PARTS:
            if part in lin and lin[part] is not None:
                out[f"{proj}.{part}"] = lin[part]
    return out


def _dtype_name(a: mx.array) -> str:
    return str(a.dtype).split(".")[-1]


# ------------------------------------------------------------------------------ where a pack lives
_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)$")


def pages_dir(ckpt: str | os.PathLike, pages: Optional[str | os.PathLike] = None) -> Path:
    """The pack folder: PAGES when given (`rq pack --out`, `rq run --pages`), else CKPT/experts. A
    symlink the user made stands for its target: packs are swapped, and temp folders kept, there."""
    d = Path(pages).expanduser() if pages is not None else Path(ckpt) / PACK_DIR
    return Path(os.path.realpath(d)) if os.path.islink(d) else d


def _pid_alive(pid: int) -> bool:
    if pid == os.getpid():
        return True
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's live process
        return True
    return True


@contextlib.contextmanager
def _dir_lock(parent: Path, *, wait: bool) -> Iterator[bool]:
    """flock on the folder holding the pack: yields whether it was taken (False: a writer holds it)."""
    try:
        fd = os.open(parent, os.O_RDONLY)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | (0 if wait else fcntl.LOCK_NB))
        except OSError as e:
            if e.errno not in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES):
                raise
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _only_pack_files(d: Path) -> bool:
    """True when D holds nothing but what `rq pack` writes (page files and the index): safe to delete."""
    try:
        entries = list(os.scandir(d))
    except OSError:
        return False
    return all((e.name == INDEX or e.name.endswith(".bin")) and not e.is_dir(follow_symlinks=False)
               for e in entries)


def _temps(dst: Path) -> list[tuple[Path, str, bool]]:
    """This pack's temp folders (`.NAME.tmp-PID`, `.NAME.old-PID`): (path, kind, writer alive), old first."""
    out = []
    try:
        entries = list(os.scandir(dst.parent))
    except OSError:
        return out
    for e in entries:
        m = _TEMP.match(e.name)
        if m and m["name"] == dst.name and e.is_dir(follow_symlinks=False):
            out.append((Path(e.path), m["kind"], _pid_alive(int(m["pid"]))))
    return sorted(out, key=lambda t: (t[1] != "old", t[0].name))


def find_pages(ckpt: str | os.PathLike, pages: Optional[str | os.PathLike] = None) -> Path:
    """The pack folder to read. First recovers from writers that were killed: an old pack stranded
    between the two renames goes back in place, and their temp folders are removed (only folders that
    hold nothing but pack files). While a live writer is between its renames, its old pack is read."""
    dst = pages_dir(ckpt, pages)
    temps = _temps(dst)
    if any(not alive for _, _, alive in temps):
        with contextlib.suppress(OSError), _dir_lock(dst.parent, wait=False) as locked:
            if locked:  # no writer is swapping: the dead ones' folders can be handled
                for p, kind, alive in temps:
                    if alive:
                        continue
                    if kind == "old" and (p / INDEX).is_file() and not (dst / INDEX).is_file():
                        if not os.path.lexists(dst):
                            os.replace(p, dst)  # the killed writer's previous pack: complete, put it back
                        continue  # else still the only complete pack: kept (and read below)
                    if _only_pack_files(p):
                        shutil.rmtree(p, ignore_errors=True)
    if (dst / INDEX).is_file():
        return dst
    for p, kind, _ in _temps(dst):
        if kind == "old" and (p / INDEX).is_file():
            return p
    return dst


def source_fingerprints(ckpt: str | os.PathLike, banks: dict[str, Any]) -> dict[str, str]:
    """Bank path -> a hash of the stored tensors its pages are made of.

    Hashes each bank tensor's name, dtype, shape and 4 sampled 4 KiB windows of its bytes (a few KiB
    of reads per tensor, so it is recomputed at every load). Re-quantizing rewrites every value and a
    new recipe changes shapes or dtypes, so both are caught; a local edit of bytes between the samples
    is not (the pages' checksums cover the pages, not this). Offsets and shard sizes are left out on
    purpose: re-quantizing other tensors moves a bank inside its shard without changing its pages.
    Checkpoints whose bank tensors are renamed at load (a hub layout stacked by sanitize) fall back to
    all shards' headers and sizes: any change of layout is caught, same-size rewrites are not."""
    where: dict[str, tuple[Path, int, dict]] = {}
    whole = hashlib.sha256()
    for f in weight_files(Path(ckpt)):
        hdr, start = read_header(f)
        whole.update(json.dumps([f.name, f.stat().st_size, hdr], sort_keys=True).encode())
        for k, v in hdr.items():
            if k != "__metadata__":
                where[k] = (f, start, v)
    out: dict[str, str] = {}
    fds: dict[Path, int] = {}
    moved = moved_experts(ckpt)
    try:
        for path, module in banks.items():
            names = [f"{path}.{n}" for n in bank_tensors(module)]
            if path in moved:  # taken out of the shards by `rq pack --move`: what they were when packed
                out[path] = moved[path]["fingerprint"]
                continue
            if not names or not all(n in where for n in names):
                out[path] = "shards:" + whole.hexdigest()
                continue
            h = hashlib.sha256()
            for n in names:
                f, start, v = where[n]
                try:
                    a, b = (int(x) for x in v["data_offsets"])
                    h.update(json.dumps([n, str(v["dtype"]), [int(s) for s in v["shape"]]]).encode())
                except (KeyError, TypeError, ValueError):
                    raise RQError(f"{f} is not a valid safetensors file (bad entry for {n})")
                if f not in fds:
                    fds[f] = os.open(f, os.O_RDONLY)
                w = min(_SAMPLE, b - a)
                for pos in sorted({a + (b - a - w) * i // (_SAMPLES - 1) for i in range(_SAMPLES)}):
                    h.update(os.pread(fds[f], w, start + pos))
            out[path] = "tensors:" + h.hexdigest()
    finally:
        for fd in fds.values():
            os.close(fd)
    return out


# ------------------------------------------------------------------------------ experts stored once
_ST_TO_MX = {"BF16": "bfloat16", "F16": "float16", "F32": "float32", "U32": "uint32", "U8": "uint8", "I32": "int32"}


def moved_experts(ckpt: str | os.PathLike) -> dict[str, dict]:
    """Bank path -> {"fingerprint", "tensors": {name: {"shape", "dtype"}}} of the banks `rq pack --move` took
    out of CKPT's shards (recorded in the shards' metadata); {} for a checkpoint that holds its experts."""
    out: dict[str, dict] = {}
    for f in weight_files(Path(ckpt)):
        hdr, _ = read_header(f)
        meta = hdr.get("__metadata__")
        raw = meta.get(MOVED_KEY) if isinstance(meta, dict) else None
        if raw is None:
            continue
        bad = RQError(f"{f}: its {MOVED_KEY} metadata is malformed (the checkpoint is damaged: fetch it again)")
        try:
            rec = json.loads(raw)
        except (TypeError, ValueError, RecursionError):
            raise bad
        if not isinstance(rec, dict):
            raise bad
        for path, e in rec.items():
            if not (isinstance(e, dict) and isinstance(e.get("fingerprint"), str) and isinstance(e.get("tensors"), dict)):
                raise bad
            for name, t in e["tensors"].items():
                if not (isinstance(name, str) and name.startswith(f"{path}.") and isinstance(t, dict)
                        and t.get("dtype") in _ST_TO_MX and isinstance(t.get("shape"), list)
                        and all(_is_int(d) for d in t["shape"])):
                    raise bad
            have = out.setdefault(path, {"fingerprint": e["fingerprint"], "tensors": {}})
            if have["fingerprint"] != e["fingerprint"]:
                raise bad
            have["tensors"].update(e["tensors"])
    return out


def moved_placeholders(ckpt: str | os.PathLike, weights: dict[str, mx.array]) -> dict[str, dict]:
    """Add a lazy zero array (never evaluated: `serve_moved_banks` fills the bank first) for every moved bank
    tensor the shards no longer hold; returns moved_experts(ckpt)."""
    moved = moved_experts(ckpt)
    for e in moved.values():
        for name, t in e["tensors"].items():
            if name not in weights:
                weights[name] = mx.zeros(tuple(t["shape"]), getattr(mx, _ST_TO_MX[t["dtype"]]))
    return moved


def serve_moved_banks(model: Any, ckpt: str | os.PathLike, moved: dict[str, dict]) -> None:
    """Banks that live only in the pages are read from them (every expert, CRC32-checked) on their first call,
    unless an ExpertPager takes them over first."""
    banks = expert_banks(model)
    for path, e in moved.items():
        if path not in banks:
            raise RQError(f"{ckpt}: its shards record moved experts of {_shown(path)}, which the model does not have")
        mod = banks[path]
        base = type(mod)

        def __call__(self, *a: Any, _p: str = path, _fp: str = e["fingerprint"], _base: type = base,
                     **kw: Any) -> Any:  # noqa: N807
            _fill_from_pages(self, _p, ckpt, _fp)
            self.__class__ = _base
            return _base.__call__(self, *a, **kw)

        mod.__class__ = type(base.__name__, (base,), {"__call__": __call__, "_rq_base": base})


def _fill_from_pages(module: Any, path: str, ckpt: str | os.PathLike, fp: str) -> None:

    idx = load_index(ckpt, banks={path: module})
    meta = idx["layers"][path]
    if meta["source"] != fp:
        raise RQError(f"the expert pages in {idx['dir']} are not the ones layer {path}'s experts were moved to "
                      "(`rq pack --move`): they are the only copy of them; restore those pages")
    fd = open_page_file(Path(idx["dir"]) / meta["file"], path, meta)
    try:
        used, E = meta["used_bytes"], meta["num_experts"]
        rows = np.empty((E, used), np.uint8)
        for e in range(E):
            buf = os.pread(fd, used, e * meta["page_bytes"])
            if len(buf) != used or zlib.crc32(buf) != meta["crc32"][e]:
                raise RQError(f"corrupt expert page: layer {path} expert {e} (checksum mismatch in "
                              f"{Path(idx['dir']) / meta['file']}): fetch the checkpoint again")
            rows[e] = np.frombuffer(buf, np.uint8)
    finally:
        os.close(fd)
    for t in meta["tensors"]:
        proj, part = t["name"].split(".")
        a = np.ascontiguousarray(rows[:, t["offset"]:t["offset"] + t["nbytes"]]).view(_NP[t["dtype"]])
        x = mx.array(a.reshape(E, *t["shape"]))
        x = x.view(mx.bfloat16) if t["dtype"] == "bfloat16" else x
        target = target_dtype(module, t)
        module[proj][part] = x if x.dtype == target else x.astype(target)


# ------------------------------------------------------------------------------ reading
def _is_int(x: Any, lo: int = 0) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and x >= lo


def _plain_name(s: Any) -> bool:
    """A file name inside the pack folder: no separators, not absolute, not . or .., no NUL."""
    return (isinstance(s, str) and 0 < len(s) <= 255 and s not in (".", "..") and "/" not in s
            and "\\" not in s and "\0" not in s)


def _shown(s: Any) -> str:
    return ascii(s)[:80]  # index strings are untrusted: escaped, short


def check_layer(meta: Any, where: str) -> None:
    """RQError (one line, naming WHERE) unless META is a well-formed layer entry of a page index."""
    def bad(what: str) -> RQError:
        return RQError(f"{where}: {what} (run `rq pack` again)")

    if not isinstance(meta, dict):
        raise bad("layer entry is not an object")
    if not _plain_name(meta.get("file")):
        raise bad("page file must be a plain file name inside the pack folder")
    for k in ("num_experts", "page_bytes", "used_bytes"):
        if not _is_int(meta.get(k), 1):
            raise bad(f"{k} must be a positive integer")
    if meta["used_bytes"] > meta["page_bytes"]:
        raise bad("used_bytes exceeds page_bytes")
    crcs = meta.get("crc32")
    if not isinstance(crcs, list) or len(crcs) != meta["num_experts"] or \
            not all(_is_int(c) and c < 1 << 32 for c in crcs):
        raise bad(f"crc32 must list one 32-bit checksum per expert ({meta['num_experts']})")
    if not isinstance(meta.get("source"), str):
        raise bad("no fingerprint of the weights it was packed from")
    tensors = meta.get("tensors")
    if not isinstance(tensors, list) or not tensors:
        raise bad("tensors must be a non-empty list")
    seen = set()
    for t in tensors:
        if not isinstance(t, dict):
            raise bad("a tensor entry is not an object")
        name = t.get("name")
        if not isinstance(name, str) or name.count(".") != 1 or name.split(".")[0] not in _PROJS or \
                name.split(".")[1] not in _PARTS or name in seen:
            raise bad(f"bad tensor name {_shown(name)}")
        seen.add(name)
        if t.get("dtype") not in _NP:
            raise bad(f"{name}: unknown dtype {_shown(t.get('dtype'))}")
        shape = t.get("shape")
        if not isinstance(shape, list) or not all(_is_int(s) for s in shape):
            raise bad(f"{name}: shape must be a list of non-negative integers")
        if not _is_int(t.get("offset")) or not _is_int(t.get("nbytes")):
            raise bad(f"{name}: offset and nbytes must be non-negative integers")
        if t["nbytes"] != int(np.prod(shape, dtype=object)) * np.dtype(_NP[t["dtype"]]).itemsize:
            raise bad(f"{name}: nbytes does not match its shape and dtype")
        if t["offset"] + t["nbytes"] > meta["used_bytes"]:
            raise bad(f"{name}: lies outside the expert's page")
    spans = sorted((t["offset"], t["offset"] + t["nbytes"], t["name"]) for t in tensors)
    for (_, end, a), (start, _, b) in zip(spans, spans[1:]):
        if start < end:  # each tensor is copied into its own bank from its own bytes
            raise bad(f"tensors {a} and {b} overlap in the expert's page")


def load_index(ckpt: str | os.PathLike, *, pages: Optional[str | os.PathLike] = None,
               banks: Optional[dict[str, Any]] = None) -> dict:
    """The page index of CKPT's pack (PAGES: its folder, default CKPT/experts), checked field by field;
    with BANKS (expert_banks(model)), also that it has pages of the right shapes for every bank."""
    d = find_pages(ckpt, pages)
    p = d / INDEX
    again = f"run `rq pack {ckpt}" + (f" --out {pages}" if pages is not None else "") + "` again"
    if not p.is_file():
        raise RQError(f"{ckpt} has no expert pages in {d} (run `rq pack {ckpt}` first)")
    try:
        idx = json.loads(p.read_bytes())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise RQError(f"{p} is not valid JSON (line {getattr(e, 'lineno', '?')}): {again}")
    if not isinstance(idx, dict) or idx.get("version") != VERSION:
        v = idx.get("version") if isinstance(idx, dict) else None
        raise RQError(f"{p}: unsupported page index version {_shown(v)} ({again})")
    layers = idx.get("layers")
    if not isinstance(layers, dict) or not layers:
        raise RQError(f"{p}: the index lists no layers ({again})")
    idx["dir"] = str(d)
    if banks is None:
        for k, meta in layers.items():
            check_layer(meta, f"{p}: layer {_shown(k)}")
        return idx
    for path, module in banks.items():
        if path not in layers:
            raise RQError(f"{p}: no pages for {path} ({again})")
        meta = layers[path]
        check_layer(meta, f"{p}: layer {path}")
        have = bank_tensors(module)
        names = {t["name"] for t in meta["tensors"]}
        if names != set(have):
            raise RQError(f"{p}: layer {path} holds other tensors than the model's expert bank ({again})")
        for t in meta["tensors"]:
            a = have[t["name"]]
            if tuple(a.shape) != (meta["num_experts"], *t["shape"]):
                raise RQError(f"{p}: layer {path} {t['name']}: pages of shape {meta['num_experts']}x{t['shape']} "
                              f"but the model has {list(a.shape)} ({again})")
            stored = getattr(mx, t["dtype"])
            if not (mx.issubdtype(stored, mx.floating) and mx.issubdtype(a.dtype, mx.floating)) and stored != a.dtype:
                raise RQError(f"{p}: layer {path} {t['name']}: pages hold {t['dtype']}, the model "
                              f"{_dtype_name(a)} ({again})")
    return idx


def decode_page(buf: memoryview | bytes, layout: list[dict]) -> dict[str, np.ndarray]:
    """One expert's tensors (numpy, bf16 as uint16) from its page bytes."""
    out = {}
    for t in layout:
        a = np.frombuffer(buf, dtype=_NP[t["dtype"]], count=t["nbytes"] // np.dtype(_NP[t["dtype"]]).itemsize,
                          offset=t["offset"])
        out[t["name"]] = a.reshape(t["shape"])
    return out


def target_dtype(module: Any, t: dict) -> mx.Dtype:
    """The dtype a page tensor loads as: a float tensor takes the bank's current dtype, others their stored one."""
    proj, part = t["name"].split(".")
    cur = module[proj].get(part) if proj in module else None
    stored = getattr(mx, t["dtype"])
    if cur is None or not mx.issubdtype(stored, mx.floating):
        return stored
    return cur.dtype


def open_page_file(f: Path, path: str, meta: dict) -> int:
    """A read-only fd of a layer's page file, checked to be a regular file of the size the index says."""
    try:  # O_NONBLOCK: a FIFO planted in a pack must not hang the open
        fd = os.open(f, os.O_RDONLY | getattr(os, "O_NONBLOCK", 0))
    except FileNotFoundError:
        raise RQError(f"layer {path}: its page file is missing from {f.parent} (run `rq pack` again)")
    st = os.fstat(fd)
    want = meta["page_bytes"] * meta["num_experts"]
    if not stat.S_ISREG(st.st_mode) or st.st_size != want:
        os.close(fd)
        what = "not a regular file" if not stat.S_ISREG(st.st_mode) else \
            f"{st.st_size} bytes, the index says {want}"
        raise RQError(f"layer {path}: page file {f} is truncated or wrong ({what}): run `rq pack` again")
    return fd
