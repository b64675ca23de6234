"""A paged decode step queued whole on CUDA: the device waits for the pager inside the step.

Layer by layer, the host reads each MoE layer's routing back (a sync that drains the device's queue), writes the
missing experts in, and only then queues the graph that reads them, so the device idles while the host encodes and
launches every stretch of layers between two MoE layers. Here each paged MoE layer runs two small kernels between its
router and its experts instead: `post` writes the layer's expert ids into page-locked host memory the device can
address (one entry a layer, the mailbox) and raises the entry's `ready` flag; `wait` spins until the host raises its
`go` flag and hands the experts' slots, which the host wrote beside it, to the layer's expert matmuls: the device runs
on into the next layer the moment its experts are in, on kernels already launched.

The host's side runs on a thread of its own (`Answers`): each posted layer's ids fetched, its experts made resident
and its slots answered, in the order the layers were posted, while the main thread builds and launches the layers
after it, every `LAUNCH_EVERY` MoE layers (each launch costs host time; with the answers on the main thread the device
waited while the host launched, and MLX's eval also waits for the device once more than 10 command buffers are in
flight, which with the device waiting on that same thread stalled the step).

The flags are written once per step and cleared when it starts (`open`). While the host answers a layer it moves the
entry's `progress` word on (its ids taken, each page read); a `wait` that sees neither `go` nor progress for `WAIT_S`
gives up (slots 0) and marks its entry failed: the answers' CUDA copies may be held by a call that waits for the
whole device (CUDA loads a kernel's module on its first launch that way, and the building thread launches while the
device waits), and a host that never answers (an error, a bug) cannot hang the device. The step's result is then
wrong: the pager puts its caches back and runs it again layer by layer (ExpertPager.decode_step). After an error the
host releases every entry (`release_all`) and waits for the device, so no kernel of that step is still spinning when
the next one starts; a released step counts as failed.

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

READY, GO, FAILED, PROGRESS, HEAD = 0, 1, 2, 3, 4  # an entry's int32 words: flags, then the expert ids, then slots
# A `wait` gives up after WAIT_S without progress: longer than a page takes to read from a disk, or than a layer's copies
# take once its pages are read, short enough that a step whose answers are held by CUDA loading a module (it waits for
# the device, which waits for them) costs little before it runs again layer by layer.
WAIT_S = 0.25
REACH_S = 120.0  # the host's patience for the device to reach a layer's routing
LAUNCH_EVERY = 2  # MoE layers a launch of a step queued whole takes (fewer launches, against the device idling sooner)
_THREADS = 32
_ORDER = threading.Lock()  # taking a lock is a full memory barrier: the slots' stores before the flag's on any host

_HEADER = (f"#define READY {READY}\n#define GO {GO}\n#define FAILED {FAILED}\n#define PROGRESS {PROGRESS}\n"
           f"#define HEAD {HEAD}\n#define LIMIT_NS {int(WAIT_S * 1e9)}ULL\n")

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

# one thread spins on the host's flag (volatile: read from host memory each time), the block copies the slots
_WAIT = """
  volatile int* e = (volatile int*)(size_t)box[0];
  __shared__ int ok;
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
  }
  __syncthreads();
  for (unsigned int j = threadIdx.x; j < N; j += blockDim.x) slots[j] = ok ? e[HEAD + N + j] : 0;
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
    """`layers` entries of room for `k` expert ids each, in mapped page-locked host memory (Copier.mapped_buffer).
    The kernels are compiled and loaded here, by one launch through a spare entry answered beforehand: a decode step
    would otherwise load them while a `wait` spins."""

    def __init__(self, copier: Copier, layers: int, k: int) -> None:
        self.k = k
        width = -(-(HEAD + 2 * k) // 16) * 16  # int32 words an entry, whole 64-byte lines
        self.box, addr = copier.mapped_buffer((layers + 1) * width * 4)
        self.box = self.box.view(np.int32).reshape(layers + 1, width)
        self._addr = [mx.array(np.array([addr + i * width * 4], np.uint64)) for i in range(layers + 1)]
        mx.eval(self._addr)
        self._post = mx.fast.cuda_kernel(name="rq_mailbox_post", input_names=["ids", "box"],
                                         output_names=["posted"], source=_POST, header=_HEADER)
        self._wait = mx.fast.cuda_kernel(name="rq_mailbox_wait", input_names=["posted", "box"],
                                         output_names=["slots"], source=_WAIT, header=_HEADER)
        self.box[layers, GO] = 1
        mx.eval(self.post(layers, mx.zeros((k,), mx.uint32)))
        self.box[:] = 0
        self._released = False  # release_all since the step opened: a fetch gives up

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
        slots = self._wait(inputs=[posted, addr], template=[("N", n)],
                           grid=(_THREADS, 1, 1), threadgroup=(_THREADS, 1, 1), output_shapes=[(n,)],
                           output_dtypes=[mx.int32])[0]
        return slots.reshape(ids.shape)

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
        if row[FAILED] or self._released:  # given up since it posted: nothing of this step is kept
            raise Abandoned()
        row[PROGRESS] += 1  # taken: the wait's patience starts again
        return row[HEAD:HEAD + n].copy()

    def progress(self, entry: int) -> None:
        """The host is still at `entry` (a page of it read): its wait's patience starts again."""
        self.box[entry, PROGRESS] += 1

    def answer(self, entry: int, slots: np.ndarray) -> None:
        """The slots for `entry`'s ids (its experts written in and landed), then its `go` flag: the device runs on."""
        row = self.box[entry]
        n = len(slots)
        row[HEAD + n:HEAD + 2 * n] = slots
        with _ORDER:  # the slots visible before the flag (a weakly ordered host may reorder plain stores)
            pass
        row[GO] = 1

    def release_all(self) -> None:
        """Every entry answered (with whatever slots it holds), and a fetch not yet answered gives up: a step
        abandoned after an error drains."""
        self._released = True
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
