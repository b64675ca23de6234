"""Keys at their own width (kv.key_bits) through the GPU kernels (kv_append and attn_fused_window with KBITS), with
the CPU executor (tests/kernel_emu) standing in for mx.fast.cuda_kernel: the whole path IsoQuantCache takes on a
GPU, against the ops-and-reference path it takes without kernels."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import rq_core.kernels.launch as K
from kernel_emu import configure
from rq_core.cache.kv_cache import IsoQuantCache

ROOT = Path(__file__).resolve().parents[1]

needs_emu = pytest.mark.skipif(shutil.which("g++") is None or not sys.platform.startswith("linux"),
                               reason="needs g++ and ucontext (Linux)")


def _run(n_prompt: int, steps: int, seed: int, G: int = 4, d: int = 128, **kw) -> tuple[IsoQuantCache, list[np.ndarray]]:
    """A 4-bit-key / 3-bit-value cache (or `kw`'s): a prompt, then decode steps; the attention outputs of the steps."""
    rng = np.random.default_rng(seed)
    Hkv = 2
    c = IsoQuantCache(head_dim=d, n_kv_heads=Hkv, layer=1, bits=3, fp16_window=8, **(kw or {"key_bits": 4}))
    k = mx.array(rng.standard_normal((1, Hkv, n_prompt, d)).astype(np.float16))
    v = mx.array(rng.standard_normal((1, Hkv, n_prompt, d)).astype(np.float16))
    q = mx.array(rng.standard_normal((1, Hkv * G, n_prompt, d)).astype(np.float16))
    c.attend(q, k, v, scale=d ** -0.5, mask="causal")
    c.end_prefill()
    outs = []
    for _ in range(steps):
        k1 = mx.array(rng.standard_normal((1, Hkv, 1, d)).astype(np.float16))
        v1 = mx.array(rng.standard_normal((1, Hkv, 1, d)).astype(np.float16))
        q1 = mx.array(rng.standard_normal((1, Hkv * G, 1, d)).astype(np.float16))
        o = c.attend(q1, k1, v1, scale=d ** -0.5, mask=None)
        outs.append(np.array(o.astype(mx.float32)))
    return c, outs


def _kernels_on_executor(monkeypatch) -> dict:
    """A 'GPU' whose kernels run on the CPU executor (stand-ins for mx.fast.cuda_kernel, by kernel name)."""
    from kernel_emu import emulate as EK

    stand: dict = {}

    def kernel(name: str):
        return stand.setdefault(name, EK.MLXStandIn(name))

    configure(monkeypatch, disk_cache=False, append="kernel", attention="fused")
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    monkeypatch.setattr(K, "available", lambda: True)
    monkeypatch.setattr(K, "_kernel", lambda name, be: kernel(name))
    monkeypatch.setattr(K, "_fused_kernel", lambda be, nth, minb, window=False, minified=True:
                        kernel("attn_fused_window" if window else "attn_fused"))
    return stand


@needs_emu
def test_split_widths_through_the_kernels(monkeypatch):
    ref_cache, ref = _run(60, 2, seed=4)  # CPU: quantize_kv for both widths, the reference attention

    stand = _kernels_on_executor(monkeypatch)
    gpu_cache, got = _run(60, 2, seed=4)

    assert "kv_append" in stand and "attn_fused_window" in stand  # the spill and the decode steps took the kernels
    tmpl = dict(stand["attn_fused_window"].calls[-1]["template"])
    assert tmpl["KBITS"] == 4 and tmpl["BITS"] == 3
    assert dict(stand["kv_append"].calls[-1]["template"])["KBITS"] == 4
    assert gpu_cache.k_codes.shape[-1] == 16 and gpu_cache.v_codes.shape[-1] == 12
    n = gpu_cache.packed_len
    assert n == ref_cache.packed_len > 0
    for a, b in ((gpu_cache.k_codes, ref_cache.k_codes), (gpu_cache.v_codes, ref_cache.v_codes)):
        assert mx.array_equal(a[:, :, :n], b[:, :, :n])  # random rows: no coordinate on a boundary
    for g, r in zip(got, ref):
        assert np.isfinite(g).all()
        # the kernel's levels are fp16: measured <= 5.4e-4 over 8 seeds (the three cache tests); 2.8x margin
        assert np.linalg.norm(g - r) / np.linalg.norm(r) < 1.5e-3


@needs_emu
@pytest.mark.parametrize("variant,nc", [("wht_so4", True), ("dense", False), ("rwht_so4", True)])
def test_kv_append_split_widths_match_quantize_kv(variant, nc, monkeypatch):
    """kv_append with 4-bit keys and 3-bit values: codes and norms equal quantize_kv's at each width, for every
    rotation kind and with norm correction (the keys' own levels and thresholds in consts)."""
    from kernel_emu import emulate as EK
    from rq_core.codec.codebook import sphere_codebook
    from rq_core.cache.kv_cache import quantize_kv
    from rq_core.codec.rotation import Rotation

    fake = EK.MLXStandIn("kv_append")
    configure(monkeypatch, disk_cache=False)
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    monkeypatch.setattr(K, "_kernel", lambda name, be: fake)
    rng = np.random.default_rng(5)
    d, H = 128, 2
    rot = Rotation(d, H, variant=variant, seed=3, layer=2)
    lv3 = mx.array(sphere_codebook(3, d).levels.astype("float32"))
    lv4 = mx.array(sphere_codebook(4, d).levels.astype("float32"))
    k = mx.array(rng.standard_normal((1, H, 5, d)).astype(np.float16))
    v = mx.array(rng.standard_normal((1, H, 5, d)).astype(np.float16))
    kc, kn, vc, vn = K.kv_append_codes(k, v, rot, lv3, 3, norm_correction=nc, key_bits=4, key_levels=lv4)
    rk = quantize_kv(k, rot, lv4, 4, norm_correction=nc)
    rv = quantize_kv(v, rot, lv3, 3, norm_correction=nc)
    assert kc.shape[-1] == 16 and vc.shape[-1] == 12
    for a, b in ((kc, rk[0]), (kn, rk[1]), (vc, rv[0]), (vn, rv[1])):
        assert mx.array_equal(a, b)


@needs_emu
def test_pair_codebooks_through_the_kernels(monkeypatch):
    """kv.pair_points (128, 32) on a 'GPU': kv_append's pair path and attn_fused_window with PK / PV (7- and 5-bit fields,
    the keys' own table, the values' lane-replicated one), against the CPU's quantize_kv and reference attention."""
    ref_cache, ref = _run(60, 2, seed=6, pair_points=(128, 32))
    stand = _kernels_on_executor(monkeypatch)
    gpu_cache, got = _run(60, 2, seed=6, pair_points=(128, 32))

    assert "kv_append" in stand and "attn_fused_window" in stand
    tmpl = dict(stand["attn_fused_window"].calls[-1]["template"])
    assert (tmpl["PK"], tmpl["PV"], tmpl["KBITS"], tmpl["BITS"], tmpl["VDEC"]) == (128, 32, 7, 5, 2)
    assert gpu_cache.k_codes.shape[-1] == 14 and gpu_cache.v_codes.shape[-1] == 10
    n = gpu_cache.packed_len
    assert n == ref_cache.packed_len > 0
    for a, b in ((gpu_cache.k_codes, ref_cache.k_codes), (gpu_cache.v_codes, ref_cache.v_codes)):
        assert mx.array_equal(a[:, :, :n], b[:, :, :n])
    for g, r in zip(got, ref):
        assert np.isfinite(g).all()
        # the kernel's points are fp16: measured <= 5.4e-4 over 8 seeds (the three cache tests); 2.8x margin
        assert np.linalg.norm(g - r) / np.linalg.norm(r) < 1.5e-3


@needs_emu
def test_row_blocks_through_the_kernels(monkeypatch):
    """Nemotron 3's 16 query heads a kv head (pair codebooks) through fused_attention's wrapper: two row blocks of 8
    a kv head (NRG 2: groups, splits, scratch and output rows as the body lays them out), against the CPU's reference
    attention, and the cache records the fused path."""
    ref_cache, ref = _run(300, 2, seed=8, G=16, pair_points=(128, 32))
    stand = _kernels_on_executor(monkeypatch)
    gpu_cache, got = _run(300, 2, seed=8, G=16, pair_points=(128, 32))
    call = stand["attn_fused_window"].calls[-1]
    tmpl = dict(call["template"])
    assert (tmpl["R"], tmpl["NRG"], tmpl["HKV"]) == (8, 2, 2) and call["grid"][0] // call["threadgroup"][0] == 4
    assert gpu_cache.attention_path == ("fused", None) and gpu_cache.packed_len == ref_cache.packed_len > 256
    for g, r in zip(got, ref):
        assert np.isfinite(g).all()
        # the kernel's points are fp16: measured <= 5.4e-4 over 8 seeds (the three cache tests); 2.8x margin
        assert np.linalg.norm(g - r) / np.linalg.norm(r) < 1.5e-3


@needs_emu
@pytest.mark.parametrize("strategy", ["word", "dim"])
@pytest.mark.parametrize("case", [dict(d=128, T=300, bits=5, key_bits=7, pair=(128, 32)),
                                  dict(d=64, T=130, bits=5, key_bits=7, pair=(128, 32)),
                                  dict(d=256, T=70, bits=4, key_bits=6, pair=(64, 16)),
                                  dict(d=128, T=200, bits=3, key_bits=4, pair=None)])
def test_four_kernels_take_pair_codebooks_and_key_widths(case, strategy, monkeypatch):
    """The four-kernel pipeline (what `rq profile` times) with pair codebooks, and with keys at their own width:
    Kernel A through the keys' table, Kernel C (both strategies) through the values', against the float64 reference
    (attn_reference's case and comparison; in-kernel rotation, causal over two queries)."""
    from kernel_emu import attn_reference as KC

    _kernels_on_executor(monkeypatch)
    rng = np.random.default_rng(11)
    L = 2
    c = KC.make_case(rng, B=1, Hkv=2, G=4, L=L, d=case["d"], T=case["T"], bits=case["bits"],
                     key_bits=case["key_bits"], pair_points=case["pair"])
    err, nan, _ = KC.run_case(K, mx, c, T=case["T"], bits=case["bits"], path="four", strategy=strategy, causal=True,
                              offset=case["T"] - L, rot=3, key_bits=case["key_bits"])
    assert nan == 0 and err < 6e-7, err  # fp32 throughout: measured <= 2.1e-7 over 8 seeds; 3x margin


@needs_emu
def test_head_dim_512_through_the_kernels(monkeypatch):
    """Gemma 4's global layers (head dim 512, 16 query heads over 2 kv heads: 8 rows a kv head, pair codebooks)
    through fused_attention's wrapper: two value-dim halves a group (grid, splits and scratch as the body lays them
    out), against the CPU's reference attention, and the cache records the fused path."""
    ref_cache, ref = _run(300, 1, seed=9, G=8, d=512, pair_points=(128, 32))
    stand = _kernels_on_executor(monkeypatch)
    gpu_cache, got = _run(300, 1, seed=9, G=8, d=512, pair_points=(128, 32))
    call = stand["attn_fused_window"].calls[-1]
    tmpl = dict(call["template"])
    assert (tmpl["D"], tmpl["R"], tmpl["NRG"], tmpl["STAGE"]) == (512, 8, 1, 0)
    assert call["grid"][0] // call["threadgroup"][0] == 2 * K.fused_vhalves(512) == 4  # 2 kv heads, 2 halves
    assert gpu_cache.attention_path == ("fused", None) and gpu_cache.packed_len == ref_cache.packed_len > 256
    for g, r in zip(got, ref):
        assert np.isfinite(g).all()
        # the kernel's points are fp16: measured <= 8.6e-4 over 8 seeds, where a near-tie gives the kernel and the ops a
        # different pair code (2 of 8 seeds at head dim 512), else <= 5.6e-4; kept, 2.3x margin
        assert np.linalg.norm(g - r) / np.linalg.norm(r) < 2e-3
