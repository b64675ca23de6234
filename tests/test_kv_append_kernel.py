"""kv_append (metal/kv_append.body): IsoQuantCache's append, quantize + pack of new K and V, in one launch.

No GPU here: the CUDA rendering itself is executed on the CPU by benchmarks/emulate_kernel.py (threads as
cooperative contexts) and compared with quantize_kv (the MLX-op reference) and float64 math through
benchmarks/append_check.py, the script that runs the same checks on the GPU; the Metal rendering is
syntax-checked against stubs. Plus the cache's dispatch (GPU: kernel, RQ_APPEND=ops or CPU: quantize_kv).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import rq_core.kernels as K
from rq_core.errors import RQError
from rq_core.kv_cache import IsoQuantCache, quantize_kv

ROOT = Path(__file__).resolve().parent.parent
STUBS = Path(__file__).resolve().parent / "kernel_stubs"
sys.path.insert(0, str(ROOT / "benchmarks"))

needs_emu = pytest.mark.skipif(shutil.which("g++") is None or not sys.platform.startswith("linux"),
                               reason="the CPU executor needs g++ and ucontext (Linux)")

TEMPLATES = [  # (TK, D, BITS, ROT, NC): wht_so4, dense with norm correction, WHT only, SO(4) only at 1 bit, rwht_so4
    ("f16", 128, 3, 3, 0), ("bf16", 256, 4, 4, 1), ("f32", 64, 2, 1, 0), ("f16", 32, 1, 2, 1), ("f16", 128, 3, 11, 0)]


@pytest.mark.parametrize("be", ["metal", "cuda"])
def test_renderings_compile(be, tmp_path):
    """Both renderings of several shape classes pass a C++ syntax check against the backend stubs."""
    cc = shutil.which("g++") or shutil.which("clang++")
    if cc is None:
        pytest.skip("no C++ compiler")
    if be == "metal":
        prefix, inc = '#include "metal_stub.h"\n', STUBS
    else:
        prefix = ('#include "mlx/backend/cuda/device/utils.cuh"\n#include <cooperative_groups.h>\n'
                  "#define inf cuda::std::numeric_limits<float>::infinity()\n")
        inc = STUBS / "cuda"
    procs = []
    for tk, D, bits, rot, nc in TEMPLATES:
        f = tmp_path / f"kv_append_{be}_{tk}_{D}_{rot}.cpp"
        f.write_text(prefix + K.full_source("kv_append", be, [("TK", tk), ("D", D), ("BITS", bits), ("KBITS", bits), ("ROT", rot),
                                                             ("NC", nc)], {"keys": tk, "values": tk}))
        cmd = [cc, "-std=c++17", "-fsyntax-only", "-Wno-attributes", "-Wno-unknown-pragmas", f"-I{inc}",
               f"-I{STUBS / 'cuda'}", str(f)]
        procs.append((f.name, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    errors = [f"{n}:\n{p.communicate(timeout=120)[0][:3000]}" for n, p in procs if p.wait(timeout=120) != 0]
    assert not errors, "\n".join(errors)
    src = K.full_source("kv_append", be, [("TK", "f16"), ("D", 128), ("BITS", 3), ("KBITS", 3), ("ROT", 3), ("NC", 0)])
    assert "keys_strides" in src and "values_strides" in src and "keys_shape" in src  # views: no copy op


CASES = [
    dict(d=128, bits=3, variant="wht_so4", t=5, zero_row=True),
    dict(d=64, bits=2, variant="dense", t=1, nc=True),
    dict(d=256, bits=4, variant="wht_so4", t=1),
    dict(d=64, bits=3, variant="dense", t=3, B=2, view=True, dtype="bf16"),  # strided slice + transposed view
    dict(d=128, bits=3, variant="wht_so4", t=5, dtype="f32", boundary=True),  # coordinates on thresholds
    dict(d=128, bits=3, variant="rwht_so4", t=3),  # random signs before the WHT
]


@needs_emu
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}{v}" for k, v in c.items()))
def test_cuda_source_matches_quantize_kv(case):
    """The kernel's codes equal quantize_kv's bit for bit except within float32 rounding of a threshold
    (counted), norms equal quantize_kv's and are within half an fp16 ulp of float64; outputs start poisoned."""
    import append_check as AC

    rng = np.random.default_rng(len(str(case)) * 7 + case["d"])
    s = AC.summarize(AC.check_case(rng, case, "emu"))
    assert s["ok"], s
    assert s["ops_far"] == 0 and s["f64_far"] == 0 and s["norm_ulp_max"] <= 1.0 and s["norm_f64_ulp_max"] <= 0.51
    if case.get("boundary"):
        assert s["f64_boundary"] > 0 and s["gap_max"] < 1e-6  # the tolerance path is exercised, and tight
    else:
        assert s["ops_boundary"] == 0 and s["norm_unequal"] == 0  # random rows: identical to the reference


@needs_emu
@pytest.mark.parametrize("old,new", [
    ("(code[k] >> (-s))", "(code[k] >> (1 - s))"),  # a straddling code's high bits
    ("c += z > consts[loff + nl + t]", "c += z >= consts[loff + nl + t]"),  # ties: the zero row sits on threshold 0
    ("tj * values_strides[2]", "tj * keys_strides[2]"),  # values read through the keys' layout
])
def test_a_broken_kernel_is_caught(old, new, tmp_path, monkeypatch):
    import append_check as AC

    src = tmp_path / "metal"
    shutil.copytree(K.SRC_DIR, src)
    body = (src / "kv_append.body").read_text()
    assert body.count(old) == 1
    (src / "kv_append.body").write_text(body.replace(old, new))
    monkeypatch.setattr(K, "SRC_DIR", src)
    K._read.cache_clear()
    try:
        case = dict(d=64, bits=3, variant="wht_so4", t=3, B=2, view=True, zero_row=True)
        assert not AC.summarize(AC.check_case(np.random.default_rng(1), case, "emu"))["ok"]
    finally:
        K._read.cache_clear()


def _cache(**kw):
    c = IsoQuantCache(head_dim=64, n_kv_heads=2, layer=1, bits=3, **kw)
    c.prefilling = False
    return c


def test_cpu_keeps_the_ops_path(monkeypatch):
    monkeypatch.delenv("RQ_APPEND", raising=False)
    assert K.append_mode() == "kernel"
    monkeypatch.setenv("RQ_APPEND", "fast")
    with pytest.raises(RQError):
        K.append_mode()
    monkeypatch.setenv("RQ_APPEND", "ops")
    assert K.append_mode() == "ops"
    monkeypatch.delenv("RQ_APPEND")
    c = _cache()
    k = mx.random.normal((1, 2, 3, 64)).astype(mx.float16)
    v = mx.random.normal((1, 2, 3, 64)).astype(mx.float16)
    if K.backend() is None:
        assert K.append_codes(k, v, c.rotation, c.levels, 3) is None
        with pytest.raises(K.KernelUnsupported):
            K.kv_append_codes(k, v, c.rotation, c.levels, 3)
    got = c.compress_kv(k, v)
    ref = (*quantize_kv(k, c.rotation, c.levels, 3), *quantize_kv(v, c.rotation, c.levels, 3))
    if K.backend() is None:
        assert all(mx.array_equal(a, b) for a, b in zip(got, ref))


def test_dispatch_to_the_kernel(monkeypatch):
    """Where kernels are available, IsoQuantCache's spill goes through one kv_append_codes call per chunk
    (K and V together, strided views of the fp16 segment), and RQ_APPEND=ops or an unsupported shape keeps
    quantize_kv."""
    calls = []

    def fake(keys, values, rotation, levels, bits, *, norm_correction=False, **_):
        calls.append((keys.shape, values.shape, norm_correction))
        return (*quantize_kv(keys, rotation, levels, bits, norm_correction=norm_correction),
                *quantize_kv(values, rotation, levels, bits, norm_correction=norm_correction))

    monkeypatch.setattr(K, "available", lambda: True)
    monkeypatch.setattr(K, "kv_append_codes", fake)
    monkeypatch.delenv("RQ_APPEND", raising=False)
    c = _cache(norm_correction=True)
    c.prefilling = True
    k = mx.random.normal((1, 2, 5, 64)).astype(mx.float16)
    c._append_fp16(k, k + 1)  # what attend() does first (attend itself would run the GPU attention here)
    c.end_prefill()
    assert calls == [((1, 2, 5, 64), (1, 2, 5, 64), True)] and c.packed_len == 5
    ref = quantize_kv(k + 1, c.rotation, c.levels, 3, norm_correction=True)
    assert mx.array_equal(c.v_codes[:, :, :5], ref[0]) and mx.array_equal(c.v_norms[:, :, :5], ref[1])
    c._append_fp16(k[:, :, :1], k[:, :, :1])
    c._spill(0)  # one decoded token
    assert len(calls) == 2 and calls[1][0] == (1, 2, 1, 64) and c.packed_len == 6
    monkeypatch.setenv("RQ_APPEND", "ops")
    c._append_fp16(k[:, :, :1], k[:, :, :1])
    c._spill(0)
    assert len(calls) == 2 and c.packed_len == 7

    def unsupported(*a, **kw):
        raise K.KernelUnsupported("test")

    monkeypatch.delenv("RQ_APPEND")
    monkeypatch.setattr(K, "kv_append_codes", unsupported)
    assert K.append_codes(k, k, c.rotation, c.levels, 3) is None


def test_append_check_script_runs_on_cpu(tmp_path):
    """benchmarks/append_check.py (what runs on the H200) has no Python errors: its timing half on CPU
    with a labelled stand-in for the launch, JSON written."""
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "append_check.py"), "--cpu-emulate", "--skip-check",
                        "--layers", "1", "--reps", "1", "--warmup", "0", "--out", str(tmp_path)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    import json

    rep = json.loads((tmp_path / "append_check.json").read_text())
    assert len(rep["timing"]) == 6 and all(t["stand_in"] and t["ops"] and t["kernel"] for t in rep["timing"])


@needs_emu
def test_gpu_wrapper_through_the_executor(monkeypatch):
    """kernels.kv_append_codes (the launch arguments) and append_check's GPU path, with the CPU executor
    standing in for mx.fast.cuda_kernel; then an IsoQuantCache spill through it equals the ops path."""
    import append_check as AC
    import emulate_kernel as EK

    fake = EK.MLXStandIn("kv_append")
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    monkeypatch.setattr(K, "_kernel", lambda name, be: fake)
    case = dict(d=64, bits=3, variant="wht_so4", t=2, B=2, view=True, dtype="bf16", zero_row=True)
    s = AC.summarize(AC.check_case(np.random.default_rng(3), case, "gpu"))
    assert s["ok"] and s["ops_boundary"] == 0 and s["norm_unequal"] == 0, s
    call = fake.calls[-1]
    assert call["grid"] == (2 * 2 * 2 * 64, 2, 1) and call["threadgroup"] == (64, 1, 1)
    assert call["init_value"] == K.APPEND_POISON and dict(call["template"])["TK"] == "bf16"
    monkeypatch.setattr(K, "available", lambda: True)
    monkeypatch.delenv("RQ_APPEND", raising=False)
    c, ref = _cache(rotation="dense"), _cache(rotation="dense")
    k = mx.random.normal((1, 2, 3, 64)).astype(mx.float16)
    for cache in (c, ref):
        cache._append_fp16(k, k * 2)
    c._spill(0)
    monkeypatch.setenv("RQ_APPEND", "ops")
    ref._spill(0)
    assert len(fake.calls) == 2 and fake.calls[-1]["init_value"] is None
    for a, b in ((c.k_codes, ref.k_codes), (c.k_norms, ref.k_norms), (c.v_codes, ref.v_codes),
                 (c.v_norms, ref.v_norms)):
        assert mx.array_equal(a[:, :, :3], b[:, :, :3])
