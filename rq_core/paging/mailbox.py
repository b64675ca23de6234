"""A paged decode step queued whole on CUDA: the device waits for the pager inside the step.

Layer by layer, the host reads each MoE layer's routing back (a sync that drains the device's queue), writes the
missing experts in, and only then queues the graph that reads them, so the device idles while the host encodes and
launches every stretch of layers between two MoE layers. Here each paged MoE layer runs three small kernels between its
router and its experts instead: `post` writes the layer's expert ids into page-locked host memory the device can
address (one entry a layer, the mailbox) and raises the entry's `ready` flag; `wait` spins until the host raises its
`go` flag, then takes the experts' slots and the list of copies, which the host wrote beside it, into device memory;
`load` copies the missing experts' pages, which the host read into page-locked host memory the device also addresses
(the staging buffer), into their slots by that list: the device runs on into the layer's expert matmuls the moment
its experts are in, on kernels already launched.

The host's side runs on a thread of its own (`Answers`): each posted layer's ids fetched, its pages read and its slots
and copies answered, in the order the layers were posted (on the building thread the device would wait while the host
builds). The step is launched once it is built (ExpertPager.settle, which also launches and waits for the layers
posted so far where an evaluation comes in the middle of a build), not layer by layer as it is built: the answers'
thread needs Python's GIL, which the building thread holds while it builds, and an MLX call made while building can
wait for the device (MLX's CUDA allocator, over its memory limit, frees cached buffers with cudaFree, which waits for
the device). With layers launched and a `wait` spinning, such a call and the device would wait for each other until
the wait gave up. That is the likely reason every step queued as it was built fell back for a Nemotron 3 Super
120B-shaped model at a 32 GB budget on an H200, over MLX's limit there (3 of 3; benchmarks/results/paper_table.json),
not yet confirmed on a GPU. Once the step is launched the building thread only waits, without the GIL (for the
answers, then for the step's result). The answers make no CUDA call: the device copies the pages itself. Copies the
host queued on the copy engine while the device waited in the step were held up until the `wait` gave up (on an H100,
a 12-layer slice of that model: the answers' copy, or the wait for it, blocked until two layers' waits had given up;
every step fell back), and anything a CUDA call may wait behind is outside the host's control.

The flags are written once per step and cleared when it starts (`open`). While the host answers a layer it moves the
entry's `progress` word on (its ids taken, each page read); a `wait` that sees neither `go` nor progress for `WAIT_S`
gives up (slots 0, no copies) and marks its entry failed: a host that never answers (an error, a bug, a page read
stalled) cannot hang the device. The step's result is then wrong: the pager puts its caches back, forgets the experts
its answers took in (their copies may not have run) and runs it again layer by layer (ExpertPager.decode_step). After
an error the host releases every entry (`release_all`: an entry not answered copies nothing) and waits for the
device, so no kernel of that step is still spinning when the next one starts; a released step counts as failed.

CUDA only: Metal has no way for a kernel MLX launches to wait for the host (a shared event would be encoded into
MLX's command buffers), so there the pager keeps the layer-by-layer step.
"""

from __future__ import annotations

import queue
import threading
import time
from typing import Callable, Optional

import mlx.core as mx
import numpy as np

from rq_core.errors import RQError
from rq_core.paging.transfer import Copier

# an entry's int32 words: flags, the number of copies, then the expert ids, the slots, and (from an 8-byte boundary) the
# copies, three int64 words each: destination and source addresses on the device, bytes
READY, GO, FAILED, PROGRESS, NCOPY, HEAD = 0, 1, 2, 3, 4, 5
# A `wait` gives up after WAIT_S without progress: longer than a page takes to read from a disk, short enough that a
# step whose host stalls costs little before it runs again layer by layer.
WAIT_S = 0.25
REACH_S = 120.0  # the host's patience for the device to reach a layer's routing
_THREADS = 32
_CHECK_BYTES = 256  # the bytes Mailbox._check copies
_WAIT_THREADS = 128  # a wait's block, which takes the answer's copy list from host memory (3 words a copy)
# `load`: blocks of 256 threads copying a layer's pages from host memory (enough loads in flight to fill the bus: on an
# H100, 64 such blocks copied 1.7 MB pages at about 52 GB/s, and a plain copy kernel with 132 or 528 read 37-40 GB/s)
LOAD_BLOCKS = 64
_ORDER = threading.Lock()  # taking a lock is a full memory barrier: the slots' stores before the flag's on any host
_ANSWER = threading.Lock()  # an answer is written whole or not at all, never across a release_all

_HEADER = (f"#define READY {READY}\n#define GO {GO}\n#define FAILED {FAILED}\n#define PROGRESS {PROGRESS}\n"
           f"#define NCOPY {NCOPY}\n#define HEAD {HEAD}\n#define LIMIT_NS {int(WAIT_S * 1e9)}ULL\n")

# one block: the ids out, a system-wide fence so they land before the flag, the flag
_POST = """
  volatile int* e = (volatile int*)(size_t)box[0];
  for (unsigned int j = threadIdx.x; j < N; j += blockDim.x) e[HEAD + j] = (int)ids[j];
  __threadfence_system();
  __syncthreads();
  if (threadIdx.x == 0) {
    e[READY] = 1;
    posted[0] = 1;
  }
"""

# one thread spins on the host's flag (volatile: read from host memory each time); then the block takes the answer into
# device memory in one pass, the slots and `plan` (the number of copies, then each copy's destination, source and bytes;
# none where it gave up): each read of host memory crosses the bus, and the `load` blocks' own reads of the entry were
# served one after another (about 23 µs a block on an H100, where the copies themselves ran at 52 GB/s)
_WAIT = """
  volatile int* e = (volatile int*)(size_t)box[0];
  __shared__ int ok;
  __shared__ int n;
  if (threadIdx.x == 0) {
    unsigned long long t0, t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    int seen = e[PROGRESS];
    ok = 1;
    while (e[GO] == 0) {
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      int p = e[PROGRESS];
      if (p != seen) {
        seen = p;
        t0 = t;
      }
      if (t - t0 > LIMIT_NS) {
        e[FAILED] = 1;
        ok = 0;
        break;
      }
      __nanosleep(256);
    }
    __threadfence_system();
    const int listed = ok ? e[NCOPY] : 0;
    n = listed < C ? listed : C;
    plan[0] = n;
  }
  __syncthreads();
  for (unsigned int j = threadIdx.x; j < N; j += blockDim.x) slots[j] = ok ? e[HEAD + N + j] : 0;
  volatile const long long* list = (volatile const long long*)(e + DESC);
  for (int j = threadIdx.x; j < 3 * n; j += blockDim.x) plan[1 + j] = list[j];
"""

# the grid copies the pages by the plan its wait took (device memory), 16 bytes a load where the copy's addresses and
# length allow; `out`: the slots, so that the expert matmuls run after the copies
_LOAD = """
  if (blockIdx.x == 0) {
    for (unsigned int j = threadIdx.x; j < N; j += blockDim.x) out[j] = slots[j];
  }
  const int n = (int)plan[0];
  const unsigned long long first = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
  const unsigned long long stride = (unsigned long long)gridDim.x * blockDim.x;
  for (int c = 0; c < n; c++) {
    unsigned char* dst = (unsigned char*)(size_t)plan[1 + 3 * c];
    const unsigned char* src = (const unsigned char*)(size_t)plan[2 + 3 * c];
    const unsigned long long nb = (unsigned long long)plan[3 + 3 * c];
    if ((((size_t)dst | (size_t)src | nb) & 15) == 0) {
      for (unsigned long long i = first; i < nb / 16; i += stride)
        ((uint4*)dst)[i] = ((const uint4*)src)[i];
    } else if ((((size_t)dst | (size_t)src | nb) & 3) == 0) {
      for (unsigned long long i = first; i < nb / 4; i += stride)
        ((unsigned int*)dst)[i] = ((const unsigned int*)src)[i];
    } else {
      for (unsigned long long i = first; i < nb; i += stride) dst[i] = src[i];
    }
  }
"""


def available(copier: Copier) -> bool:
    """Whether a step can be queued whole here: MLX's default device is a CUDA GPU and the copier reaches its runtime
    with a stream of its own (a fence on the legacy default stream can wait behind a spinning `wait`)."""
    try:
        return bool(copier.device_copies and copier.own_stream and mx.cuda.is_available()
                    and mx.default_device() == mx.gpu)
    except AttributeError:
        return False


class Abandoned(Exception):
    """The device stopped waiting for the host in this step (`failed`): run the step again another way."""


class Mailbox:
    """`layers` entries of room for `k` expert ids each and `copies` copies, in mapped page-locked host memory
    (Copier.mapped_buffer). The kernels are compiled, loaded and checked here (`_check`): a decode step would
    otherwise load them while a `wait` spins."""

    def __init__(self, copier: Copier, layers: int, k: int, copies: int) -> None:
        self.k, self.copies, self._copier = k, copies, copier
        self.desc = -(-(HEAD + 2 * k) // 2) * 2  # the copies' first int32 word (8-byte aligned)
        width = -(-(self.desc + 6 * copies) // 16) * 16  # int32 words an entry, whole 64-byte lines
        size = (layers + 1) * width * 4
        buf, addr = copier.mapped_buffer(size + _CHECK_BYTES)  # (the check's source after the entries)
        self.box = buf[:size].view(np.int32).reshape(layers + 1, width)
        self._check_src = (buf[size:], addr + size)
        self._addr = [mx.array(np.array([addr + i * width * 4], np.uint64)) for i in range(layers + 1)]
        mx.eval(self._addr)
        self._post = mx.fast.cuda_kernel(name="rq_mailbox_post", input_names=["ids", "box"],
                                         output_names=["posted"], source=_POST, header=_HEADER)
        self._wait = mx.fast.cuda_kernel(name="rq_mailbox_wait", input_names=["posted", "box"],
                                         output_names=["slots", "plan"], source=_WAIT, header=_HEADER)
        self._load = mx.fast.cuda_kernel(name="rq_mailbox_load", input_names=["slots", "plan"],
                                         output_names=["out"], source=_LOAD, header=_HEADER)
        self._released = False  # release_all since the step opened: a fetch gives up
        self._check(layers, ahead=True)  # (the kernels compiled and loaded with nothing spinning)
        self.box[:] = 0
        self._check(layers, ahead=False)
        self.box[:] = 0

    def _check(self, entry: int, ahead: bool) -> None:
        """One launch through the spare entry, answered before it (`ahead`: the first, which compiles and loads the
        kernels) or as a step's layer is (fetched and answered while the kernels run), and what the kernels did
        checked on this device (the ids posted, the slots handed back, a copy by 16-byte and by 1-byte loads made),
        else RQError and the pager runs a step a stretch at a time: a device that did not follow the protocol would
        compute on the wrong experts, with nothing to tell."""
        src, src_dev = self._check_src
        src[:] = np.arange(_CHECK_BYTES) % 251
        dst = mx.zeros((_CHECK_BYTES + 16,), mx.uint8)
        mx.eval(dst)
        dst_raw = Copier.raw(dst)
        skip = -dst_raw.ctypes.data % 16  # the first copy 16-byte aligned at both ends
        dst_raw = dst_raw[skip:skip + _CHECK_BYTES]
        at, done = dst_raw.ctypes.data, _CHECK_BYTES - 3
        copies = [(at, src_dev, done - 13), (at + done - 13, src_dev + done - 13, 13)][:self.copies]
        done = sum(c[2] for c in copies)
        ids = np.arange(7, 7 + self.k, dtype=np.uint32)
        slots = np.arange(1, self.k + 1, dtype=np.int32)
        posted: Optional[np.ndarray] = None
        if ahead:
            self.answer(entry, slots, copies)
        got = self.post(entry, mx.array(ids))
        mx.async_eval(got)
        if not ahead:
            try:
                posted = self.fetch(entry, self.k)
            except Abandoned:
                pass
            else:
                self.answer(entry, slots, copies)
        got = np.array(got)
        if ahead and self.box[entry, READY] == 1:
            posted = self.box[entry, HEAD:HEAD + self.k].copy()
        if not (posted is not None and np.array_equal(posted, ids) and np.array_equal(got, slots)
                and np.array_equal(dst_raw[:done], src[:done]) and not dst_raw[done:].any()):
            raise RQError("the expert pager's device-side copies did not check out on this GPU")

    def open(self) -> None:
        """A step begins: every entry's flags down (the last step's kernels have all run)."""
        self.box[:, :HEAD] = 0
        self._released = False

    def post(self, entry: int, ids: mx.array) -> mx.array:
        """The slots of `ids` (at most k), as the device will read them once the host answers `entry` (lazy)."""
        n = ids.size
        if n > self.k:
            raise RQError(f"internal: {n} expert ids for a mailbox entry of {self.k}")
        addr = self._addr[entry]
        posted = self._post(inputs=[ids.reshape(-1), addr], template=[("N", n)], grid=(_THREADS, 1, 1),
                            threadgroup=(_THREADS, 1, 1), output_shapes=[(1,)], output_dtypes=[mx.int32])[0]
        slots, plan = self._wait(inputs=[posted, addr], template=[("N", n), ("DESC", self.desc), ("C", self.copies)],
                                 grid=(_WAIT_THREADS, 1, 1), threadgroup=(_WAIT_THREADS, 1, 1),
                                 output_shapes=[(n,), (1 + 3 * self.copies,)], output_dtypes=[mx.int32, mx.int64])
        slots = self._load(inputs=[slots, plan], template=[("N", n)],
                           grid=(LOAD_BLOCKS * 256, 1, 1), threadgroup=(256, 1, 1), output_shapes=[(n,)],
                           output_dtypes=[mx.int32])[0]
        return slots.reshape(ids.shape)

    def staging_buffer(self, n: int) -> tuple[np.ndarray, int]:
        """(n bytes of host memory the pages are read into and `load` copies from, its address on the device)."""
        return self._copier.mapped_buffer(n)

    def fetch(self, entry: int, n: int) -> np.ndarray:
        """The n expert ids the device posted to `entry`, once it has (the host spins on the flag, yielding).
        Abandoned where a `wait` of this step gave up, or the step was released."""
        box = self.box
        row = box[entry]
        deadline: Optional[float] = None
        while row[READY] == 0:
            if self._released or box[:, FAILED].any():  # (released: a layer not launched may never post)
                raise Abandoned()
            if deadline is None:
                deadline = time.monotonic() + REACH_S
            elif time.monotonic() > deadline:
                raise RQError(f"the device did not reach an expert layer's routing in {REACH_S:.0f} s")
            time.sleep(0)
        if self._released or box[:, FAILED].any():  # a wait of this step gave up: nothing of it is kept
            raise Abandoned()
        row[PROGRESS] += 1  # taken: the wait's patience starts again
        return row[HEAD:HEAD + n].copy()

    def progress(self, entry: int) -> None:
        """The host is still at `entry` (a page of it read): its wait's patience starts again."""
        self.box[entry, PROGRESS] += 1

    def answer(self, entry: int, slots: np.ndarray, copies: list[tuple[int, int, int]]) -> None:
        """The slots for `entry`'s ids and the copies that bring its missing experts in (destination and source
        addresses on the device, bytes; the pages read into the staging buffer), then its `go` flag: the device
        copies them and runs on."""
        if len(copies) > self.copies:
            raise RQError(f"internal: {len(copies)} copies for a mailbox entry of {self.copies}")
        with _ANSWER:
            if self._released:  # the device may be copying by the entry already: nothing written, the step is given up
                raise Abandoned()
            row = self.box[entry]
            n = len(slots)
            row[HEAD + n:HEAD + 2 * n] = slots
            if copies:
                row[self.desc:self.desc + 6 * len(copies)] = np.asarray(copies, np.int64).reshape(-1).view(np.int32)
            row[NCOPY] = len(copies)
            with _ORDER:  # the slots and copies visible before the flag (a weakly ordered host may reorder stores)
                pass
            row[GO] = 1

    def release_all(self) -> None:
        """Every entry answered (an entry not answered yet with whatever slots it holds and no copies), and a fetch not
        yet answered gives up: a step abandoned after an error drains."""
        with _ANSWER:
            self._released = True
            self.box[self.box[:, GO] == 0, NCOPY] = 0
            with _ORDER:
                pass
            self.box[:, GO] = 1

    def failed(self) -> bool:
        """Whether a `wait` of this step gave up (its layer computed on slot 0) or the step was released (its layers
        ran on whatever slots they held): the step's result is wrong."""
        return self._released or bool(self.box[:, FAILED].any())


class Answers:
    """A thread that runs a step's answers (each a call that fetches a layer's ids, makes its experts resident and
    answers it) one after another, in the order they were submitted. After an error the rest of the step's answers
    are skipped, the step's mailbox released (the device runs the step out; its result is dropped), and `join` or
    `check` raises the error on the main thread."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._done = threading.Condition()
        self._pending = 0
        self._error: Optional[BaseException] = None
        self._thread = threading.Thread(target=self._run, args=(self._queue,), name="rq-pager-answers", daemon=True)
        self._thread.start()

    def submit(self, answer: Callable[[], None], box: Mailbox) -> None:
        with self._done:
            self._pending += 1
        self._queue.put((answer, box))

    def _run(self, q: queue.SimpleQueue) -> None:
        while True:
            item = q.get()
            if item is None:
                return
            answer, box = item
            try:
                if self._error is None:
                    answer()
            except BaseException as e:  # noqa: BLE001 (raised on the main thread: join, check)
                with self._done:
                    self._error = self._error or e
                box.release_all()
            finally:
                # nothing of the step kept while waiting for the next: an answer holds its layer, so its pager
                del item, answer, box
                with self._done:
                    self._pending -= 1
                    self._done.notify_all()

    def check(self) -> None:
        """Raise the error an answer of this step raised, if one has."""
        with self._done:
            e, self._error = self._error, None
        if e is not None:
            raise e

    def join(self, *, raise_error: bool = True) -> None:
        """Wait until every submitted answer has run (or been skipped); then raise the first error (`raise_error`)."""
        with self._done:
            while self._pending:
                self._done.wait()
            if not raise_error:
                self._error = None
        self.check()

    def stop(self) -> None:
        """End the thread once the answers submitted have run."""
        if self._thread.is_alive():
            self._queue.put(None)
            if self._thread is not threading.current_thread():
                self._thread.join()
