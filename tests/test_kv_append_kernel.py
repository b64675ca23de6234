"""kv_append (metal/kv_append.body): IsoQuantCache's append, quantize + pack of new K and V, in one launch.

No GPU here: the CUDA and the Metal rendering are executed on the CPU by tests/kernel_emu/emulate.py (threads as
cooperative contexts, SIMD-group functions across 32 lanes) and compared with quantize_kv (the MLX-op reference) and
float64 math through tests/kernel_emu/append_reference.py, the checks tools/gpu_check.py runs on the GPU. Plus the cache's dispatch (GPU: kernel, RQ_APPEND=ops or CPU: quantize_kv).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import rq_core.kernels.launch as K
from kernel_emu import configure
from rq_core.errors import RQError
from rq_core.cache.kv_cache import IsoQuantCache, quantize_kv

ROOT = Path(__file__).resolve().parent.parent
STUBS = Path(__file__).resolve().parent / "kernel_stubs"

needs_emu = pytest.mark.skipif(shutil.which("g++") is None or not sys.platform.startswith("linux"),
                               reason="the CPU executor needs g++ and ucontext (Linux)")

TEMPLATES = [  # (TK, D, BITS, ROT, NC, PV): wht_so4, dense with norm correction, WHT only, SO(4) only at 1 bit,
    # rwht_so4, pair codebooks (values' fields of BITS bits, keys' of BITS + 2)
    ("f16", 128, 3, 3, 0, 0), ("bf16", 256, 4, 4, 1, 0), ("f32", 64, 2, 1, 0, 0), ("f16", 32, 1, 2, 1, 0),
    ("f16", 128, 3, 11, 0, 0), ("f16", 128, 5, 3, 1, 32)]


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
    for tk, D, bits, rot, nc, pv in TEMPLATES:
        f = tmp_path / f"kv_append_{be}_{tk}_{D}_{rot}_{pv}.cpp"
        kb = bits + 2 if pv else bits
        f.write_text(prefix + K.full_source("kv_append", be, [("TK", tk), ("D", D), ("BITS", bits), ("KBITS", kb), ("ROT", rot),
                                                             ("NC", nc), ("PK", 1 << kb if pv else 0), ("PV", pv)],
                                            {"keys": tk, "values": tk}))
        cmd = [cc, "-std=c++17", "-fsyntax-only", "-Wno-attributes", "-Wno-unknown-pragmas", f"-I{inc}",
               f"-I{STUBS / 'cuda'}", str(f)]
        procs.append((f.name, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)))
    errors = [f"{n}:\n{p.communicate(timeout=120)[0][:3000]}" for n, p in procs if p.wait(timeout=120) != 0]
    assert not errors, "\n".join(errors)
    src = K.full_source("kv_append", be, [("TK", "f16"), ("D", 128), ("BITS", 3), ("KBITS", 3), ("ROT", 3), ("NC", 0),
                                          ("PK", 0), ("PV", 0)])
    assert "keys_strides" in src and "values_strides" in src and "keys_shape" in src  # views: no copy op


CASES = [
    dict(d=128, bits=3, variant="wht_so4", t=5, zero_row=True),
    dict(d=64, bits=2, variant="dense", t=1, nc=True),
    dict(d=256, bits=4, variant="wht_so4", t=1),
    dict(d=64, bits=3, variant="dense", t=3, B=2, view=True, dtype="bf16"),  # strided slice + transposed view
    dict(d=128, bits=3, variant="wht_so4", t=5, dtype="f32", boundary=True),  # coordinates on thresholds
    dict(d=128, bits=3, variant="rwht_so4", t=3),  # random signs before the WHT
]


# the Metal rendering on the cases that differ most: wht_so4 with a zero row, dense with norm correction, a strided
# bf16 view (the CUDA rendering on all)
METAL_CASES = (0, 1, 3)


@needs_emu
@pytest.mark.parametrize("backend,case", [pytest.param(be, c, id=f"{be}-" + "-".join(f"{k}{v}" for k, v in c.items()))
                                          for be in ("cuda", "metal") for i, c in enumerate(CASES)
                                          if be == "cuda" or i in METAL_CASES])
def test_source_matches_quantize_kv(case, backend):
    """The kernel's codes equal quantize_kv's bit for bit except within float32 rounding of a threshold
    (counted), norms equal quantize_kv's and are within half an fp16 ulp of float64; outputs start poisoned."""
    from kernel_emu import append_reference as AC

    rng = np.random.default_rng(len(str(case)) * 7 + case["d"])
    s = AC.summarize(AC.check_case(rng, case, "emu" if backend == "cuda" else "emu-metal"))
    assert s["ok"], s
    # norms: one fp16 ulp from quantize_kv's (two float32 sums in different orders can round to neighbouring halves),
    # half an ulp plus float32 error from float64's (rounding); measured 0.0 and 0.499 over 8 seeds
    assert s["ops_far"] == 0 and s["f64_far"] == 0 and s["norm_ulp_max"] <= 1.0 and s["norm_f64_ulp_max"] <= 0.51
    if case.get("boundary"):
        # the tolerance path is exercised, and tight: mismatches within float32 error of a threshold (measured gap
        # <= 1.6e-7 over 8 seeds; 3x margin)
        assert s["f64_boundary"] > 0 and s["gap_max"] < 5e-7
    else:
        assert s["ops_boundary"] == 0 and s["norm_unequal"] == 0  # random rows: identical to the reference


@needs_emu
@pytest.mark.parametrize("old,new", [
    ("(code[k] >> (-s))", "(code[k] >> (1 - s))"),  # a straddling code's high bits
    ("c += z > consts[loff + nl + t]", "c += z >= consts[loff + nl + t]"),  # ties: the zero row sits on threshold 0
    ("tj * values_strides[2]", "tj * keys_strides[2]"),  # values read through the keys' layout
])
def test_a_broken_kernel_is_caught(old, new, tmp_path, monkeypatch):
    from kernel_emu import append_reference as AC

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


@needs_emu
@pytest.mark.parametrize("nc,backend,D", [(False, "cuda", 128), (True, "cuda", 128), (True, "metal", 128),
                                          (False, "cuda", 512), (False, "metal", 512)])
def test_pair_codebooks_match_quantize_kv(nc, backend, D):
    """Pair codebooks (kv.pair_points (128, 32)): the kernel's 7- and 5-bit fields equal quantize_kv's nearest points
    (a near-tie may differ: counted, none on random rows), norms equal, with norm correction too; f16 rows, wht_so4;
    head dim 128 and Gemma 4's global 512."""
    from kernel_emu import emulate as EK

    c = IsoQuantCache(head_dim=D, n_kv_heads=2, layer=1, pair_points=(128, 32), norm_correction=nc)
    rng = np.random.default_rng(5)
    B, H, T = 1, 2, 5
    k = rng.standard_normal((B, H, T, D)).astype(np.float16)
    v = (3 * rng.standard_normal((B, H, T, D))).astype(np.float16)
    rot, mats = K.rotation_args(c.rotation)
    consts = np.array(K._append_consts(c.levels, D, c.k_levels))
    assert consts.size == 3 * 32 + 2 + 3 * 128
    out = EK.run_kv_append(k, v, np.zeros(1, np.float32) if mats is None else np.array(mats), consts,
                           shape=(B, H, T, D), bits=5, rot=rot, nc=nc, tk="f16", key_bits=7, pair_points=(128, 32),
                           backend=backend)
    ref = c.compress_kv(mx.array(k), mx.array(v))  # quantize_kv on the CPU
    for name, r in zip(("k_codes", "k_norms", "v_codes", "v_norms"), ref):
        assert out[name].shape == tuple(r.shape), name
        np.testing.assert_array_equal(out[name].view(np.uint32) if "codes" in name else out[name], np.array(r), name)


def _cache(**kw):
    c = IsoQuantCache(head_dim=64, n_kv_heads=2, layer=1, bits=3, **kw)
    c.prefilling = False
    return c


def test_cpu_keeps_the_ops_path(monkeypatch):
    from rq_core.kernels import config as env

    assert env.KernelConfig.from_env({}).append == "kernel"
    assert env.KernelConfig.from_env({"RQ_APPEND": "ops"}).append == "ops"
    with pytest.raises(RQError, match="RQ_APPEND='fast' is not an append path"):
        env.KernelConfig.from_env({"RQ_APPEND": "fast"})
    configure(monkeypatch, append="kernel")
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
    configure(monkeypatch, append="kernel")
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
    configure(monkeypatch, append="ops")
    c._append_fp16(k[:, :, :1], k[:, :, :1])
    c._spill(0)
    assert len(calls) == 2 and c.packed_len == 7

    def unsupported(*a, **kw):
        raise K.KernelUnsupported("test")

    configure(monkeypatch, append="kernel")
    monkeypatch.setattr(K, "kv_append_codes", unsupported)
    assert K.append_codes(k, k, c.rotation, c.levels, 3) is None


@needs_emu
def test_gpu_wrapper_through_the_executor(monkeypatch):
    """kernels.kv_append_codes (the launch arguments) and append_reference's GPU path, with the CPU executor
    standing in for mx.fast.cuda_kernel; then an IsoQuantCache spill through it equals the ops path."""
    from kernel_emu import append_reference as AC
    from kernel_emu import emulate as EK

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
    configure(monkeypatch, append="kernel")
    c, ref = _cache(rotation="dense"), _cache(rotation="dense")
    k = mx.random.normal((1, 2, 3, 64)).astype(mx.float16)
    for cache in (c, ref):
        cache._append_fp16(k, k * 2)
    c._spill(0)
    configure(monkeypatch, append="ops")
    ref._spill(0)
    assert len(fake.calls) == 2 and fake.calls[-1]["init_value"] is None
    for a, b in ((c.k_codes, ref.k_codes), (c.k_norms, ref.k_norms), (c.v_codes, ref.v_codes),
                 (c.v_norms, ref.v_norms)):
        assert mx.array_equal(a[:, :, :3], b[:, :, :3])


@needs_emu
def test_pair_cache_spills_through_the_wrapper(monkeypatch):
    """A pair-codebook cache (128, 32) on a 'GPU' (the CPU executor standing in for mx.fast.cuda_kernel): its spill
    goes through kernels.kv_append_codes (template PK / PV, rows of 14 and 10 words) and stores what the ops path
    stores."""
    from kernel_emu import emulate as EK

    fake = EK.MLXStandIn("kv_append")
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    monkeypatch.setattr(K, "_kernel", lambda name, be: fake)
    monkeypatch.setattr(K, "available", lambda: True)
    configure(monkeypatch, append="kernel")

    def cache():
        c = IsoQuantCache(head_dim=128, n_kv_heads=2, layer=1, pair_points=(128, 32))
        c.prefilling = False
        return c

    c, ref = cache(), cache()
    k = mx.random.normal((1, 2, 3, 128), key=mx.random.key(4)).astype(mx.float16)
    for x in (c, ref):
        x._append_fp16(k, k * 2)
    c._spill(0)
    configure(monkeypatch, append="ops")
    ref._spill(0)
    assert len(fake.calls) == 1
    t = dict(fake.calls[0]["template"])
    assert (t["PK"], t["PV"], t["BITS"], t["KBITS"]) == (128, 32, 5, 7)
    assert c.k_codes.shape[-1] == 14 and c.v_codes.shape[-1] == 10
    for a, b in ((c.k_codes, ref.k_codes), (c.k_norms, ref.k_norms), (c.v_codes, ref.v_codes),
                 (c.v_norms, ref.v_norms)):
        assert mx.array_equal(a[:, :, :3], b[:, :, :3])
