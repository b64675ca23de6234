"""rq_core.kernels.cache off the GPU: MLX's module naming, the verbose print's parsing, the capture of
file descriptor 1, the cache layout MLX reads, atomic writes, and the launch hook's once-per-class rule.
(The NVRTC compile itself needs a GPU machine: benchmarks/diag/kernel_cache_check.py.)"""

from __future__ import annotations

import ctypes
import os

import pytest

from rq_core.kernels import cache as kc

# libstdc++'s std::hash<std::string>, printed by a C++ program (g++ 13, x86-64)
HASHES = {"": 0x553E93901E462A6E, "custom_kernel_rq_attn_v5": 0x70EAFA31AED752B1,
          "namespace mlx::core::cu {\n__global__ void f() {}\n}\n": 0xD77E6F743DD6DDE9}

SOURCE = '#include "mlx/backend/cuda/device/utils.cuh"\nnamespace mlx::core::cu {\n__global__ void k() {}\n}'


def _verbose(name: str, source: str) -> str:  # MLX's cuda_kernel verbose print
    return f"Generated source code for `{name}`:\n```\n{source}\n```\n"


def test_std_hash_matches_libstdcxx():
    for s, h in HASHES.items():
        assert kc.std_hash(s.encode()) == h
    assert kc.module_name("custom_kernel_x_1_2", "") == "custom_kernel_x_1_2_553e93901e462a6e"


def test_parse_verbose():
    name, src = kc.parse_verbose("noise\n" + _verbose("custom_kernel_rq_attn_v5_float16_128", SOURCE) + "more\n")
    assert name == "custom_kernel_rq_attn_v5_float16_128" and src == SOURCE
    with pytest.raises(ValueError):
        kc.parse_verbose("nothing printed")


def test_capture_stdout_sees_c_level_writes():
    libc = ctypes.CDLL(None)

    def fn():
        libc.printf(b"from C stdio\n")
        os.write(1, b"from fd 1\n")
        return 7

    res, text = kc._capture_stdout(fn)
    assert res == 7 and "from C stdio" in text and "from fd 1" in text


def test_ptx_path_splits_long_names(tmp_path):
    assert kc.ptx_path(tmp_path, "m") == tmp_path / "m.ptx"
    long = "a" * 300
    assert kc.ptx_path(tmp_path, long) == tmp_path / ("a" * 245) / ("a" * 55 + ".ptx")


def test_cache_dir_follows_mlx(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "c"))
    assert kc.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("MLX_PTX_CACHE_DIR")
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    import mlx.core as mx

    assert kc.cache_dir() == tmp_path / "mlx" / mx.__version__ / "ptx"


def test_ensure_cached_writes_what_mlx_reads(monkeypatch, tmp_path):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    calls = []

    def fake_compile(source, kernel):
        calls.append(kernel)
        return b"\x7fELF-cubin", "_ZN3mlx4core2cu1kEv"

    monkeypatch.setattr(kc, "nvrtc_compile", fake_compile)
    p = kc.ensure_cached("custom_kernel_k", SOURCE)
    assert p == tmp_path / (kc.module_name("custom_kernel_k", SOURCE) + ".ptx")
    assert p.read_bytes() == b"\x7fELF-cubin"
    assert p.with_suffix(".txt").read_text() == "mlx::core::cu::custom_kernel_k\t_ZN3mlx4core2cu1kEv\n"
    assert p.with_suffix(".cu").read_text() == SOURCE
    assert kc.ensure_cached("custom_kernel_k", SOURCE) == p and len(calls) == 1  # present: not recompiled
    assert not [f for f in os.listdir(tmp_path) if f.startswith(".rq-")]  # no temp files left


def test_launch_caches_once_per_class_and_survives_failures(monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kc, "_DONE", set())
    monkeypatch.setattr(kc, "_WARNED", [])
    seen = []

    def kernel(verbose=False, name="custom_kernel_k_3", **kw):
        seen.append(verbose)
        if verbose:
            os.write(1, _verbose(name, SOURCE).encode())
        return ["out"]

    monkeypatch.setattr(kc, "nvrtc_compile", lambda s, k: (b"img", "lowered"))
    assert kc.launch(kernel, ("k", 3), inputs=[]) == ["out"]
    assert kc.launch(kernel, ("k", 3), inputs=[]) == ["out"]
    assert seen == [True, False]  # the verbose capture once per kernel class
    assert (tmp_path / (kc.module_name("custom_kernel_k_3", SOURCE) + ".ptx")).read_bytes() == b"img"

    def broken(s, k):
        raise RuntimeError("no NVRTC here")

    monkeypatch.setattr(kc, "nvrtc_compile", broken)
    assert kc.launch(kernel, ("k", 4), inputs=[], name="custom_kernel_k_4") == ["out"]  # MLX compiles as before
    assert "kernel cache off" in capsys.readouterr().err


def test_first_run_note(tmp_path, monkeypatch):
    """The first GPU run on a machine (MLX's PTX cache empty) gets a one-line note; later runs and CPU runs none."""
    import rq_core.kernels.launch as K

    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(tmp_path / "ptx"))
    monkeypatch.setattr(K, "backend", lambda: None)
    assert kc.first_run_note() is None
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    note = kc.first_run_note()
    assert note is not None and str(tmp_path / "ptx") in note
    (tmp_path / "ptx").mkdir()
    (tmp_path / "ptx" / "some_module.ptx").write_bytes(b"x")
    assert kc.first_run_note() is None
