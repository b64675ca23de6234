"""kv_decode (metal/kv_decode.body): packed rows back to rotated-space vectors, the decode a prompt chunk's attention
over compressed tokens takes on a GPU (kv.prefill_fp16). No GPU here: the CUDA (and the Metal) rendering runs on the
CPU executor (tests/kernel_emu/emulate.py) standing in for mx.fast.cuda_kernel (mx.fast.metal_kernel), against the
MLX-op reference."""

from __future__ import annotations

import math
import shutil
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

import rq_core.kernels.launch as K
from kernel_emu import configure
from rq_core.attention.reference import dequantize_rotated
from rq_core.cache.kv_cache import IsoQuantCache, KVSettings, make_kv_cache

ROOT = Path(__file__).resolve().parents[1]

needs_emu = pytest.mark.skipif(shutil.which("g++") is None or not sys.platform.startswith("linux"),
                               reason="needs g++ and ucontext (Linux)")


def _on_executor(monkeypatch, backend: str = "cuda") -> dict:
    from kernel_emu import emulate as EK

    stand: dict = {}
    configure(monkeypatch, disk_cache=False, poison=True)  # outputs start as NaN: an element the kernel skips shows
    monkeypatch.setattr(K, "backend", lambda: backend)
    monkeypatch.setattr(K, "available", lambda: True)
    monkeypatch.setattr(K, "_kernel", lambda name, be: stand.setdefault(name, EK.MLXStandIn(name, be)))
    return stand


def _filled(pair_points, d: int, T: int, seed: int) -> IsoQuantCache:
    c = IsoQuantCache(head_dim=d, n_kv_heads=2, layer=1, pair_points=pair_points)
    rng = np.random.default_rng(seed)
    k = mx.array(rng.standard_normal((2, 2, T, d)).astype(np.float32))
    c._append_packed(*c.compress_kv(k, 3 * k + 1))
    c.packed_len = T
    return c


@needs_emu
@pytest.mark.parametrize("backend", ["cuda", "metal"])
@pytest.mark.parametrize("pair_points,d,dtype", [(None, 64, mx.float32), ((128, 32), 128, mx.bfloat16),
                                                 ((128, 32), 64, mx.float16), ((128, 32), 512, mx.float16),
                                                 (None, 512, mx.float32)])
def test_decode_rows_matches_the_reference(monkeypatch, pair_points, d, dtype, backend):
    """Keys and values (their own field widths with pair codebooks), rows 0 .. n-1 of a buffer with spare capacity,
    every output element written, equal to dequantize_rotated up to the output dtype's rounding."""
    c = _filled(pair_points, d, 37, seed=3)  # capacity 256 rows, 37 valid; decode 30
    n = 30
    want = [dequantize_rotated(c.k_codes[:, :, :n], c.k_norms[:, :, :n], c.k_levels, c.key_bits or c.bits, d),
            dequantize_rotated(c.v_codes[:, :, :n], c.v_norms[:, :, :n], c.levels, c.bits, d)]
    stand = _on_executor(monkeypatch, backend)
    got = [K.decode_rows(c.k_codes, c.k_norms, c.k_levels, bits=c.key_bits or c.bits, d=d, n=n, dtype=dtype),
           K.decode_rows(c.v_codes, c.v_norms, c.levels, bits=c.bits, d=d, n=n, dtype=dtype)]
    # f32: measured <= 1.1e-7 (head dim 512, 1/sqrt(d) inexact; 0.0 at 64) over 8 seeds, 2.8x margin. f16 / bf16: the
    # output's rounding, at most 2^-11 / 2^-8 of each element (measured <= 2.3e-4 / 1.8e-3 of rtol + atol)
    tol = {mx.float32: 3e-7, mx.float16: 5e-4, mx.bfloat16: 4e-3}[dtype]
    for g, w in zip(got, want):
        assert g.shape == (2, 2, n, d) and g.dtype == dtype
        g = np.array(g.astype(mx.float32))
        assert not np.isnan(g).any()
        np.testing.assert_allclose(g, np.array(w), rtol=tol, atol=tol * float(mx.abs(w).max()))
    # room after the decoded rows (IsoQuantCache puts the fp16 segment there): rows n .. left as they were (poison)
    roomy = np.array(K.decode_rows(c.v_codes, c.v_norms, c.levels, bits=c.bits, d=d, n=n, dtype=dtype, rows=n + 5)
                     .astype(mx.float32))
    assert roomy.shape == (2, 2, n + 5, d) and np.isnan(roomy[:, :, n:]).all()
    np.testing.assert_array_equal(roomy[:, :, :n], np.array(got[1].astype(mx.float32)))
    call = stand["kv_decode"].calls[-1]
    assert call["grid"][0] == 2 * 2 * n * call["threadgroup"][0] and dict(call["template"])["PAIR"] == int(bool(pair_points))


@needs_emu
def test_decode_rows_kernel_can_fail(monkeypatch, tmp_path):
    """The comparison above catches a wrong field offset (a mutant reading each field one bit late)."""
    src = tmp_path / "metal"
    shutil.copytree(K.SRC_DIR, src)
    body = (src / "kv_decode.body").read_text()
    old = "const int bit = f * FB;"
    assert body.count(old) == 1
    (src / "kv_decode.body").write_text(body.replace(old, "const int bit = f * FB + 1;"))
    monkeypatch.setattr(K, "SRC_DIR", src)
    K._read.cache_clear()
    try:
        c = _filled(None, 64, 9, seed=4)
        want = dequantize_rotated(c.k_codes[:, :, :9], c.k_norms[:, :, :9], c.levels, 3, 64)
        _on_executor(monkeypatch)
        got = K.decode_rows(c.k_codes, c.k_norms, c.levels, bits=3, d=64, n=9, dtype=mx.float32)
        # a detection bound, not a tolerance: the mutant is off by 2.7-2.9 (more than the rows' max) over 4 seeds, the
        # real code by 0.0 here
        assert not np.allclose(np.array(got), np.array(want), atol=1e-4)
    finally:
        K._read.cache_clear()


@needs_emu
def test_long_prompt_prefill_through_the_kernels(monkeypatch):
    """A prompt compressed as it is prefilled (kv.prefill_fp16), its chunks attending to the compressed tokens through
    kv_append + kv_decode on a 'GPU', gives what the CPU path gives."""
    d, Hkv, G = 64, 2, 4
    rng = np.random.default_rng(9)
    chunks = [tuple(mx.array(rng.standard_normal(s).astype(np.float32)) for s in
                    ((1, Hkv * G, L, d), (1, Hkv, L, d), (1, Hkv, L, d))) for L in (12, 12, 20)]

    def run():
        c = make_kv_cache(KVSettings(mode="isoquant3", fp16_window=2, prefill_fp16=16, pair_points=(128, 32)),
                          layer=1, n_kv_heads=Hkv, head_dim=d)
        outs = [np.array(c.attend(q, k, v, scale=d ** -0.5, mask="causal")) for q, k, v in chunks]
        return c, outs

    ref_cache, ref = run()
    stand = _on_executor(monkeypatch)
    gpu_cache, got = run()
    assert gpu_cache.packed_len == ref_cache.packed_len == 24 and len(stand["kv_decode"].calls) == 4
    for g, r in zip(got, ref):  # measured 0.0 over 8 seeds: at head dim 64 the decoded rows are the ops' bit for bit
        np.testing.assert_array_equal(g, r)  # (1/sqrt(64) exact) and the attention after them is the same MLX ops
