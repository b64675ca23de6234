"""benchmarks/kv_study.py: the split-bits emulation cache matches the real packed cache, bytes, paired statistics."""

import math
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.kv_study import SplitBitsCache, Setting, packed_bytes, paired_stats, pairwise  # noqa: E402
from rq_core.kv_cache import IsoQuantCache, KVSettings, dequantize_kv, quantize_kv  # noqa: E402

B, HQ, HKV, D = 1, 4, 2, 32
SCALE = 1 / math.sqrt(D)


def _rand(shape, seed):
    return mx.random.normal(shape, key=mx.random.key(seed))


def _run(cache, steps=3, prompt=12, step=2):
    """Prefill `prompt` tokens, end_prefill, then decode `steps` steps of `step` tokens; outputs of the decode steps."""
    q, k, v = (_rand((B, h, prompt, D), s) for h, s in ((HQ, 0), (HKV, 1), (HKV, 2)))
    cache.attend(q, k, v, scale=SCALE, mask="causal")
    cache.end_prefill()
    outs = []
    for i in range(steps):
        q, k, v = (_rand((B, h, step, D), 10 * i + s) for h, s in ((HQ, 3), (HKV, 4), (HKV, 5)))
        outs.append(cache.attend(q, k, v, scale=SCALE, mask="causal"))
    return mx.concatenate(outs, axis=2)


@pytest.mark.parametrize("rotation,window", [("wht_so4", 0), ("dense", 0), ("wht_so4", 3)])
def test_split_bits_at_equal_bits_matches_packed_cache(rotation, window):
    kw = dict(head_dim=D, n_kv_heads=HKV, layer=1, rotation=rotation, fp16_window=window, seed=2)
    real = _run(IsoQuantCache(bits=3, **kw))
    emul_cache = SplitBitsCache(key_bits=3, value_bits=3, **kw)
    emul = _run(emul_cache)
    assert mx.abs(real - emul).max().item() < 1e-4
    assert emul_cache.fp16_len == window and emul_cache.offset == 12 + 3 * 2


def test_split_bits_stores_keys_and_values_at_their_own_bits():
    c = SplitBitsCache(key_bits=4, value_bits=3, head_dim=D, n_kv_heads=HKV, layer=0)
    _run(c, steps=1)
    k = _rand((B, HKV, 12, D), 1)
    for bits, stored in ((4, c._dk), (3, None)):
        codes, norms = quantize_kv(k, c.rotation, c.k_levels, bits)
        if stored is not None:  # the prompt's keys are exactly the 4-bit reconstruction
            want = dequantize_kv(codes, norms, c.rotation, c.k_levels, bits, D)
            assert mx.abs(stored[:, :, :12] - want).max().item() < 1e-5
    assert c.k_levels.size == 16 and c.v_levels.size == 8
    err4 = mx.abs(c._dk[:, :, :12] - k).mean().item()
    v = _rand((B, HKV, 12, D), 2)
    err3 = mx.abs(c._dv[:, :, :12] - v).mean().item()
    assert err4 < err3  # 4-bit keys reconstruct closer than 3-bit values


def test_bytes_ratio_matches_real_cache():
    c = IsoQuantCache(bits=3, head_dim=128, n_kv_heads=2, fp16_window=16)
    c.attend(_rand((1, 4, 100, 128), 0), _rand((1, 2, 100, 128), 1), _rand((1, 2, 100, 128), 2), scale=0.1,
             mask="causal")
    c.end_prefill()
    s = Setting("x", KVSettings(mode="isoquant3", fp16_window=16))
    # the real cache holds float32 fp16-window rows here (the inputs' dtype), the study counts them as fp16
    fp16_seg = 16 * 2 * 128 * 2 * 2  # tokens * heads * d * (K, V) * 2 bytes
    assert c.nbytes - fp16_seg * 2 == 84 * 2 * packed_bytes(3, 3, 128)
    assert s.bytes_ratio(1, 128, 100) == pytest.approx((c.nbytes - fp16_seg) / c.fp16_nbytes)
    assert packed_bytes(4, 3, 128) == 66 + 50
    assert Setting("y", KVSettings(mode="isoquant3"), fp16_layers=(0,)).bytes_ratio(2, 128, 10) == pytest.approx(
        (1 + 100 / 512) / 2)


def test_paired_stats_and_pairwise():
    rng = np.random.default_rng(0)
    a, b = rng.normal(0.01, 0.1, (4, 50)), rng.normal(0.0, 0.1, (4, 50))
    sa, sb = paired_stats(a), paired_stats(b)
    assert sa["d_nll"] == pytest.approx(a.mean()) and sa["rel_dppl"] == pytest.approx(math.expm1(a.mean()))
    assert sa["se"] == pytest.approx(a.mean(axis=1).std(ddof=1) / 2)
    assert sa["se_token"] == pytest.approx(a.std(ddof=1) / math.sqrt(200))
    assert sa["rel_dppl_lo"] < sa["rel_dppl"] < sa["rel_dppl_hi"]
    ra = {"window_d_nll": list(a.mean(axis=1))}
    rb = {"window_d_nll": list(b.mean(axis=1))}
    p = pairwise(ra, rb)
    assert p["d_nll"] == pytest.approx((a - b).mean())
    assert p["se"] == pytest.approx(paired_stats(a - b)["se"])
