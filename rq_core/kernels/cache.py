"""Compiled CUDA kernels kept across processes (on by default on CUDA; RQ_KERNEL_CACHE=0 turns it off: env.config()).

Why: MLX compiles a custom kernel with NVRTC in every process and never writes it to its PTX cache
(`get_jit_module(..., use_disk_cache=false)`), so every `rq run` on an NVIDIA GPU spent its first decode
step compiling attn_fused_window (4.45 s on the H200). MLX does *read* that cache for every module,
custom kernels included: `{cache}/{module}.ptx` (the compiled image) and `{module}.txt` (kernel name, TAB,
lowered name), where module = `{kernel name}_{std::hash(generated source):x}`.

So, the first time a kernel class is launched in a process: take the source MLX generates (its `verbose`
print, made when the launch is built, before MLX compiles at evaluation), compute the module name as MLX
does (libstdc++'s `std::_Hash_bytes`), and if the cache lacks it, compile that source with NVRTC (MLX's
options) and write both files atomically before MLX evaluates the launch. MLX's own device header is
embedded in libmlx; ours (`_UTILS`) declares the two types the generated signatures name (Shape, Strides,
sized by the installed MLX's config.h). Any failure leaves MLX to compile as before.

On the H200 a second process's first launch of attn_fused_window took 0.024 s against 3.15 s, with output identical
to MLX's own compile.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import sys
import tempfile
from pathlib import Path

from rq_core.kernels import config as env

_DONE: set = set()
_WARNED: list = []
# in-memory replacement for MLX's "mlx/backend/cuda/device/utils.cuh": what the generated code names
_UTILS = """#pragma once
#include "mlx/backend/cuda/device/config.h"
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/limits>
#include <cuda/std/tuple>
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}
"""
_UTILS_NAME = "mlx/backend/cuda/device/utils.cuh"


def enabled() -> bool:
    return env.config().disk_cache


def first_run_note() -> str | None:
    """A line for the user when this looks like the first GPU run on this machine (MLX's PTX cache holds no
    compiled module yet): MLX then compiles its own CUDA kernels once, which took 159 s for the bundled model
    on the H200; a silent wait that long reads as a hang."""
    try:
        from rq_core.kernels.launch import backend

        if backend() != "cuda":
            return None
        d = cache_dir()
        if d.is_dir() and next(d.glob("*.ptx"), None) is not None:
            return None
        return f"first GPU run on this machine: MLX compiles its kernels once (minutes); they are kept in {d}"
    except Exception:
        return None


def launch(kernel, key: tuple, **kwargs):
    """kernel(**kwargs), making sure the compiled kernel is in MLX's PTX cache the first time `key` (the
    kernel class: name, template, argument types) is seen in this process."""
    if key in _DONE:
        return kernel(**kwargs)
    _DONE.add(key)
    out, text = _capture_stdout(lambda: kernel(**kwargs, verbose=True))
    try:
        name, source = parse_verbose(text)
        ensure_cached(name, source)
    except Exception as e:  # MLX compiles it as usual
        if not _WARNED:
            _WARNED.append(1)
            print(f"rq: kernel cache off for this process: {type(e).__name__}: {str(e)[:200]}", file=sys.stderr)
    return out


def _capture_stdout(fn):
    """(fn(), what it wrote to file descriptor 1): MLX prints the generated source with std::cout."""
    libc = ctypes.CDLL(None)
    sys.stdout.flush()
    libc.fflush(None)
    saved = os.dup(1)
    with tempfile.TemporaryFile() as tmp:
        os.dup2(tmp.fileno(), 1)
        try:
            res = fn()
        finally:
            libc.fflush(None)
            os.dup2(saved, 1)
            os.close(saved)
        tmp.seek(0)
        text = tmp.read().decode("utf-8", "replace")
    return res, text


def parse_verbose(text: str) -> tuple[str, str]:
    """(kernel name, generated source) from MLX's verbose print."""
    head = "Generated source code for `"
    i = text.index(head) + len(head)
    j = text.index("`:", i)
    start = text.index("```\n", j) + 4
    end = text.index("\n```", start)
    return text[i:j], text[start:end]


def std_hash(data: bytes) -> int:
    """libstdc++'s std::hash<std::string> (std::_Hash_bytes with its fixed seed), as MLX names modules."""
    f = ctypes.CDLL("libstdc++.so.6")._ZSt11_Hash_bytesPKvmm
    f.restype = ctypes.c_size_t
    f.argtypes = [ctypes.c_char_p, ctypes.c_size_t, ctypes.c_size_t]
    return int(f(data, len(data), 0xC70F6907))


def module_name(kernel_name: str, source: str) -> str:
    return f"{kernel_name}_{std_hash(source.encode()):x}"


def cache_dir() -> Path:
    """MLX's PTX cache: MLX_PTX_CACHE_DIR, else {temp}/mlx/{version}/ptx (std::filesystem's temp dir)."""
    # MLX's own variable, read where MLX reads it (not one of ours)
    mlx_dir = os.environ.get("MLX_PTX_CACHE_DIR")
    if mlx_dir:
        return Path(mlx_dir).absolute()
    import mlx.core as mx

    tmp = next((os.environ[v] for v in ("TMPDIR", "TMP", "TEMP", "TEMPDIR") if os.environ.get(v)), "/tmp")
    return Path(tmp) / "mlx" / mx.__version__ / "ptx"


def ptx_path(directory: Path, module: str) -> Path:
    """MLX's get_ptx_path: names over 245 characters are split into directories."""
    p = directory
    while len(module) > 245:
        p, module = p / module[:245], module[245:]
    return p / (module + ".ptx")


def ensure_cached(kernel_name: str, source: str) -> Path:
    """The cache entry MLX will read for this kernel's module, compiled now if it is missing."""
    path = ptx_path(cache_dir(), module_name(kernel_name, source))
    if path.is_file() and path.with_suffix(".txt").is_file():
        return path
    full = "mlx::core::cu::" + kernel_name
    image, lowered = nvrtc_compile(source, full)
    path.parent.mkdir(parents=True, exist_ok=True)
    _atomic_write(path.with_suffix(".txt"), f"{full}\t{lowered}\n".encode())
    _atomic_write(path.with_suffix(".cu"), source.encode())
    _atomic_write(path, image)  # last: MLX looks for the image first, then its .txt
    return path


def _atomic_write(path: Path, data: bytes) -> None:
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".rq-")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


# ---------------------------------------------------------------------------------------------
# NVRTC, as MLX's jit_module.cpp calls it


def _mlx_root() -> Path:
    """The installed `mlx` package directory (MLX's root_dir: the parent of lib/libmlx.so)."""
    import mlx.core as mx

    here = Path(mx.__file__).resolve().parent
    for p in (here, here.parent):
        if (p / "lib").is_dir() or (p / "include").is_dir():
            return p
    return here


def include_paths() -> list[str]:
    """MLX's include_path_args: its bundled include dir, CCCL, then the CUDA headers."""
    root = _mlx_root()
    out = []
    inc = root / "include"
    if inc.is_dir():
        out.append(str(inc))
    if (inc / "cccl").is_dir():
        out.append(str(inc / "cccl"))
    cands = [root.parent / "nvidia" / d / "include" for d in ("cu13", "cuda_runtime")]
    cands += [Path(p) / "include" for p in (os.environ.get("CUDA_HOME"), os.environ.get("CUDA_PATH")) if p]
    cands += [Path(p).parent.parent / "include" for p in glob.glob(str(root.parent / "nvidia" / "*" / "lib"))]
    cands.append(Path("/usr/local/cuda/include"))
    for c in cands:
        if (c / "cuda_fp16.h").is_file():
            out.append(str(c))
            if (c / "cccl").is_dir():
                out.append(str(c / "cccl"))
            break
    return out


def _load(name: str, patterns: list[str]):
    for p in patterns:
        for f in sorted(glob.glob(p)):
            try:
                return ctypes.CDLL(f)
            except OSError:
                continue
    found = ctypes.util.find_library(name)
    if found:
        return ctypes.CDLL(found)
    raise OSError(f"lib{name} not found")


def compute_capability() -> tuple[int, int]:
    cuda = _load("cuda", ["/usr/lib/x86_64-linux-gnu/libcuda.so*", "/usr/lib64/libcuda.so*"])
    dev, major, minor = ctypes.c_int(), ctypes.c_int(), ctypes.c_int()
    for call in (cuda.cuInit(0), cuda.cuDeviceGet(ctypes.byref(dev), 0),
                 cuda.cuDeviceGetAttribute(ctypes.byref(major), 75, dev),  # COMPUTE_CAPABILITY_MAJOR
                 cuda.cuDeviceGetAttribute(ctypes.byref(minor), 76, dev)):
        if call != 0:
            raise RuntimeError(f"CUDA driver error {call}")
    return major.value, minor.value


def nvrtc_compile(source: str, kernel: str) -> tuple[bytes, str]:
    """(cubin, lowered name of `kernel`) for this machine's GPU, with MLX's NVRTC options."""
    root = _mlx_root()
    lib = _load("nvrtc", [str(root.parent / "nvidia" / "*" / "lib" / "libnvrtc.so*"),
                          str(Path(sys.prefix) / "lib" / "python*" / "site-packages" / "nvidia" / "*" / "lib" / "libnvrtc.so*"),
                          "/usr/local/cuda/lib64/libnvrtc.so*"])
    major, minor = compute_capability()
    prog = ctypes.c_void_p()

    def check(rc, what):
        if rc != 0:
            raise RuntimeError(f"{what}: NVRTC error {rc}")

    hdrs = (ctypes.c_char_p * 1)(_UTILS.encode())
    names = (ctypes.c_char_p * 1)(_UTILS_NAME.encode())
    check(lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"rq_kernel.cu", 1, hdrs, names), "create")
    try:
        check(lib.nvrtcAddNameExpression(prog, kernel.encode()), "name")
        opts = ["--device-as-default-execution-space",
                f"--gpu-architecture=sm_{major}{minor}{'a' if major >= 9 else ''}"]
        opts += [f"--include-path={p}" for p in include_paths()]
        arr = (ctypes.c_char_p * len(opts))(*[o.encode() for o in opts])
        rc = lib.nvrtcCompileProgram(prog, len(opts), arr)
        if rc != 0:
            size = ctypes.c_size_t()
            lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            lib.nvrtcGetProgramLog(prog, log)
            raise RuntimeError(f"NVRTC compile failed: {log.value.decode(errors='replace')[:500]}")
        lowered = ctypes.c_char_p()
        check(lib.nvrtcGetLoweredName(prog, kernel.encode(), ctypes.byref(lowered)), "lowered name")
        size = ctypes.c_size_t()
        check(lib.nvrtcGetCUBINSize(prog, ctypes.byref(size)), "cubin size")
        buf = ctypes.create_string_buffer(size.value)
        check(lib.nvrtcGetCUBIN(prog, buf), "cubin")
        return buf.raw, lowered.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))
