"""The expert pager: routed experts live in page files (`rq pack`); each MoE layer keeps a bank of
expert slots (stacked arrays, so one gather_qmm per projection still serves the layer); an LRU over
(layer, expert) decides which slot a missing expert is read into.

A decode step runs layer by layer: one host sync per MoE layer to read its routing. The layer's work before and
after that read replays as two traced graphs (rq_core.models.base.paged_experts): the second takes the banks as
inputs and reads the slots through an expert -> slot table on the device, and it is built before the read, so the
host builds the layers after a MoE layer while the device runs the ones before it. The read comes at the next MoE
layer (or the step's end): the misses are read together, in parallel (os.preadv on a pool of threads, a page a row of
a host staging buffer, a lone miss cut into pieces), and copied into their slots and the table written, in place (rq_core.paging.
transfer: on CUDA by the copy engine, so no page of managed memory migrates), before the graph that reads them runs.
On CUDA the step may be queued whole instead (`queue`: "auto", the default, where measured steps say it pays;
rq_core.paging.mailbox): each MoE layer's routing reaches the host and its slots the device through page-locked memory
both address, the device waiting inside the step and copying the pages the host read (into a staging buffer it addresses
too) into their slots itself, so it runs on into kernels already launched the moment a layer's experts are in (a step
the device stopped waiting in runs again layer by layer, its caches put back and the experts its answers took in read
again; where such steps keep coming, QUEUE_GIVE_UP of them and half or more of those queued, the pager stops queuing
steps whole).
With speculation (`speculate=`), a step runs on the experts already resident, every layer's routing read with the
sampled token in one sync. Where a layer missed an expert, the layers before it computed what an all-resident model
computes: the step runs again from that layer, its missing experts read first, the caches of the layers from it on
put back (`mark()` of each cache) and the random key kept, until a run misses nothing. A step then costs a sync per
layer that missed instead of one per MoE layer, and the layers after a miss are computed twice. Either way the step
computes what an all-resident model computes. "auto" runs whichever of the two ways its measured times say is faster.

Pages are checked: before use, the index field by field and against the model's banks, the page files'
sizes, the fingerprint of the weights they were packed from (stale pages), and (`verify=True`, the
default) each expert's CRC32 the first time it is read in this process (corrupt pages), on the read threads while
the copies land and the device computes: waited for before the staging rows are read over and before anything
computed from the page is returned (a page that fails leaves its slot and the call raises).

LRU is the only policy. A policy that maps the page files and copies every expert a step uses out of the
mapping on every step reads at least what LRU reads (LRU reads only the misses) and holds as much (the
copies of all layers of a step at once), so it is refused with one line (`rq_core.quant.recipe.GONE_POLICIES`).
"""

from __future__ import annotations

import functools
import os
import statistics
import time
import weakref
import zlib
from collections import OrderedDict, deque
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

import mlx.core as mx
import numpy as np

from rq_core.errors import RQError
from rq_core.models.base import StepResume, resuming, set_bank_inputs, settling, step_resume
from rq_core.paging import mailbox
from rq_core.paging.pack import expert_banks, load_index, open_page_file, source_fingerprints, target_dtype
from rq_core.paging.transfer import Copier, host_cast
from rq_core.quant.recipe import GONE_POLICIES as GONE, POLICIES

READ_THREADS = 8  # parallel page reads of one layer's misses
SPAN_MIN = 256 << 10  # the smallest piece of a page one read thread takes (smaller pieces cost more than they save)
SPECULATE = ("auto", "always", "off")
QUEUE = ("auto", "always", "off")
RESERVE_DIVISOR = 100  # budget // RESERVE_DIVISOR (1%) of a memory budget is left out of the plan's parts
SMOOTHING = 0.1  # weight of the newest step in the running mean of the MoE layers a step reads misses for
RACE_SAMPLES = 3  # "auto": each way's last step times it compares (their medians)
PROBE_STEPS = 32  # "auto": steps before the way it finds slower runs again (doubled each time it stays slower)
PROBE_MAX = 1024  # "auto": the longest stretch of steps between two runs of the way it finds slower
WARMUP_STEPS = 2  # decode steps "auto" does not time: the first runs as written, the second traces the graphs
# Steps queued whole that the device gave up waiting in (each costs mailbox.WAIT_S and a second run) after which a
# pager queues no more steps whole, where they are also half or more of those queued: a model whose steps keep failing
# that way runs a stretch at a time instead
QUEUE_GIVE_UP = 3
# "auto" speculates only while steps miss in fewer MoE layers than this on average: a speculated step runs again from
# every layer that missed (a step missing in each of 40 MoE layers would build 40 partial steps)
MAX_MISSING_LAYERS = 1.0


def check_policy(policy: str, what: str = "pager policy") -> None:
    """RQError (one line) unless POLICY is a pager policy."""
    if policy in GONE:
        raise RQError(GONE[policy])
    if policy not in POLICIES:
        raise RQError(f"unknown {what} {policy!r} (choose from: {', '.join(POLICIES)})")


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
    host_syncs: int = 0  # routing reads: one per speculated step, one per MoE layer call otherwise
    sync_s: float = 0.0  # seconds waiting for the routing reads
    host_s: float = 0.0  # seconds of the pager's own host work (LRU, reads, building the slot writes)
    read_batches: int = 0  # layer calls that read pages (all of their misses at once)
    read_s: float = 0.0  # seconds reading pages (in parallel within a batch) and checking them: bytes_read / read_s
    speculated: int = 0  # decode steps run first on the resident experts (speculate="auto" | "always")
    respun: int = 0  # of those, steps that missed an expert and ran again
    reruns: int = 0  # runs again from a layer that missed (a step that missed in two layers counts two)
    queued: int = 0  # decode steps queued whole, the device waiting for each MoE layer's slots (CUDA: mailbox)
    queue_fallbacks: int = 0  # of those, steps the device stopped waiting in, run again layer by layer
    queue_stopped: bool = False  # steps no longer queued whole: too many of them fell back (QUEUE_GIVE_UP)
    staging_bytes: int = 0  # the staging buffer the pages are read into: host memory, outside MLX's peak
    # on CUDA: the staging buffer is page-locked host memory (the copy engine reads it without staging it again)
    staging_host_resident: bool = False

    def as_dict(self) -> dict:
        return asdict(self)

    def since(self, before: dict) -> dict:
        """The counters since `before` (an earlier as_dict()), the hit rate theirs; sizes and settings as now."""
        now = self.as_dict()
        d = {k: (v - before[k] if k in _COUNTERS else v) for k, v in now.items()}
        d["hit_rate"] = d["hits"] / (d["hits"] + d["misses"]) if d["hits"] + d["misses"] else None
        return d


_COUNTERS = ("hits", "misses", "bytes_read", "evictions", "host_syncs", "sync_s", "host_s", "read_batches", "read_s",
             "speculated", "respun", "reruns", "queued", "queue_fallbacks")


def _nbytes(t: dict, dtype: mx.Dtype) -> int:
    return t["nbytes"] // getattr(mx, t["dtype"]).size * dtype.size


class _Layer:
    def __init__(self, pager: "ExpertPager", path: str, module: Any, meta: dict, slots: int, fd: int,
                 entry: int) -> None:
        # weak: the module holds this layer (and the model the pager), so strong references would make cycles that
        # keep a dropped model's banks (and this layer's views of them) alive until the cycle collector runs
        self.pager, self.path, self.module, self.meta = weakref.proxy(pager), path, weakref.proxy(module), meta
        self.E = meta["num_experts"]
        self.slots = min(slots, self.E)
        self.fd = fd
        self.entry = entry  # this layer's entry in the pager's mailbox (a step queued whole)
        self._lut_stale = False  # the device table lags the host's (a queued step hands the device its slots)
        # One CRC32 per expert, on its first read: the pack is never rewritten in place (rq pack swaps
        # folders; the open file keeps its bytes), so a page that checked once reads the same bytes again.
        self.checked = bytearray(self.E)
        self.lru: OrderedDict[int, int] = OrderedDict()  # expert -> slot, least recent first
        self.free = list(range(self.slots))
        self.lut = np.zeros(self.E, np.int32)  # expert -> slot (0 for experts not resident: never read)
        # Banks take the dtype the model holds (e.g. float32 after model.set_dtype on the CPU), pages
        # are cast on load, so paged and resident runs compute the same numbers.
        self.dtypes = {t["name"]: target_dtype(module, t) for t in meta["tensors"]}
        self.expert_bytes = sum(_nbytes(t, self.dtypes[t["name"]]) for t in meta["tensors"])
        # The banks ([slots, ...] per tensor, zero until first written) and the expert -> slot table on the device
        # are made once and written in place (pager.copier): a graph built before a write reads what it wrote.
        banks = {}
        for t in meta["tensors"]:
            proj, part = t["name"].split(".")
            banks[t["name"]] = self.module[proj][part] = mx.zeros((self.slots, *t["shape"]), self.dtypes[t["name"]])
        self.lut_dev = mx.zeros((self.E,), mx.int32)
        mx.eval(list(banks.values()), self.lut_dev)
        self._raw = {name: Copier.raw(b) for name, b in banks.items()}  # their memory, as bytes
        self._raw_addr = {name: r.ctypes.data for name, r in self._raw.items()}  # and where it starts
        self._lut_raw = Copier.raw(self.lut_dev)

    @property
    def resident_bytes(self) -> int:
        return self.expert_bytes * self.slots

    def _read_span(self, e: int, j: int, a: int, b: int, progress: Optional[Callable[[], None]] = None) -> None:
        """Bytes [a, b) of expert e's page into row j of the staging buffer; then `progress()` (a step queued whole:
        the device waiting for this layer sees the host at work)."""
        used = self.meta["used_bytes"]
        view = memoryview(self.pager._staging_host[j * used + a:j * used + b])
        off = e * self.meta["page_bytes"] + a
        if hasattr(os, "preadv"):
            n = os.preadv(self.fd, [view], off)
        else:  # no preadv on this platform
            buf = os.pread(self.fd, b - a, off)
            n = len(buf)
            view[:n] = buf
        if n != b - a:
            raise RQError(f"layer {self.path} expert {e}: short read (truncated page file?)")
        if progress is not None:
            progress()

    def _check(self, e: int, j: int) -> None:
        """Expert e's page (in row j) against its CRC32, on its first read in this process."""
        used = self.meta["used_bytes"]
        if zlib.crc32(memoryview(self.pager._staging_host[j * used:(j + 1) * used])) != self.meta["crc32"][e]:
            raise RQError(f"corrupt expert page: layer {self.path} expert {e} (checksum mismatch in "
                          f"{self.pager.dir / self.meta['file']}): run `rq pack` again, or fetch the checkpoint again")
        self.checked[e] = 1

    def load(self, experts: list[int], slots: list[int], progress: Optional[Callable[[], None]] = None,
             copies: Optional[list] = None) -> None:
        """Read `experts` (in parallel, into the staging buffer) and copy them into `slots` of the banks, in place
        (`progress()` after each piece read); or, given `copies` (a step queued whole), add to it the copies from the
        staging buffer into the banks that the device makes (experts no more than the buffer holds)."""
        cap = self.pager.stage_experts
        if copies is not None and len(experts) > cap:
            raise RQError(f"internal: {len(experts)} experts for a staging buffer of {cap}")
        for i in range(0, len(experts), cap):  # more than the buffer holds: a long prefill's passes
            self._load(experts[i:i + cap], slots[i:i + cap], progress, copies)

    def _spans(self, n: int) -> list[tuple[int, int]]:
        """How each of n pages is cut for the read threads: whole pages where there are as many pages as threads, else
        pieces of at least SPAN_MIN bytes, so that one layer's single miss is read by several threads too."""
        used, threads = self.meta["used_bytes"], self.pager._threads
        parts = max(1, min(threads // max(n, 1), used // SPAN_MIN))
        step = -(-used // parts)
        return [(a, min(a + step, used)) for a in range(0, used, step)]

    def _load(self, experts: list[int], slots: list[int], progress: Optional[Callable[[], None]],
              copies: Optional[list]) -> None:
        n, used = len(experts), self.meta["used_bytes"]
        pager = self.pager
        pool = pager._pool
        pager.copier.fence()  # the last batch's copies out of the staging rows have landed before they are read over
        pager.join_checks()  # and its checksums have read them
        t0 = time.perf_counter()
        check = [(e, j) for j, e in enumerate(experts) if pager.verify and not self.checked[e]]
        spans = self._spans(n) if pool is not None else [(0, used)]
        if n * len(spans) > 1:
            futures = [pool.submit(self._read_span, e, j, a, b, progress) for j, e in enumerate(experts)
                       for a, b in spans]
            # every read finished before any error is raised: a read still running would write into rows the next
            # batch reads into
            wait(futures)
            for f in futures:
                f.result()
        else:
            for j, e in enumerate(experts):
                self._read_span(e, j, 0, used, progress)
        if check and pool is not None:
            # checked on the pool while the copies land and the device computes (zlib releases the GIL over a large
            # buffer); pager.join_checks waits for them before anything computed from these experts is returned
            pager._checks.append((self, check, [pool.submit(self._check, e, j) for e, j in check]))
        else:
            for e, j in check:
                self._check(e, j)
        st = pager.stats
        st.read_s += time.perf_counter() - t0
        st.bytes_read += n * used
        st.read_batches += 1
        if copies is not None:  # a step queued whole: the device copies the rows into the slots (mailbox `load`)
            for t in self.meta["tensors"]:
                addr, row = self._raw_addr[t["name"]], self._raw[t["name"]].nbytes // self.slots
                copies += [(addr + s * row, pager._staging_dev + j * used + t["offset"], t["nbytes"])
                           for j, s in enumerate(slots)]
            return
        host, cp = pager._staging_host, pager.copier
        base = host.ctypes.data
        for t in self.meta["tensors"]:
            name, off, nb = t["name"], t["offset"], t["nbytes"]
            proj, part = name.split(".")
            raw, row, addr = self._raw[name], self._raw[name].nbytes // self.slots, self._raw_addr[name]
            bank = self.module[proj][part]  # the same memory (a traced graph's inputs come back as new objects)
            if bank.nbytes != raw.nbytes or Copier.address(bank) != addr:
                raise RQError(f"internal: layer {self.path}'s {name} bank was replaced after the pager attached")
            if cp.device_copies and row == nb:  # by address: each row within its bank and the staging buffer
                for j, s in enumerate(slots):
                    cp.copy(addr + s * row, base + j * used + off, nb)
                continue
            for j, s in enumerate(slots):
                src = host[j * used + off:j * used + off + nb]
                if row != nb:  # the model computes in another dtype than the pages hold (float32 on the CPU)
                    src = host_cast(src, t["dtype"], self.dtypes[name])
                    if src is None or src.nbytes != row:
                        raise RQError(f"internal: pages of {t['dtype']} into a {self.dtypes[name]} bank")
                cp.write(raw, s * row, src)

    def acquire(self, needed: np.ndarray, table: bool = True, progress: Optional[Callable[[], None]] = None,
                copies: Optional[list] = None) -> list[int]:
        """Make `needed` experts (len <= slots) resident and (`table`) the device table map them to their slots
        (`progress()` after each piece of a page read); with `copies` (a step queued whole) the pages are read and the
        copies into their slots added to it, for the device to make. The experts it read in (the misses)."""
        st = self.pager.stats
        lru = self.lru
        needed = needed.tolist()
        if self.pager._checks and any(e not in lru for e in needed):
            self.pager.join_checks()  # a page that failed its check leaves its slot before slots are handed out
        miss = []
        for e in needed:
            if e in lru:
                lru.move_to_end(e)
            else:
                miss.append(e)
        st.hits += len(needed) - len(miss)
        if not miss:
            return miss
        self.pager._layers_missed += 1
        if self._lut_raw is None:
            raise RQError(f"the expert pager of {self.path} is closed: it cannot read experts in any more")
        slots = []
        for e in miss:
            if self.free:
                s = self.free.pop(0)
            else:
                _, s = lru.popitem(last=False)
                st.evictions += 1
            lru[e] = s
            self.lut[e] = s
            slots.append(s)
        st.misses += len(miss)
        try:
            self.load(miss, slots, progress, copies)
        except BaseException:  # a page that did not read (a request may be served after the error): not resident
            for e, s in zip(miss, slots):
                if lru.get(e) == s:  # (one whose check failed was dropped already)
                    del lru[e]
                    self.free.append(s)
            raise
        finally:  # the table as the slots now hold (a failed read's slots map to what they held: never read)
            if table:
                self.pager.copier.write(self._lut_raw, 0, self.lut)
                self._lut_stale = False
            else:
                self._lut_stale = True
            self.pager.copier.fence()
        return miss

    def drop(self, e: int) -> None:
        """Expert e is no longer resident (its page failed its check, or a step queued whole that read it in failed):
        its slot is free, a later call reads it again."""
        s = self.lru.pop(e, None)
        if s is not None:
            self.free.append(s)

    def table(self) -> mx.array:
        """The expert -> slot table on the device (one array, written in place as experts come in)."""
        if self._lut_stale:
            self.pager.copier.write(self._lut_raw, 0, self.lut)
            self.pager.copier.fence()
            self._lut_stale = False
        return self.lut_dev

    def routing(self, indices: mx.array) -> tuple[np.ndarray, np.ndarray]:
        """(indices on the host, the distinct experts among them): the one host sync routing needs."""
        st = self.pager.stats
        st.host_syncs += 1
        t0 = time.perf_counter()
        idx = self.pager.copier.read(indices)
        st.sync_s += time.perf_counter() - t0
        return idx, np.unique(idx)

    def resident(self, needed: np.ndarray) -> mx.array:
        """Make `needed` (at most `slots` experts) resident; the expert -> slot table on the device."""
        t0 = time.perf_counter()
        self.acquire(needed)
        table = self.table()
        self.pager.stats.host_s += time.perf_counter() - t0
        return table

    def serve(self, indices: mx.array) -> mx.array:
        """The slots of the experts `indices` [..., k] names, through the device's table: what a decode step's second
        graph reads. Layer by layer, the routing is read and the experts written in before that graph runs (at the
        next MoE layer's serve, or ExpertPager.settle); a speculated step reads the slots as they are, its routing
        read with the step's token."""
        if self.pager._routing is not None:
            rs = step_resume()
            self.pager._routing.append((self, indices, rs.layer if rs is not None else 0))
            return self.table()[indices]
        pager = self.pager
        if not pager._deferring:  # cannot happen: paged_experts serves a layer only within decode_step
            raise RQError("internal: a paged decode layer served outside a decode step")
        if pager._box is not None:
            # the step queued whole: the layer answered on the answers' thread once the device posts it; launched
            # only by settle, which waits for every answer before the build goes on (mailbox: the device must not
            # wait for the answers' thread while this one builds, holding the GIL)
            box = pager._box
            slots = box.post(self.entry, indices)
            pager._answers.submit(functools.partial(self.answer, box, indices.size), box)
            pager._launch = slots
            pager._answers.check()  # a layer that failed: the step is not built further
            return slots
        pager.settle()  # the MoE layer before this one: its experts in before anything after it runs
        mx.async_eval(indices)  # the step up to this routing runs while the host builds the layers after it
        pager._unsettled = (self, indices)
        return self.table()[indices]

    def settle(self, indices: mx.array) -> None:
        """Read a decode step's routing of this layer and make its experts resident (banks and table written in
        place, so the graph already built on `table()[indices]` reads them when it runs)."""
        _, needed = self.routing(indices)
        if len(needed) > self.slots:  # cannot happen: paged_experts asks serves_a_token() first
            raise RQError(f"internal: {len(needed)} experts for {self.slots} slots in one decode step")
        self.resident(needed)

    def answer(self, box: mailbox.Mailbox, n: int) -> None:
        """A queued step's routing of this layer (its n expert ids) from the mailbox once the device posts it, its
        experts made resident, their slots back through the mailbox: the device runs on. On the answers' thread
        (mailbox.Answers), the only one that touches the LRU, the slots and the copier while the step runs (the bank
        arrays it takes the address of were evaluated when the pager attached: nothing waits on MLX's queue)."""
        st = self.pager.stats
        st.host_syncs += 1
        t0 = time.perf_counter()
        idx = box.fetch(self.entry, n)
        t1 = time.perf_counter()
        st.sync_s += t1 - t0
        needed = np.unique(idx)
        if len(needed) > self.slots:  # cannot happen: paged_experts asks serves_a_token() first
            raise RQError(f"internal: {len(needed)} experts for {self.slots} slots in one decode step")
        copies: list = []
        miss = self.acquire(needed, table=False, progress=functools.partial(box.progress, self.entry), copies=copies)
        self.pager._answered.append((self, miss))  # forgotten where the step fails (the device may not copy them)
        box.answer(self.entry, self.lut[idx], copies)
        st.host_s += time.perf_counter() - t1

    def stepping(self) -> bool:
        """Whether a decode step is being built through the pager's decode_step (layer by layer or speculated): only
        then does a MoE layer run as two graphs with its routing read between them (base.paged_experts)."""
        return self.pager._deferring or self.pager._routing is not None

    def serves_a_token(self) -> bool:
        """Whether one token's experts fit the slots at once (top-k is known once a call has been seen)."""
        return self.pager.top_k is not None and self.pager.top_k <= self.slots

    def close(self) -> None:
        os.close(self.fd)
        self._raw, self._raw_addr, self._lut_raw = {}, {}, None  # the banks' memory: not kept past the pager's use


class Race:
    """Two ways of running a step (True and False), chosen by their measured times: each tried in turn (True first)
    until each has RACE_SAMPLES - 1 times, then the faster by the medians of each way's last RACE_SAMPLES times, the
    slower once after PROBE_STEPS picks, then after twice as many each time it stays the slower (up to PROBE_MAX),
    after PROBE_STEPS again once the order changes."""

    def __init__(self) -> None:
        self.times: dict[bool, deque] = {True: deque(maxlen=RACE_SAMPLES), False: deque(maxlen=RACE_SAMPLES)}
        self.probe_every = PROBE_STEPS
        self._picks = 0
        self._probed = 0  # the pick the next probe counts from (the last probe, or when the faster was first known)
        self._probing = False

    def faster(self) -> Optional[bool]:
        """The faster way by the medians of each way's last times (None: not timed enough yet)."""
        a, b = self.times[True], self.times[False]
        if len(a) < RACE_SAMPLES - 1 or len(b) < RACE_SAMPLES - 1:
            return None
        return statistics.median(a) <= statistics.median(b)

    def pick(self) -> bool:
        """The way to run the next step (whose time `record` then takes)."""
        self._picks += 1
        faster = self.faster()
        if faster is None:
            return len(self.times[True]) <= len(self.times[False])
        if self._picks - self._probed >= self.probe_every:
            self._probed, self._probing = self._picks, True
            return not faster
        return faster

    def record(self, way: bool, seconds: float) -> None:
        before = self.faster()
        self.times[way].append(seconds)
        if before is None:
            self._probed = self._picks  # the probes count from when the faster is first known
        elif self._probing:
            self._probing = False
            same = before == self.faster()
            self.probe_every = min(2 * self.probe_every, PROBE_MAX) if same else PROBE_STEPS


class ExpertPager:
    """Attach to a loaded (lazy) model: the routed-expert banks become slot banks fed from page files.

    `pages`: the pack folder (default CKPT/experts). `verify`: check each expert's CRC32 on its first
    read (off only to measure what it costs). `threads`: parallel reads of one layer's misses. `speculate`: "always"
    runs each decode step on the resident experts with one host sync a run, again from the first layer that missed (see
    the module's text); "off", layer by layer, a sync a MoE layer; "auto" (the default) whichever its measured step
    times say is faster (`benchmarks/pager.py --speculate off,auto` compares them). `queue`: on CUDA, "always" queues a
    layer-by-layer step whole, the device waiting for each MoE layer's slots and copying its pages in
    (rq_core.paging.mailbox); "off", a stretch between two MoE layers at a time, as on Metal and the CPU; "auto" (the
    default) whichever its measured step times say is faster (`benchmarks/pager.py --by-stretch` compares).
    `memory_limit`: the bytes MLX may hold for this run (slots_for_budget's memory_limit_bytes: what the budget leaves
    MLX), its memory limit while the pager serves on top of what MLX held before, at most MLX's limit as it was
    (restored by close())."""

    def __init__(self, model: Any, ckpt: str | os.PathLike, *, slots: int, policy: str = "lru",
                 verify: bool = True, pages: Optional[str | os.PathLike] = None,
                 threads: int = READ_THREADS, speculate: str = "auto", queue: str = "auto",
                 memory_limit: Optional[int] = None) -> None:
        check_policy(policy)
        mlx_before = mx.get_active_memory()  # what MLX held before this run's weights (the model is lazy until here)
        if speculate not in SPECULATE:
            raise RQError(f"unknown speculation {speculate!r} (choose from: {', '.join(SPECULATE)})")
        if queue not in QUEUE:
            raise RQError(f"unknown step queuing {queue!r} (choose from: {', '.join(QUEUE)})")
        banks = expert_banks(model)
        index = load_index(ckpt, pages=pages, banks=banks)
        self.dir = Path(index["dir"])
        again = f"`rq pack {ckpt}" + (f" --out {pages}" if pages is not None else "") + "`"
        for path, fp in source_fingerprints(ckpt, banks).items():
            if index["layers"][path]["source"] != fp:
                raise RQError(f"the expert pages in {self.dir} are stale: layer {path} was packed from other "
                              f"weights than {ckpt} holds now; run {again} again")
        self.policy, self.verify, self.speculate = policy, verify, speculate
        self.copier = Copier()  # the slot writes, the table's and the routing reads (on CUDA by the copy engine)
        self.stats = PagerStats(policy=policy)
        self.layers: dict[str, _Layer] = {}
        fds: dict[str, int] = {}
        try:  # every page file checked before any bank is touched: a refused pack leaves the model as it was
            for path in banks:
                fds[path] = open_page_file(self.dir / index["layers"][path]["file"], path, index["layers"][path])
        except BaseException:
            for fd in fds.values():
                os.close(fd)
            raise
        for entry, (path, mod) in enumerate(banks.items()):
            self.layers[path] = _Layer(self, path, mod, index["layers"][path], slots, fds[path], entry)
        for path, mod in banks.items():
            _patch(mod, self.layers[path])
        # a decode step's graphs read the banks as inputs (the pager rewrites their slots between steps): registered
        # on every module above a bank, whose graphs traced before (holding the full banks) are dropped
        for name, m in model.named_modules():
            held = [mod for path, mod in banks.items() if not name or path.startswith(name + ".")]
            if held:
                set_bank_inputs(m, [getattr(mod, p) for mod in held for p in ("gate_proj", "up_proj", "down_proj")
                                    if p in mod])
        self.stats.slots = min(slots, max(l.E for l in self.layers.values()))
        self.stats.resident_bytes = sum(l.resident_bytes for l in self.layers.values())
        # one staging buffer for every layer (layers run one after another), made at the first call, when top-k
        # is known: room for min(slots, top-k) pages (a decode step's misses of one layer)
        # bank paths, not the modules: a module -> pager reference cycle would keep a dropped model's banks alive
        self._index, self._bank_paths, self._slots, self._threads = index, set(banks), slots, threads
        self.top_k: Optional[int] = None  # experts a token takes, from the first call
        self._token_fits = False  # every layer takes a token's experts at once (known with top_k)
        self.stage_experts = 0
        # the staging buffer the page reads write into and the slot writes copy from (Copier.host_buffer; with a mailbox
        # memory the device reads too, at _staging_dev)
        self._staging_host: Optional[np.ndarray] = None
        self._staging_dev = 0
        # within decode_step's build, the MoE layer whose routing is not read yet: (layer, routing indices). Its second
        # graph is built on the device table before the read, and runs only after it (`settle`, which the build calls
        # before it queues the step: generate._queue_step)
        self._deferring = False
        self._unsettled: Optional[tuple] = None
        self._pool = ThreadPoolExecutor(max_workers=threads) if threads > 1 else None
        self._checks: list = []  # (layer, [(expert, staging row)], futures): checksums still running (join_checks)
        self._routing: Optional[list] = None  # while a step speculates: (layer, routing indices, decoder layer)
        # speculate="auto": speculated steps (True) against layer-by-layer ones, misses included in both
        self._spec_race = Race()
        self._steps = 0
        self._missing: Optional[float] = None  # running mean of the MoE layers a decode step read misses for
        self._layers_missed = 0  # calls of acquire that read misses, so far
        self._layered_steps = 0  # decode steps run layer by layer (not speculated), so far
        # `queue`, on CUDA: a layer-by-layer step queued whole, the device waiting for each layer's slots
        # (rq_core.paging.mailbox; made with the staging buffer)
        self._queue = queue
        # queue="auto": steps queued whole (True) against steps by stretch (which is faster depends on the machine:
        # how fast the device reads the staging buffer, how long the host takes to build a stretch)
        self._queue_race = Race()
        self.mailbox: Optional[mailbox.Mailbox] = None
        self._answers: Optional[mailbox.Answers] = None  # the thread that answers its layers (made with it)
        self._box: Optional[mailbox.Mailbox] = None  # the mailbox while a step that uses it is being built
        self._answered: list = []  # (layer, experts read in) of that step's answers
        self._launch: Optional[mx.array] = None  # the last posted layer's slots, where not launched yet
        # MLX's memory limit while the pager serves (restored by close): MLX allocates a queued graph's buffers as it
        # encodes it and frees them as the device finishes it, so a step queued ahead holds its whole working memory
        # at once; over the limit, MLX's eval waits for queued work to finish before it encodes more (and its
        # allocator keeps freed buffers cached only within the limit). Never above MLX's own limit (a share of the
        # device's memory): a budget larger than the device must not lift MLX's guard
        self._old_memory_limit = None
        if memory_limit is not None:
            self._old_memory_limit = mx.set_memory_limit(min(mlx_before + memory_limit, mx.get_memory_limit()))
        model.expert_pager = self  # generate() decodes through decode_step with a pager (see there)

    def _speculation_pays(self) -> bool:
        """"auto": layer by layer while steps miss in MAX_MISSING_LAYERS MoE layers or more on average; then as its
        Race says (what pays changes with the context and with how often steps miss). Never where a layer cannot take
        a token's experts at once (such a step always runs layer by layer)."""
        if self.speculate == "off" or not self._token_fits:
            return False
        if self.speculate == "always":
            return True
        self._steps += 1
        if self._missing is None or self._missing >= MAX_MISSING_LAYERS:
            return False
        return self._spec_race.pick()

    def _queue_pays(self) -> bool:
        """Whether this layer-by-layer step is queued whole (a mailbox made, past the warm-up): "always", never with
        "off"; "auto" as its Race says."""
        if self._queue != "auto":
            return self._queue == "always"
        return self._queue_race.pick()

    def decode_step(self, build: Callable[[Optional[mx.array]], tuple[mx.array, mx.array]], cache: list, *,
                    draws: bool = False) -> tuple[mx.array, mx.array]:
        """Run one decode step, `build(key)` -> (sampled id, read array [id, finite]), and return them evaluated;
        `build` calls `settle()` before it queues the step (generate._queue_step's `before_eval`), and code that
        evaluates arrays in the middle of the build calls base.settle_step() first (the layer-by-layer step builds a
        MoE layer's second graph before its experts are in: evaluated early, it would read the slots as they were).
        `draws`: the step samples from MLX's random sequence; `key` is then the key to sample with (None: the
        global sequence's next). Speculated first when that pays (see the module's text); the tokens are those
        of an all-resident model either way, sampled ones included."""
        caches = list({id(c): c for c in cache}.values())
        t0 = time.perf_counter()
        missed0 = self._layers_missed
        markable = all(callable(getattr(c, "mark", None)) for c in caches)  # a step run again puts them back
        spec = self._speculation_pays() and markable
        self._unsettled = None
        if spec:
            out = self._speculate(build, cache, caches, draws)
            if out is not None:
                self.join_checks()
                self._time_speculation(True, time.perf_counter() - t0)
                self._count_missing(missed0)
                return out
        self._layered_steps += 1
        # the first steps load the decode kernels (see mailbox); a cache that cannot be put back cannot run again
        timed = self.mailbox is not None and self._layered_steps > WARMUP_STEPS and markable and \
            not self.stats.queue_stopped
        t1 = time.perf_counter()  # (a speculated run that fell back before this is not the queuing's to count)
        box = self.mailbox if timed and self._queue_pays() else None
        out, recounted = None, 0
        if box is not None:  # queued whole; where the device gave up waiting, the caches back and layer by layer
            st = self.stats
            st.queued += 1
            served = st.hits + st.misses
            self._answered = []
            undo = [c.mark() for c in caches]
            key = mx.random.split(mx.random.state[0])[1] if draws else None  # as the layered step would draw
            try:
                out = self._layered(build, key, box)
            except mailbox.Abandoned:
                pass
            except BaseException:  # (a page that failed its check): the caches as before the step
                self._forget_answered()
                for f in undo:
                    f()
                raise
            if out is None or box.failed():
                out = None
                st.queue_fallbacks += 1
                self._forget_answered()
                if st.queue_fallbacks >= QUEUE_GIVE_UP and 2 * st.queue_fallbacks >= st.queued:
                    st.queue_stopped = True  # the next steps a stretch at a time (the mailbox is kept for close)
                recounted = st.hits + st.misses - served  # the run again finds these resident: not hits twice
                for f in undo:
                    f()
                self._unsettled = None
            elif draws:
                mx.random.uniform(shape=(0,))  # move the sequence on by the key the step used
        if out is None:
            out = self._layered(build, None, None)
            self.stats.hits -= recounted
        y, read = out
        # a speculated step that fell back costs both runs (and a step queued whole that fell back, both of its runs)
        self._time_speculation(spec, time.perf_counter() - t0)
        if timed and self._queue == "auto":
            self._queue_race.record(box is not None, time.perf_counter() - t1)
        self._count_missing(missed0)
        return y, read

    def _time_speculation(self, spec: bool, seconds: float) -> None:
        # the first steps trace the decode graphs (seconds on a GPU, against milliseconds a step): not timed
        if self.speculate == "auto" and self._steps > WARMUP_STEPS:
            self._spec_race.record(spec, seconds)

    def _forget_answered(self) -> None:
        """A step queued whole that failed or raised: the experts its answers took in are taken out of their slots (the
        device copies an entry's pages only where its wait saw the answer), read again by the run again (whose misses
        count them), and their layers' calls are not counted twice."""
        for layer, miss in self._answered:
            for e in miss:
                layer.drop(e)
            self.stats.misses -= len(miss)
            self._layers_missed -= bool(miss)
        self._answered = []

    def _layered(self, build: Callable[[Optional[mx.array]], tuple[mx.array, mx.array]], key: Optional[mx.array],
                 box: Optional[mailbox.Mailbox]) -> tuple[mx.array, mx.array]:
        """The step layer by layer, queued whole through `box` or a stretch between two MoE layers at a time; (id,
        read) evaluated."""
        self._deferring, self._box, self._launch = True, box, None
        if box is not None:
            box.open()
        try:
            with settling(self.settle):  # an evaluation inside the build (a cache's chunked coding) settles first
                y, read = build(key)
            if self._unsettled is not None:
                raise RQError("internal: a decode step was queued before its last MoE layer's experts were in")
            if box is not None:
                self.settle()  # (build settles before it queues: this only makes sure every layer is answered)
        except BaseException:
            if box is not None:  # the device may be waiting on a layer: let the queued step drain
                box.release_all()
                self._answers.join(raise_error=False)
                mx.synchronize()
            raise
        finally:
            self._deferring, self._unsettled, self._box, self._launch = False, None, None, None
        mx.eval(read)
        self.join_checks()
        return y, read

    def _count_missing(self, before: int) -> None:
        n = self._layers_missed - before
        self._missing = n if self._missing is None else self._missing + SMOOTHING * (n - self._missing)

    def _speculate(self, build: Callable[[Optional[mx.array]], tuple[mx.array, mx.array]], cache: list,
                   caches: list, draws: bool) -> Optional[tuple[mx.array, mx.array]]:
        """The step on the experts already resident, every MoE layer's routing read with its token in one sync; where
        a layer missed, its experts are read and the step runs again from that layer (the layers before it computed
        what an all-resident model does, their caches and inputs are kept). (id, read), or None where a layer's
        experts do not fit its slots at once (the caller runs the step layer by layer, the caches as before it)."""
        st = self.stats
        first = {}  # each cache's first layer (a cache object listed for several layers goes back with its first)
        for i, c in enumerate(cache):
            first.setdefault(id(c), i)
        undo = {id(c): c.mark() for c in caches}
        # the key sampling without one would draw with, taken without moving the sequence on
        key = mx.random.split(mx.random.state[0])[1] if draws else None
        rs = StepResume()
        st.speculated += 1
        runs = 0
        hits: list = []  # (layer, experts) of the layers kept so far, all resident: counted once the step is done
        loaded: set = set()  # layers whose misses this step read (acquire counted them, hits and misses)
        while True:
            runs += 1
            self._routing = []
            try:
                with resuming(rs):
                    y, read = build(key)
            finally:
                routing, self._routing = self._routing, None
            flat = mx.concatenate([read.astype(mx.int32)] + [i.reshape(-1).astype(mx.int32) for _, i, _ in routing])
            ids = self.copier.read(flat)[2:]  # the run's one sync: its token and every MoE layer's routing
            st.host_syncs += 1
            t1 = time.perf_counter()
            at, missed = 0, None
            for layer, idx, where in routing:
                u = np.unique(ids[at:at + idx.size])
                at += idx.size
                if len(u) > layer.slots:
                    missed = (layer, None, where)
                    break
                if not all(e in layer.lru for e in u.tolist()):
                    missed = (layer, u, where)
                    break
                if layer not in loaded:  # a layer that missed counted its hits as it read its misses
                    hits.append((layer, u))
            if missed is None:
                for layer, u in hits:
                    layer.acquire(u)  # all hits: the LRU order and counts a layer-by-layer step leaves
                if draws:
                    mx.random.uniform(shape=(0,))  # move the sequence on by the key the step used
                st.host_s += time.perf_counter() - t1
                return y, read
            del y, read, flat
            st.respun += runs == 1
            layer, u, where = missed
            if u is None or not rs.resumable:  # the whole step again, layer by layer (it counts every layer's hits)
                for f in undo.values():
                    f()
                st.host_s += time.perf_counter() - t1
                return None
            # the layers from `where` on run again: their caches back to before the step, the missing experts in
            for c in caches:
                if first[id(c)] >= where:
                    undo[id(c)]()
                    undo[id(c)] = c.mark()
            layer.acquire(u)
            loaded.add(layer)
            rs.start = where
            st.reruns += 1
            st.host_s += time.perf_counter() - t1

    def join_checks(self) -> None:
        """Wait for the checksums of the pages read so far; RQError (the first mismatch) where one failed, its expert
        dropped from its slot. Called before the staging rows are read over and before a step's or a call's result
        is returned, so nothing computed from a corrupt page comes out."""
        pending, self._checks = self._checks, []
        error = None
        for layer, check, futures in pending:
            wait(futures)
            for (e, _), f in zip(check, futures):
                if f.exception() is not None:
                    layer.drop(e)
                    error = error or f.exception()
        if error is not None:
            raise error

    def _ready(self, top_k: int) -> None:
        if self._staging_host is None:
            self.stage_experts = max(1, min(self._slots, top_k))
            self.top_k = top_k
            self._token_fits = all(l.serves_a_token() for l in self.layers.values())  # fixed from here on
            n = staging_bytes(self._index, self._bank_paths, self._slots, top_k)
            self.stats.staging_bytes = n
            # the device copies a queued step's pages itself: only where the banks hold the pages' dtype
            same = all(l.dtypes[t["name"]] == getattr(mx, t["dtype"]) for l in self.layers.values()
                       for t in l.meta["tensors"])
            if self._queue != "off" and self._token_fits and same and mailbox.available(self.copier):
                copies = top_k * max(len(l.meta["tensors"]) for l in self.layers.values())
                try:
                    box = mailbox.Mailbox(self.copier, len(self.layers), top_k, copies)
                    self._staging_host, self._staging_dev = box.staging_buffer(n)
                    self.mailbox = box
                except (RQError, RuntimeError):  # no page-locked memory the device addresses, kernels that do not
                    self.mailbox = None  # build here: the step queued a stretch at a time
                else:
                    self._answers = mailbox.Answers()
                    weakref.finalize(self, self._answers.stop)  # a pager dropped unclosed: its thread ends too
            if self._staging_host is None:
                self._staging_host = self.copier.host_buffer(n)  # host memory, not MLX's: its peak does not count it
            self.stats.staging_host_resident = self.copier.pinned

    def settle(self) -> None:
        """The pending MoE layer of a decode step being built (serve): its routing read, its experts made resident.
        The step's build calls it before it queues the step (a no-op where no layer is pending). In a step queued
        whole: the posted layers launched, and every one answered."""
        if self._box is not None:
            if self._launch is not None:
                mx.async_eval(self._launch)
                self._launch = None
            self._answers.join()
            return
        if self._unsettled is not None:
            layer, indices = self._unsettled
            self._unsettled = None
            layer.settle(indices)

    def report(self) -> PagerStats:
        s = self.stats
        s.hit_rate = s.hits / (s.hits + s.misses) if s.hits + s.misses else None
        return s

    def close(self) -> None:
        if self._answers is not None:  # first: its answers use the pool, the copier and the mailbox
            self._answers.stop()
            self._answers = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
            self._checks = []
            self._pool = None
        self._staging_host = None
        self.mailbox = None  # in the copier's page-locked memory
        self.copier.close()
        for l in self.layers.values():
            l.close()
        if self._old_memory_limit is not None:
            mx.set_memory_limit(self._old_memory_limit)
            self._old_memory_limit = None


def staging_bytes(index: dict, banks: Iterable[str], slots: int, top_k: int) -> int:
    """Bytes of the pager's staging buffer (host memory): min(slots, top_k) pages (used bytes) of the largest layer of
    `banks` (their paths): a decode step's misses of one layer at once."""
    n = max(1, min(slots, top_k))
    return max((min(n, m["num_experts"]) * m["used_bytes"] for p, m in index["layers"].items() if p in banks),
               default=0)


def _patch(module: Any, layer: _Layer) -> None:
    """Route the SwitchGLU's calls through the pager (class swap on this one instance); a decode step's layers call
    `layer.serve` themselves, between two graphs (rq_core.models.base.paged_experts)."""
    old = getattr(type(module), "_rq_base", type(module))  # a bank served from the pages: the pager takes over

    def __call__(self, x: mx.array, indices: mx.array) -> mx.array:  # noqa: N807
        layer = self.__dict__["pager_layer"]  # not the closure's: the class lives until the cycle collector runs
        layer.pager._ready(indices.shape[-1])
        layer.pager.settle()
        if layer.pager._routing is not None:  # a speculated step: the slots as they are, routing read later
            return old.compute(self, x, layer.serve(indices))
        idx, needed = layer.routing(indices)
        if len(needed) <= layer.slots:
            # evaluated here: the slots are written in place, and a later call's misses must not land in them
            # before this call's experts have run (the caller may build several calls before it evaluates one)
            y = old.compute(self, x, layer.resident(needed)[indices])  # remapped on the device
            mx.eval(y)
            layer.pager.join_checks()
            return y
        # More distinct experts than slots (a long prefill chunk): serve them in passes of `slots` experts, each
        # computing only the (token, k) rows of its experts, grouped by slot, as the all-resident model computes a
        # prompt's rows grouped by expert. The resident ones go first, so the first pass reads only what it lacks
        # and no pass evicts an expert a later pass needs: each missing expert is read once.
        lru = layer.lru
        order = [e for e in needed.tolist() if e in lru]
        order += [e for e in needed.tolist() if e not in lru]
        flat = idx.reshape(-1)
        rank = np.empty(layer.E, np.int64)
        rank[order] = np.arange(len(order))
        pass_of = rank[flat] // layer.slots
        tokens = x.reshape(-1, x.shape[-1])
        k = idx.shape[-1]
        outs, rows_all = [], []
        for i in range(0, len(order), layer.slots):
            part = np.asarray(order[i:i + layer.slots], dtype=needed.dtype)
            t0 = time.perf_counter()
            layer.acquire(part)
            layer.pager.stats.host_s += time.perf_counter() - t0
            rows = np.flatnonzero(pass_of == i // layer.slots)
            slot = layer.lut[flat[rows]]
            by_slot = np.argsort(slot, kind="stable")
            rows, slot = rows[by_slot], slot[by_slot]
            xr = mx.expand_dims(tokens[mx.array(rows // k)], -2)
            outs.append(old.compute_grouped(self, xr, mx.array(slot)))
            rows_all.append(rows)
            layer.pager.stats.host_syncs += 1
            t0 = time.perf_counter()
            mx.eval(outs[-1])  # the next pass overwrites slots this one reads
            layer.pager.stats.sync_s += time.perf_counter() - t0
        layer.pager.join_checks()
        rows = np.concatenate(rows_all)
        back = np.empty_like(rows)
        back[rows] = np.arange(len(rows))
        y = mx.concatenate(outs)[mx.array(back)]
        return y.reshape(*idx.shape, y.shape[-1])

    module.__class__ = type(f"Paged{old.__name__}", (old,), {"__call__": __call__})
    module.__dict__["pager_layer"] = layer


def slots_for_budget(model: Any, config: dict, budget: int, *, context: int, prefill_chunk: int,
                     kv_mode: str = "fp16", kv_bits: int = 3, index: Optional[dict] = None,
                     prefill_fp16: Optional[int] = None, edge_layers: int = 0) -> dict[str, Any]:
    """How many expert slots per MoE layer fit `budget` bytes next to the resident weights (measured
    from the loaded model's arrays), the KV cache for `context` tokens, a compressing cache's fp16 prompt while it
    prefills (planner.prefill_fp16_bytes; `prefill_fp16`: kv.prefill_fp16) and a prefill working reserve.
    `memory_limit_bytes`: what the budget leaves MLX (less the reserve and the staging buffer, host memory), its
    memory limit while the pager serves (ExpertPager's `memory_limit`)."""
    from mlx.utils import tree_flatten

    from rq_core.paging.planner import _moe_info, activation_bytes, cache_tokens, kv_bytes, prefill_fp16_bytes

    banks = expert_banks(model)
    bank_ids = {id(v) for m in banks.values() for _, v in tree_flatten(m.parameters())}
    resident = sum(v.nbytes for _, v in tree_flatten(model.parameters()) if id(v) not in bank_ids)
    ab = activation_dtype(model).size  # what plain KV caches hold (float32 for a model upcast on the CPU)
    per_tok, fixed = kv_bytes(config, kv_mode, kv_bits, edge_layers, act_bytes=ab)
    kvb = per_tok * cache_tokens(context, kv_mode) + fixed
    pre = prefill_fp16_bytes(config, kv_mode, context, prefill_fp16, prefill_chunk, act_bytes=ab)
    act = activation_bytes(config, min(prefill_chunk, max(context, 1)))
    n_moe, E, k = _moe_info(config)
    attached = getattr(model, "expert_pager", None)
    if attached is not None and index is None:  # the banks are slot banks now: what the pages hold
        index = {"layers": {p: l.meta for p, l in attached.layers.items()}}
    if index is not None:  # in the dtype the model holds (pages are cast on load)
        per_expert = max((sum(_nbytes(t, target_dtype(banks[p], t)) for t in meta["tensors"])
                          for p, meta in index["layers"].items() if p in banks), default=0)
    else:  # default 0: a model (or a rank's slice of one) without routed experts
        per_expert = max((sum(v.nbytes for _, v in tree_flatten(m.parameters())) // max(E, 1)
                          for m in banks.values()), default=0)
    # a batch of misses: the staging buffer pages are read into (host memory: min(slots, top-k) pages of the largest
    # layer), and as much again in the banks' dtype, room for casting where it differs from the pages'
    # (float32 on the CPU; the cast is made a tensor row at a time, so most of that room is spare)
    used = max((m["used_bytes"] for p, m in index["layers"].items() if p in banks), default=0) if index else per_expert
    used += per_expert
    # what the parts above do not count (allocator rounding, the pager's tables and index arrays, small temporaries):
    # a share of the budget left free, so a measured peak stays within it (at real size the parts alone came to
    # within 0.2-0.3% of the measured peak, on either side)
    reserve = budget // RESERVE_DIVISOR
    free = budget - reserve - resident - kvb - pre - act
    per_slot = max(n_moe * per_expert, 1)
    cap = k or READ_THREADS  # pages a batch of misses holds (ExpertPager._ready)
    slots = int(max(0, min(E, free // per_slot)))
    while slots > 0 and slots * per_slot + min(slots, cap) * used > free:
        slots -= 1
    stage = min(slots, cap) * used
    return {"budget_bytes": budget, "memory_limit_bytes": budget - reserve - stage, "resident_bytes": resident,
            "kv_bytes": kvb, "prefill_fp16_bytes": pre, "activation_bytes": act, "staging_bytes": stage,
            "staging_bytes_per_expert": used,
            "staged_experts": min(slots, cap), "bytes_per_expert": per_expert, "moe_layers": n_moe,
            "experts_per_layer": E, "top_k": k, "slots_per_layer": slots, "fits": slots >= k, "reserve_bytes": reserve,
            "planned_peak_bytes": resident + kvb + pre + act + stage + n_moe * slots * per_expert,
            # the least budget that holds top-k slots a layer: the smallest that runs
            "min_budget_bytes": budget_for_slots({"resident_bytes": resident, "kv_bytes": kvb, "prefill_fp16_bytes": pre,
                                                  "activation_bytes": act, "moe_layers": n_moe, "top_k": k,
                                                  "bytes_per_expert": per_expert, "staging_bytes_per_expert": used}, k)}


def budget_for_slots(plan: dict, slots: int) -> int:
    """The least memory budget for which slots_for_budget gives `slots` slots a layer; `plan`: any of its results for
    this model and context (the parts do not depend on the budget)."""
    parts = (plan["resident_bytes"] + plan["kv_bytes"] + plan.get("prefill_fp16_bytes", 0) + plan["activation_bytes"]
             + slots * plan["moe_layers"] * plan["bytes_per_expert"]
             + min(slots, plan["top_k"] or READ_THREADS) * plan["staging_bytes_per_expert"])
    b = -(-parts * RESERVE_DIVISOR // (RESERVE_DIVISOR - 1))  # about the least b with b - b // D >= parts
    while b - 1 - (b - 1) // RESERVE_DIVISOR >= parts:
        b -= 1
    while b - b // RESERVE_DIVISOR < parts:
        b += 1
    return b


def activation_dtype(model: Any) -> mx.Dtype:
    """The dtype the model computes in: that of its token embedding (its scales when quantized)."""
    from mlx.utils import tree_flatten

    floats = [(k, v.dtype) for k, v in tree_flatten(model.parameters()) if mx.issubdtype(v.dtype, mx.floating)]
    for k, d in floats:
        if "embed" in k:
            return d
    return floats[0][1] if floats else mx.float16
