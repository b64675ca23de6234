"""`rq pack CKPT`: lay out each routed expert's tensors contiguously, aligned (16 KiB; 4 KiB for experts
under 256 KiB, where 16 KiB of padding could cost more than 1/16 of the disk), so the pager fetches one
expert with one read. Writes CKPT/experts/ (or `--out DIR`): one page file per MoE layer +
index.json with per-expert CRC32 checksums and a fingerprint of the tensors each layer came from.

A pack is untrusted input (it may come from the hub with a checkpoint): `load_index` checks every
field before anything is read, page names must be plain names inside the pack, and the pager checks
fingerprints (stale pages) and checksums (corrupt pages).

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
import errno
import fcntl
import hashlib
import json
import os
import re
import shutil
import stat
import struct
import zlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import mlx.core as mx
import numpy as np

from rq_core.errors import RQError

ALIGN = 16384
SMALL_ALIGN = 4096  # pages of experts under 16 x ALIGN, where 16 KiB of padding could cost over 1/16 of the disk
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


def expert_banks(model: Any) -> dict[str, Any]:
    """module path -> SwitchGLU-like module (has up_proj/down_proj banks) for every routed-expert bank."""
    from rq_core.models.base import SwitchGLU

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


def _to_numpy(a: mx.array) -> np.ndarray:
    if a.dtype == mx.bfloat16:
        a = a.view(mx.uint16)
    return np.array(a)


# ------------------------------------------------------------------------------ where a pack lives
_TEMP = re.compile(r"^\.(?P<name>.+)\.(?P<kind>tmp|old)-(?P<pid>\d+)$")


def pages_dir(ckpt: str | os.PathLike, pages: Optional[str | os.PathLike] = None) -> Path:
    """The pack folder: PAGES when given (`rq pack --out`, `rq run --pages`), else CKPT/experts. A
    symlink the user made stands for its target: packs are swapped, and temp folders kept, there."""
    d = Path(pages).expanduser() if pages is not None else Path(ckpt) / PACK_DIR
    return Path(os.path.realpath(d)) if os.path.islink(d) else d


def _temp_name(dst: Path, kind: str, pid: int) -> Path:
    return dst.parent / f".{dst.name}.{kind}-{pid}"


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


# ------------------------------------------------------------------------------ fingerprints
def _read_header(f: Path) -> tuple[dict, int]:
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


def source_fingerprints(ckpt: str | os.PathLike, banks: dict[str, Any]) -> dict[str, str]:
    """Bank path -> a hash of the stored tensors its pages are made of.

    Hashes each bank tensor's name, dtype, shape and 4 sampled 4 KiB windows of its bytes (a few KiB
    of reads per tensor, so it is recomputed at every load). Re-quantizing rewrites every value and a
    new recipe changes shapes or dtypes, so both are caught; a local edit of bytes between the samples
    is not (the pages' checksums cover the pages, not this). Offsets and shard sizes are left out on
    purpose: re-quantizing other tensors moves a bank inside its shard without changing its pages.
    Checkpoints whose bank tensors are renamed at load (a hub layout stacked by sanitize) fall back to
    all shards' headers and sizes: any change of layout is caught, same-size rewrites are not."""
    from rq_core.checkpoint import weight_files

    where: dict[str, tuple[Path, int, dict]] = {}
    whole = hashlib.sha256()
    for f in weight_files(Path(ckpt)):
        hdr, start = _read_header(f)
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
    from rq_core.checkpoint import weight_files

    out: dict[str, dict] = {}
    for f in weight_files(Path(ckpt)):
        hdr, _ = _read_header(f)
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


def _bank_names(banks: dict[str, Any]) -> dict[str, str]:
    return {f"{p}.{n}": p for p, m in banks.items() for n in bank_tensors(m)}


def _check_movable(src: Path, banks: dict[str, Any]) -> None:
    """RQError unless every bank tensor is stored under its own name in a shard that is a file of the checkpoint."""
    from rq_core.checkpoint import weight_files

    names, found = _bank_names(banks), set()
    for f in weight_files(src):
        if f.is_symlink():
            raise RQError(f"{f} is a link (a hub cache?): --move rewrites the shards; copy the checkpoint to a "
                          "folder of its own first")
        found |= set(_read_header(f)[0]) & set(names)
    moved = moved_experts(src)
    missing = [n for n in names if n not in found and names[n] not in moved]
    if missing:
        raise RQError(f"{src}: its routed experts are not stored as stacked banks ({_shown(missing[0])} is not in "
                      "its shards), so --move cannot take them out (quantize it with `rq quantize` first)")


def _move_banks(src: Path, banks: dict[str, Any], fps: dict[str, str]) -> int:
    """Rewrite each shard that holds bank tensors without them (atomically: a temp file renamed over it), recording
    what it held in its metadata; then drop them from the shard index. Returns the bytes taken out."""
    from rq_core.checkpoint import weight_files

    names = _bank_names(banks)
    for f in src.iterdir():  # shards a killed move was writing: ours (the name), their writer gone
        m = re.match(r"^\.(.+\.safetensors)\.tmp-(\d+)$", f.name)
        if m and f.is_file() and not f.is_symlink() and not _pid_alive(int(m[2])):
            f.unlink()
    taken = 0
    for f in weight_files(src):
        hdr, start = _read_header(f)
        take = [k for k in hdr if k in names]
        if not take:
            continue
        keep = sorted(((k, v) for k, v in hdr.items() if k != "__metadata__" and k not in names),
                      key=lambda kv: kv[1]["data_offsets"][0])
        meta = dict(hdr.get("__metadata__") or {})
        rec = json.loads(meta.get(MOVED_KEY, "{}"))
        for k in take:
            p = names[k]
            rec.setdefault(p, {"fingerprint": fps[p], "tensors": {}})["tensors"][k] = {
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
        if isinstance(wm, dict) and any(k in wm for k in names):
            d["weight_map"] = {k: v for k, v in wm.items() if k not in names}
            tmp = src / f".{index.name}.tmp-{os.getpid()}"
            tmp.write_text(json.dumps(d, indent=1))
            with open(tmp, "rb+") as fh:
                os.fsync(fh.fileno())
            os.replace(tmp, index)
            _fsync_dir(src)
    return taken


# ------------------------------------------------------------------------------ writing
def pack(ckpt: str | os.PathLike, *, out: Optional[str | os.PathLike] = None,
         progress: Optional[Callable[[str, int, int], None]] = None, move: bool = False) -> PackResult:
    """Write {<layer path>.bin, index.json} into CKPT/experts (or OUT), replacing a previous pack.

    `move`: then rewrite the shards without the routed expert banks, so the checkpoint holds them once (in
    the pages; it still loads all-resident, reading them from there). Each shard is replaced atomically after
    the pages are complete; a move killed half-way leaves a checkpoint that loads, and is finished by running
    it again."""
    from rq_core.checkpoint import build_model, load_config, load_weights, resolve_model_path

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
        _check_movable(src, banks)
    if moved:
        if not move:
            raise RQError(f"{src}: its routed experts live only in its pages (packed with --move): there is "
                          "nothing to pack again")
        return _finish_move(src, banks)
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
                                     "tensors": layout, "crc32": crcs, "source": fingerprints[path]}
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
        _move_banks(src, banks, fingerprints)
    return PackResult(out=str(dst), layers=len(banks), experts=n_exp, page_bytes=max_page, bytes_written=total)


def _finish_move(src: Path, banks: dict[str, Any]) -> PackResult:
    """`rq pack --move` again on a checkpoint some of whose banks were moved: the pages must be the ones they
    were moved to (they are kept, being their only copy); the banks still in the shards are moved."""
    idx = load_index(src, banks=banks)
    fps = source_fingerprints(src, banks)
    for path, fp in fps.items():
        if idx["layers"][path]["source"] != fp:
            raise RQError(f"the expert pages in {idx['dir']} do not match layer {path} of {src}; its moved experts "
                          "live only in the pages they were moved to: restore those")
    _move_banks(src, banks, fps)
    layers = [idx["layers"][p] for p in banks]
    return PackResult(out=idx["dir"], layers=len(layers), experts=sum(m["num_experts"] for m in layers),
                      page_bytes=max(m["page_bytes"] for m in layers), bytes_written=0)


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
