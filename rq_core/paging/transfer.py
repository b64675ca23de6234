"""Copies between the host and MLX arrays' own memory, in place, for the expert pager.

The pager writes experts into slot banks and an expert -> slot table that graphs already built read when they run,
and reads each MoE layer's routing back. On Metal and the CPU an array's memory is the host's: a numpy view of it is
read and written directly. On CUDA MLX allocates managed memory, whose pages migrate to whichever side touches them:
a host write or read moves a page to the host, and the next kernel that touches it (or any small array MLX later
allocates on it) stalls on a fault to move it back. There the copies go through the copy engine (cudaMemcpyAsync on a
non-blocking stream of the copier's own, device 0: the GPU MLX uses by default), which reads and writes the pages
where they are, from page-locked host memory. Copies are queued rather than waited for one by one (a layer's misses
are many small copies, each tensor of each expert), and `fence` waits for them all at once, before a graph that reads
them is launched.
"""

from __future__ import annotations

import ctypes
import weakref
from pathlib import Path
from typing import Any, Optional

import mlx.core as mx
import numpy as np

from rq_core.errors import RQError

MEMCPY_DEFAULT = 4  # cudaMemcpyDefault: the direction from the pointers (unified addressing)
HOST_ALLOC_MAPPED = 0x03  # cudaHostAllocPortable | cudaHostAllocMapped
STREAM_NON_BLOCKING = 0x01  # cudaStreamNonBlocking


def _cudart():
    """The CUDA 13 runtime library, or None: by its soname (LD_LIBRARY_PATH, a system toolkit), else from the
    nvidia-cuda-runtime wheel MLX's CUDA build installs (site-packages/nvidia/cu13/lib; MLX itself does not load it)."""
    names = ["libcudart.so.13"]
    try:
        import nvidia  # the wheels' namespace package

        names += [str(Path(d) / "cu13" / "lib" / "libcudart.so.13") for d in nvidia.__path__]
    except ImportError:
        pass
    for name in names:
        try:
            return ctypes.CDLL(name)
        except OSError:
            continue
    return None


def _on_cuda() -> bool:
    try:
        return bool(mx.cuda.is_available())
    except AttributeError:
        return False


class Copier:
    """Reads and writes of MLX arrays' memory, by the copy engine on CUDA (where its runtime is found), else through
    numpy views. `device_copies`: whether the copy engine does them."""

    def __init__(self) -> None:
        self._lib: Any = None
        self._stream: Optional[int] = None  # the copies' stream; None: the legacy default one
        self._pinned: list[int] = []  # page-locked host buffers made by host_buffer and mapped_buffer
        self._held: list[np.ndarray] = []  # the sources of copies queued since the last fence
        self._dirty = False
        self._finalizer: Any = None
        if _on_cuda():
            lib = _cudart()
            try:
                if lib is not None:
                    lib.cudaMemcpyAsync.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int,
                                                    ctypes.c_void_p]
                    lib.cudaStreamSynchronize.argtypes = [ctypes.c_void_p]
                    lib.cudaHostGetDevicePointer.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p,
                                                             ctypes.c_uint]
                    lib.cudaHostAlloc.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_size_t, ctypes.c_uint]
                    lib.cudaFreeHost.argtypes = [ctypes.c_void_p]
                    lib.cudaStreamCreateWithFlags.argtypes = [ctypes.POINTER(ctypes.c_void_p), ctypes.c_uint]
                    lib.cudaStreamDestroy.argtypes = [ctypes.c_void_p]
                    # the copies' own stream, non-blocking: ordered with nothing of MLX's, nor with the legacy
                    # default stream, which a library in the process may use (its work would hold up the fence)
                    s = ctypes.c_void_p()
                    if lib.cudaStreamCreateWithFlags(ctypes.byref(s), STREAM_NON_BLOCKING) == 0 and s.value:
                        self._stream = s.value
                    else:
                        lib.cudaGetLastError()
                    self._lib = lib
            except AttributeError:
                self._lib = None
        if self._lib is not None:  # by close(), else when the copier is dropped; once either way
            self._finalizer = weakref.finalize(self, Copier._free, self._lib, self._pinned, self._stream)

    @staticmethod
    def _free(lib: Any, pinned: list, stream: Optional[int]) -> None:
        lib.cudaStreamSynchronize(stream)  # queued copies may still read the buffers
        for p in pinned:
            lib.cudaFreeHost(p)
        pinned.clear()
        if stream is not None:
            lib.cudaStreamDestroy(stream)

    def host_buffer(self, n: int) -> np.ndarray:
        """n bytes of host memory the copies read from: page-locked on CUDA (cudaHostAlloc: the copy engine reads it
        at full speed, without staging it first), else plain memory. Valid until close()."""
        if self._lib is not None:
            p = ctypes.c_void_p()
            if self._lib.cudaHostAlloc(ctypes.byref(p), max(n, 1), 0) == 0 and p.value:
                self._pinned.append(p.value)
                return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(p.value))
            self._lib.cudaGetLastError()
        return np.zeros(n, np.uint8)

    def mapped_buffer(self, n: int) -> tuple[np.ndarray, int]:
        """(n bytes of page-locked host memory the device reads and writes in place, its address on the device),
        zeroed; CUDA only (RQError elsewhere or where the runtime refuses). Valid until close()."""
        if self._lib is not None:
            p, d = ctypes.c_void_p(), ctypes.c_void_p()
            if self._lib.cudaHostAlloc(ctypes.byref(p), max(n, 1), HOST_ALLOC_MAPPED) == 0 and p.value:
                self._pinned.append(p.value)
                if self._lib.cudaHostGetDevicePointer(ctypes.byref(d), p.value, 0) == 0 and d.value:
                    view = np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(p.value))
                    view[:] = 0
                    return view, d.value
            self._lib.cudaGetLastError()
        raise RQError("no page-locked host memory the device can address here")

    @property
    def pinned(self) -> bool:
        """Whether host_buffer gave page-locked memory."""
        return bool(self._pinned)

    def close(self) -> None:
        """Wait for the queued copies, free the page-locked buffers (their views must not be used after) and the
        stream. Final: the copier copies through numpy views after."""
        if self._finalizer is not None:
            self._finalizer()
        self._lib, self._stream, self._held, self._dirty = None, None, [], False

    @property
    def device_copies(self) -> bool:
        return self._lib is not None

    @property
    def own_stream(self) -> bool:
        """Whether the copies have a stream of their own: the fence then waits for nothing of MLX's (a step queued
        whole needs that: rq_core.paging.mailbox.available)."""
        return self._stream is not None

    @staticmethod
    def raw(a: mx.array) -> np.ndarray:
        """A writable uint8 view of `a`'s memory ([..., last dim x item size]; `a` evaluated, row-contiguous): the
        view holds the memory, so it stays valid while the view lives."""
        v = a.view(mx.uint8) if a.dtype != mx.uint8 else a
        mx.eval(v)
        h = np.asarray(v)
        if not (h.flags.c_contiguous and h.flags.writeable):
            raise ValueError("an array whose memory is not one writable block")
        return h.reshape(-1)

    @staticmethod
    def address(a: mx.array) -> int:
        """Where an evaluated array's memory starts (a bank replaced since its raw view was taken lies elsewhere)."""
        return ctypes.addressof(ctypes.c_char.from_buffer(memoryview(a)))

    def write(self, dst: np.ndarray, offset: int, src: np.ndarray) -> None:
        """src's bytes into the raw view `dst` at byte `offset`; call `fence` before a graph that reads them runs, and
        before src's memory is written again (on CUDA the copy is only queued; src is kept until the fence)."""
        n = src.nbytes
        if offset < 0 or offset + n > dst.nbytes:
            raise ValueError(f"a write of {n} bytes at {offset} into {dst.nbytes}")
        src = np.ascontiguousarray(src)
        if self._lib is not None:
            rc = self._lib.cudaMemcpyAsync(dst.ctypes.data + offset, src.ctypes.data, n, MEMCPY_DEFAULT, self._stream)
            if rc == 0:
                self._held.append(src)  # a temporary (a cast page, a contiguous copy) lives until the copy is done
                self._dirty = True
                return
        if self._lib is not None:
            self._lib.cudaGetLastError()
        dst[offset:offset + n] = src.reshape(-1).view(np.uint8)

    def copy(self, dst: int, src: int, n: int) -> None:
        """n bytes from address `src` to address `dst`, by the copy engine (`device_copies` only; without the numpy
        views and their checks `write` makes a call, which a layer's dozens of copies a step felt): the caller keeps
        the source valid until the fence (the page-locked staging buffer) and checks the bounds."""
        if self._lib.cudaMemcpyAsync(dst, src, n, MEMCPY_DEFAULT, self._stream) == 0:
            self._dirty = True
            return
        self._lib.cudaGetLastError()
        ctypes.memmove(dst, src, n)  # both host-addressable here (managed memory, page-locked host memory)

    def fence(self) -> None:
        """Wait for the copies `write` made (on CUDA the copy engine's may still be landing: a kernel on MLX's own
        stream is not ordered after them). Only the copies' own stream: a step queued whole may be waiting on the
        host inside MLX's."""
        if self._dirty:
            self._lib.cudaStreamSynchronize(self._stream)
            self._dirty = False
            self._held = []

    def read(self, a: mx.array) -> np.ndarray:
        """`a` evaluated and copied to the host (np.array(a) where the copy engine does not do it)."""
        mx.eval(a)
        h = np.asarray(a)
        if self._lib is None or not h.flags.c_contiguous:
            return np.array(h)
        out = np.empty(h.shape, h.dtype)
        if self._lib.cudaMemcpyAsync(out.ctypes.data, h.ctypes.data, h.nbytes, MEMCPY_DEFAULT, self._stream) != 0:
            self._lib.cudaGetLastError()
            return np.array(h)
        self._dirty = True
        self.fence()  # the copy done (and the writes queued before it)
        return out


def host_cast(raw: np.ndarray, src: str, dst: mx.Dtype) -> Optional[np.ndarray]:
    """Bytes of `src`-typed values (a dtype name) as `dst` (bytes again), cast on the host: bfloat16 and float16 to
    float32 (the CPU's upcast model); None for other pairs."""
    if dst != mx.float32:
        return None
    if src == "bfloat16":
        return (raw.view(np.uint16).astype(np.uint32) << 16).view(np.uint8)
    if src == "float16":
        return raw.view(np.float16).astype(np.float32).view(np.uint8)
    return None
