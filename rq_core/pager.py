"""The expert pager: routed experts live in page files (`rq pack`); each MoE layer keeps a bank of
expert slots (stacked arrays, so one gather_qmm per projection still serves the layer); an LRU over
(layer, expert) decides which slot a missing expert is read into.

The only host sync added to the forward pass is reading the routing indices of each MoE layer,
which a pager cannot avoid (it must know which experts to fetch). Slot writes are lazy scatters
evaluated with the rest of the step.

Pages are checked before use: the index field by field and against the model's banks, the page files'
sizes, the fingerprint of the weights they were packed from (stale pages), and (`verify=True`, the
default) each expert's CRC32 the first time it is read in this process (corrupt pages).

`policy="mmap"` keeps no slots: each call copies the experts it needs out of a memory map of the
page file, leaving caching to the OS page cache (for comparison). Its `resident_bytes` is the most
expert bytes held at once; its hit rate is the OS's and is not measured (None).
"""

from __future__ import annotations

import mmap
import os
import stat
import weakref
import zlib
from collections import OrderedDict
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from rq_core.errors import RQError
from rq_core.pack import decode_page, expert_banks, load_index, source_fingerprints

POLICIES = ("lru", "mmap")


@dataclass
class PagerStats:
    hits: int = 0
    misses: int = 0
    hit_rate: Optional[float] = None
    bytes_read: int = 0
    evictions: int = 0
    resident_bytes: int = 0
    slots: int = 0
    policy: str = "lru"

    def as_dict(self) -> dict:
        return asdict(self)


def _mx_from_np(a: np.ndarray, dtype: str, target: Optional[mx.Dtype] = None) -> mx.array:
    x = mx.array(a)
    x = x.view(mx.bfloat16) if dtype == "bfloat16" else x
    return x if target is None or x.dtype == target else x.astype(target)


def _target_dtype(module: Any, t: dict) -> mx.Dtype:
    proj, part = t["name"].split(".")
    cur = module[proj].get(part) if proj in module else None
    stored = getattr(mx, t["dtype"])
    if cur is None or not mx.issubdtype(stored, mx.floating):
        return stored
    return cur.dtype


def _nbytes(t: dict, dtype: mx.Dtype) -> int:
    return t["nbytes"] // getattr(mx, t["dtype"]).size * dtype.size


class _Layer:
    def __init__(self, pager: "ExpertPager", path: str, module: Any, meta: dict, slots: int, fd: int) -> None:
        # weak: the patched class's closure holds this layer, so a strong reference would keep the model
        # alive in a reference cycle after the caller drops it
        self.pager, self.path, self.module, self.meta = pager, path, weakref.proxy(module), meta
        self.E = meta["num_experts"]
        self.slots = min(slots, self.E)
        self.fd = fd
        # One CRC32 per expert, on its first read: the pack is never rewritten in place (rq pack swaps
        # folders; the open file keeps its bytes), so a page that checked once reads the same bytes again.
        self.checked = bytearray(self.E)
        self.lru: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recent first
        self.free = list(range(self.slots))
        self.map: Optional[mmap.mmap] = None
        self.temp_bytes = 0
        # Banks take the dtype the model holds (e.g. float32 after model.set_dtype on the CPU), pages
        # are cast on load, so paged and resident runs compute the same numbers.
        self.dtypes = {t["name"]: _target_dtype(module, t) for t in meta["tensors"]}
        self.expert_bytes = sum(_nbytes(t, self.dtypes[t["name"]]) for t in meta["tensors"])
        if pager.policy == "mmap":
            self.map = mmap.mmap(self.fd, 0, access=mmap.ACCESS_READ)
        else:  # the banks: [slots, ...] per tensor, zero until first written (lazy: no memory yet)
            for t in meta["tensors"]:
                proj, part = t["name"].split(".")
                self.module[proj][part] = mx.zeros((self.slots, *t["shape"]), self.dtypes[t["name"]])

    @property
    def resident_bytes(self) -> int:
        return self.expert_bytes * self.slots if self.pager.policy == "lru" else 0

    def read(self, e: int) -> dict[str, np.ndarray]:
        used = self.meta["used_bytes"]
        off = e * self.meta["page_bytes"]
        if self.map is not None:
            buf = self.map[off:off + used]
        else:
            buf = os.pread(self.fd, used, off)
        if len(buf) != used:
            raise RQError(f"layer {self.path} expert {e}: short read (truncated page file?)")
        if self.pager.verify and not self.checked[e]:
            if zlib.crc32(buf) != self.meta["crc32"][e]:
                raise RQError(f"corrupt expert page: layer {self.path} expert {e} (checksum mismatch in "
                              f"{self.pager.dir / self.meta['file']}): run `rq pack` again, or fetch the "
                              "checkpoint again")
            self.checked[e] = 1
        self.pager.stats.bytes_read += used
        return decode_page(buf, self.meta["tensors"])

    def load(self, experts: list[int], slots: list[int]) -> None:
        """Read `experts` and write them into `slots` of the banks (one lazy scatter per tensor)."""
        pages = [self.read(e) for e in experts]
        idx = mx.array(np.array(slots, dtype=np.int32))
        for t in self.meta["tensors"]:
            proj, part = t["name"].split(".")
            new = _mx_from_np(np.stack([p[t["name"]] for p in pages]), t["dtype"], self.dtypes[t["name"]])
            bank = self.module[proj][part]
            bank[idx] = new
            self.module[proj][part] = bank

    def acquire(self, needed: np.ndarray) -> dict[int, int]:
        """Make `needed` experts (len <= slots) resident; returns expert -> slot."""
        st = self.pager.stats
        for e in needed:
            if int(e) in self.lru:
                self.lru.move_to_end(int(e))
                st.hits += 1
        miss = [int(e) for e in needed if int(e) not in self.lru]
        slots = []
        for e in miss:
            if self.free:
                s = self.free.pop(0)
            else:
                _, s = self.lru.popitem(last=False)
                st.evictions += 1
            self.lru[e] = s
            slots.append(s)
        st.misses += len(miss)
        if miss:
            self.load(miss, slots)
        return {int(e): self.lru[int(e)] for e in needed}

    def mmap_bank(self, needed: np.ndarray) -> None:
        """mmap policy: a temporary bank holding exactly `needed`, copied out of the mapping."""
        pages = [self.read(int(e)) for e in needed]
        self.pager.stats.misses += len(needed)
        for t in self.meta["tensors"]:
            proj, part = t["name"].split(".")
            self.module[proj][part] = _mx_from_np(np.stack([p[t["name"]] for p in pages]), t["dtype"],
                                                  self.dtypes[t["name"]])
        self.temp_bytes = len(needed) * self.expert_bytes
        pg = self.pager
        pg._mmap_peak = max(pg._mmap_peak, sum(l.temp_bytes for l in pg.layers.values()))

    def close(self) -> None:
        if self.map is not None:
            self.map.close()
        os.close(self.fd)


def _open_pages(f: Path, path: str, meta: dict) -> int:
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


class ExpertPager:
    """Attach to a loaded (lazy) model: the routed-expert banks become slot banks fed from page files.

    `pages`: the pack folder (default CKPT/experts). `verify`: check each expert's CRC32 on its first
    read (off only to measure what it costs)."""

    def __init__(self, model: Any, ckpt: str | os.PathLike, *, slots: int, policy: str = "lru",
                 verify: bool = True, pages: Optional[str | os.PathLike] = None) -> None:
        if policy not in POLICIES:
            raise RQError(f"unknown pager policy {policy!r} (choose from: {', '.join(POLICIES)})")
        banks = expert_banks(model)
        index = load_index(ckpt, pages=pages, banks=banks)
        self.dir = Path(index["dir"])
        again = f"`rq pack {ckpt}" + (f" --out {pages}" if pages is not None else "") + "`"
        for path, fp in source_fingerprints(ckpt, banks).items():
            if index["layers"][path]["source"] != fp:
                raise RQError(f"the expert pages in {self.dir} are stale: layer {path} was packed from other "
                              f"weights than {ckpt} holds now; run {again} again")
        self.policy, self.verify = policy, verify
        self.stats = PagerStats(policy=policy)
        self.layers: dict[str, _Layer] = {}
        fds: dict[str, int] = {}
        try:  # every page file checked before any bank is touched: a refused pack leaves the model as it was
            for path in banks:
                fds[path] = _open_pages(self.dir / index["layers"][path]["file"], path, index["layers"][path])
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        for path, mod in banks.items():
            self.layers[path] = _Layer(self, path, mod, index["layers"][path], slots, fds[path])
        for path, mod in banks.items():
            _patch(mod, self.layers[path])
        self.stats.slots = min(slots, max(l.E for l in self.layers.values()))
        self.stats.resident_bytes = sum(l.resident_bytes for l in self.layers.values())
        self._mmap_peak = 0
        model.expert_pager = self  # generate() decodes synchronously with a pager (see there)

    def report(self) -> PagerStats:
        s = self.stats
        s.hit_rate = s.hits / (s.hits + s.misses) if (self.policy == "lru" and s.hits + s.misses) else None
        if self.policy == "mmap":  # the largest set of expert copies held at once (all layers of a step)
            s.resident_bytes = self._mmap_peak
        return s

    def close(self) -> None:
        for l in self.layers.values():
            l.close()


def _patch(module: Any, layer: _Layer) -> None:
    """Route the SwitchGLU's calls through the pager (class swap on this one instance)."""
    old = type(module)

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:  # noqa: N807
        idx = np.array(indices)  # the one sync routing needs: which experts to fetch
        needed = np.unique(idx)
        if layer.pager.policy == "mmap":
            layer.mmap_bank(needed)
            lut = np.zeros(layer.E, np.int32)
            lut[needed] = np.arange(len(needed), dtype=np.int32)
            return old.__call__(self, x, mx.array(lut[idx]))
        if len(needed) <= layer.slots:
            m = layer.acquire(needed)
            lut = np.zeros(layer.E, np.int32)
            for e, s in m.items():
                lut[e] = s
            return old.__call__(self, x, mx.array(lut[idx]))
        # More distinct experts than slots (a long prefill chunk): serve them in passes of `slots`
        # experts; each (token, k) output comes from exactly one pass.
        y = None
        for i in range(0, len(needed), layer.slots):
            part = needed[i:i + layer.slots]
            m = layer.acquire(part)
            lut = np.full(layer.E, m[int(part[0])], np.int32)
            for e, s in m.items():
                lut[e] = s
            yp = old.__call__(self, x, mx.array(lut[idx]))
            mask = mx.array(np.isin(idx, part))[..., None]
            y = mx.where(mask, yp, 0) if y is None else mx.where(mask, yp, y)
            mx.eval(y)  # the next pass overwrites slots this one reads
        return y

    module.__class__ = type(f"Paged{old.__name__}", (old,), {"__call__": __call__})


def slots_for_budget(model: Any, config: dict, budget: int, *, context: int, prefill_chunk: int,
                     kv_mode: str = "fp16", kv_bits: int = 3, index: Optional[dict] = None,
                     prefill_fp16: Optional[int] = None, edge_layers: int = 0) -> dict[str, Any]:
    """How many expert slots per MoE layer fit `budget` bytes next to the resident weights (measured
    from the loaded model's arrays), the KV cache for `context` tokens, a compressing cache's fp16 prompt while it
    prefills (planner.prefill_fp16_bytes; `prefill_fp16`: kv.prefill_fp16) and a prefill working reserve."""
    from mlx.utils import tree_flatten

    from rq_core.planner import _moe_info, activation_bytes, cache_tokens, kv_bytes, prefill_fp16_bytes

    banks = expert_banks(model)
    bank_ids = {id(v) for m in banks.values() for _, v in tree_flatten(m.parameters())}
    resident = sum(v.nbytes for _, v in tree_flatten(model.parameters()) if id(v) not in bank_ids)
    per_tok, fixed = kv_bytes(config, kv_mode, kv_bits, edge_layers)
    kvb = per_tok * cache_tokens(context) + fixed
    pre = prefill_fp16_bytes(config, kv_mode, context, prefill_fp16, prefill_chunk)
    act = activation_bytes(config, min(prefill_chunk, max(context, 1)))
    n_moe, E, k = _moe_info(config)
    if index is not None:  # in the dtype the model holds (pages are cast on load)
        per_expert = max(sum(_nbytes(t, _target_dtype(banks[p], t)) for t in meta["tensors"])
                         for p, meta in index["layers"].items() if p in banks)
    else:
        per_expert = max(sum(v.nbytes for _, v in tree_flatten(m.parameters())) // max(E, 1)
                         for m in banks.values())
    free = budget - resident - kvb - pre - act
    slots = int(max(0, min(E, free // max(n_moe * per_expert, 1))))
    return {"budget_bytes": budget, "resident_bytes": resident, "kv_bytes": kvb, "prefill_fp16_bytes": pre,
            "activation_bytes": act, "bytes_per_expert": per_expert, "moe_layers": n_moe, "experts_per_layer": E,
            "top_k": k, "slots_per_layer": slots, "fits": slots >= k,
            "planned_peak_bytes": resident + kvb + pre + act + n_moe * slots * per_expert}
