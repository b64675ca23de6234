"""A paged decode step queued whole on CUDA: the device waits for the pager inside the step.

Layer by layer, the host reads each MoE layer's routing back (a sync that drains the device's queue), writes the
missing experts in, and only then queues the graph that reads them, so the device idles while the host encodes and
launches every stretch of layers between two MoE layers. Here each paged MoE layer runs two small kernels between its
router and its experts instead: `post` writes the layer's expert ids into page-locked host memory the device can
address (one entry a layer, the mailbox) and raises the entry's `ready` flag; `wait` spins until the host raises its
`go` flag and hands the experts' slots, which the host wrote beside it, to the layer's expert matmuls. The host queues
the step up to a layer's `wait` before it serves the layer before (ExpertPager's `serve`): the device runs on into
the next layer the moment its experts are in, on kernels already launched.

The flags are written once per step and cleared when it starts (`open`). A `wait` whose ids the host has not
taken within `ACK_S`, or that sees no `go` within `WAIT_S` after, gives up (slots 0) and marks its entry failed: the
host may be held by a call that waits for the whole device (CUDA loads a kernel's module on its first launch that
way), and a host that never answers (an error, a bug) cannot hang the device. The step's result is then wrong: the
pager puts its caches back and runs it again layer by layer (ExpertPager.decode_step). After an error the host
releases every entry (`release_all`) and waits for the device, so no kernel of that step is still spinning when the
next one starts.

CUDA only: Metal has no way for a kernel MLX launches to wait for the host (a shared event would be encoded into
MLX's command buffers), so there the pager keeps the layer-by-layer step.
"""

from __future__ import annotations

import threading
import time
from typing import Optional

import mlx.core as mx
import numpy as np

from rq_core.errors import RQError
from rq_core.paging.transfer import Copier

READY, GO, FAILED, ACK, HEAD = 0, 1, 2, 3, 4  # an entry's int32 words: its flags, then the expert ids, then the slots
# A `wait` gives up after ACK_S unless the host has taken the entry's ids (ACK), then after WAIT_S. The host may be
# held inside MLX by something that waits for the whole device (CUDA loading a kernel's module on its first launch, a
# free): the device must stop waiting for the host then, and the step is run again layer by layer.
ACK_S = 0.05
WAIT_S = 10.0  # longer than any layer's misses take to read (a cold disk)
REACH_S = 120.0  # the host's patience for the device to reach a layer's routing
_THREADS = 32
_ORDER = threading.Lock()  # taking a lock is a full memory barrier: the slots' stores before the flag's on any host

_HEADER = (f"#define READY {READY}\n#define GO {GO}\n#define FAILED {FAILED}\n#define ACK {ACK}\n"
           f"#define HEAD {HEAD}\n#define ACK_NS {int(ACK_S * 1e9)}ULL\n#define LIMIT_NS {int(WAIT_S * 1e9)}ULL\n")

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
    ok = 1;
    while (e[GO] == 0) {
      asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
      if (t - t0 > (e[ACK] ? LIMIT_NS : ACK_NS)) {
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

    def open(self) -> None:
        """A step begins: every entry's flags down (the last step's kernels have all run)."""
        self.box[:, :HEAD] = 0

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
        """The n expert ids the device posted to `entry`, once it has (the host spins on the flag, yielding), the
        entry taken (ACK). Abandoned where a `wait` of this step gave up."""
        box = self.box
        row = box[entry]
        deadline: Optional[float] = None
        while row[READY] == 0:
            if box[:, FAILED].any():
                raise Abandoned()
            if deadline is None:
                deadline = time.monotonic() + REACH_S
            elif time.monotonic() > deadline:
                raise RQError(f"the device did not reach an expert layer's routing in {REACH_S:.0f} s")
            time.sleep(0)
        ids = row[HEAD:HEAD + n].copy()
        row[ACK] = 1
        if row[FAILED]:  # it gave up just before the ACK landed
            raise Abandoned()
        return ids

    def answer(self, entry: int, slots: np.ndarray) -> None:
        """The slots for `entry`'s ids (its experts written in and landed), then its `go` flag: the device runs on."""
        row = self.box[entry]
        n = len(slots)
        row[HEAD + n:HEAD + 2 * n] = slots
        with _ORDER:  # the slots visible before the flag (a weakly ordered host may reorder plain stores)
            pass
        row[GO] = 1

    def release_all(self) -> None:
        """Every entry answered (with whatever slots it holds): a step abandoned after an error drains."""
        self.box[:, GO] = 1

    def failed(self) -> bool:
        """Whether a `wait` of this step gave up (its layer computed on slot 0: the step's result is wrong)."""
        return bool(self.box[:, FAILED].any())
