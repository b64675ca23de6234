"""rq_core.attention.dispatch: which path a compressed cache's attention takes, from the shapes and the settings read once
(rq_core.kernels.config); the reference path never calls a GPU kernel; caches list their arrays in `state`."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from kernel_emu import configure

import rq_core.kernels.launch as K
from rq_core.kernels import config as env
from rq_core.errors import RQError
from rq_core.cache.kv_cache import FP16Cache, IsoQuantCache

B, HKV, G, D = 1, 2, 4, 128
SCALE = D ** -0.5


def _rand(shape, seed):
    return mx.array(np.random.default_rng(seed).standard_normal(shape).astype(np.float16))


def _cache(window: int = 4, prompt: int = 40) -> IsoQuantCache:
    c = IsoQuantCache(head_dim=D, n_kv_heads=HKV, layer=1, fp16_window=window, pair_points=(128, 32))
    c.attend(_rand((B, HKV * G, prompt, D), 1), _rand((B, HKV, prompt, D), 2), _rand((B, HKV, prompt, D), 3),
             scale=SCALE, mask="causal")
    c.end_prefill()
    return c


def _step(c: IsoQuantCache, seed: int, L: int = 1, mask=None) -> mx.array:
    return c.attend(_rand((B, HKV * G, L, D), seed), _rand((B, HKV, L, D), seed + 1), _rand((B, HKV, L, D), seed + 2),
                    scale=SCALE, mask=mask)


@pytest.fixture
def gpu(monkeypatch):
    """A 'GPU' whose fused kernel is a recording stub (returns 7s); every other kernel fails the test if called."""
    calls = []

    def fused(q, mats, *a, window=None, **kw):
        calls.append(dict(window=window, **kw))
        return mx.full(q.shape, 7.0, q.dtype), None

    def never(*a, **k):
        raise AssertionError("a pipeline kernel was called")

    configure(monkeypatch, attention="fused", append="ops")
    monkeypatch.setattr(K, "available", lambda: True)
    monkeypatch.setattr(K, "fused_attention", fused)
    for name in ("qk_dot", "softmax", "value_accum", "decode_rows", "kv_append_codes"):
        monkeypatch.setattr(K, name, never)
    return calls


def test_settings_read_once_from_the_environment():
    cfg = env.KernelConfig.from_env({})
    assert cfg == env.KernelConfig() and cfg.attention == "fused" and cfg.kernels and not cfg.poison
    cfg = env.KernelConfig.from_env({"RQ_ATTN": "reference", "RQ_KERNELS": "0", "RQ_KERNEL_POISON": "1",
                                     "RQ_KERNEL_MINIFY": "0", "RQ_KERNEL_CACHE": "0", "RQ_APPEND": "ops"})
    assert (cfg.attention, cfg.kernels, cfg.poison, cfg.minify, cfg.disk_cache, cfg.append) == \
        ("reference", False, True, False, False, "ops")
    with pytest.raises(RQError, match="RQ_ATTN='v5' is not an attention path"):
        env.KernelConfig.from_env({"RQ_ATTN": "v5"})
    with pytest.raises(RQError, match="RQ_KERNELS='yes' must be 0 or 1"):
        env.KernelConfig.from_env({"RQ_KERNELS": "yes"})
    with pytest.raises(AttributeError):
        cfg.attention = "four"  # frozen
    before = env.config()
    with env.override(attention="four") as inside:
        assert env.config() is inside and inside.attention == "four"
    assert env.config() is before


def test_decode_step_takes_the_fused_kernel_with_the_window(gpu):
    c = _cache()
    out = _step(c, 10)
    assert float(out[0, 0, 0, 0]) == 7.0 and len(gpu) == 1
    call = gpu[0]
    # the segment goes as the whole buffers and its rows (no view a step): those rows are the segment's tokens
    wk, wv, first, rows = call["window"]
    assert rows == c.fp16_len == 4
    sk, sv = c.fp16_segment()
    assert mx.array_equal(wk[:, :, first:first + rows], sk) and mx.array_equal(wv[:, :, first:first + rows], sv)
    assert call["launches"] is c.fused_launches
    assert call["valid_len"] == c.packed_len and call["key_bits"] == 7 and call["key_levels"] is c.k_levels


def test_declined_shapes_masks_and_reference_setting_take_the_reference_path(gpu, monkeypatch):
    ref_cache, c = _cache(), _cache()
    with env.override(attention="reference"):
        want = _step(ref_cache, 20)
    # the kernel declines: the reference path, the same numbers as without kernels
    monkeypatch.setattr(K, "fused_attention", lambda *a, **k: (_ for _ in ()).throw(K.KernelUnsupported("stub")))
    np.testing.assert_array_equal(np.array(_step(c, 20)), np.array(want))
    # an array mask, or RQ_ATTN=reference: never the kernel
    monkeypatch.setattr(K, "fused_attention", lambda *a, **k: pytest.fail("fused kernel called"))
    _step(c, 30, mask=mx.ones((1, c.offset + 1), mx.bool_))
    configure(monkeypatch, attention="reference")
    _step(c, 40)


def test_each_cache_records_its_path_and_a_gpu_fallback_is_named_once(gpu, monkeypatch, capsys):
    from rq_core.attention import dispatch

    monkeypatch.setattr(dispatch, "_WARNED", set())
    fused, declined, masked = _cache(), _cache(), _cache()
    _step(fused, 10)
    assert fused.attention_path == ("fused", None) and capsys.readouterr().err == ""
    monkeypatch.setattr(K, "fused_attention", lambda *a, **k: (_ for _ in ()).throw(K.KernelUnsupported("no R=4")))
    for seed in (20, 30):  # a second step of the same shape prints nothing more
        _step(declined, seed)
    err = capsys.readouterr().err.splitlines()
    assert declined.attention_path == ("reference", "no R=4") and len(err) == 1
    assert "head_dim 128, 8 query / 2 kv heads" in err[0] and "pair codebooks 128/32" in err[0] and "no R=4" in err[0]
    _step(masked, 40, mask=mx.ones((1, masked.offset + 1), mx.bool_))
    assert masked.attention_path == ("reference", "an array mask") and "an array mask" in capsys.readouterr().err
    paths = dispatch.attention_paths([fused, declined, masked, object()])
    assert paths == {"fused": 1, "reference": 2} and dispatch.format_paths(paths) == "fused 1, reference 2"
    # chosen fallbacks (RQ_ATTN) are recorded but not reported; nor is anything off the GPU
    configure(monkeypatch, attention="reference")
    _step(fused, 50)
    monkeypatch.setattr(K, "available", lambda: False)
    configure(monkeypatch, attention="fused")
    _step(masked, 60)
    assert fused.attention_path == ("reference", "RQ_ATTN=reference") and capsys.readouterr().err == ""
    assert masked.attention_path == ("reference", "no GPU kernels here")
    c = IsoQuantCache(head_dim=D, n_kv_heads=HKV, layer=1, fp16_window=4)
    _step(c, 70)  # nothing packed yet: SDPA over the fp16 segment
    assert dispatch.attention_paths([c]) == {"sdpa": 1}


def test_prompt_chunks_never_take_the_fused_kernel(gpu):
    c = IsoQuantCache(head_dim=D, n_kv_heads=HKV, layer=1, fp16_window=4, prefill_fp16=16)
    for i in range(3):  # chunks of 4 rows (<= PREFILL_DECODE_ROWS) over compressed older tokens: the segments path
        _step(c, 50 + 3 * i, L=16 if i == 0 else 4, mask="causal")
    assert c.packed_len > 0 and gpu == []


def test_reference_path_is_mlx_ops_only(monkeypatch):
    """With RQ_ATTN=reference on a 'GPU', no custom kernel is built or launched, whatever the cache holds."""
    monkeypatch.setattr(K, "available", lambda: True)
    monkeypatch.setattr(K, "backend", lambda: "cuda")
    monkeypatch.setattr(K, "_kernel", lambda *a: pytest.fail("a kernel was built"))
    monkeypatch.setattr(K, "_fused_kernel", lambda *a, **k: pytest.fail("a kernel was built"))
    configure(monkeypatch, attention="reference", append="ops")
    c = _cache()
    for i in range(3):
        assert np.isfinite(np.array(_step(c, 60 + 3 * i).astype(mx.float32))).all()
    c = IsoQuantCache(head_dim=D, n_kv_heads=HKV, layer=1, fp16_window=4, prefill_fp16=16)
    _step(c, 80, L=16, mask="causal")
    _step(c, 90, L=12, mask="causal")  # a prompt chunk over compressed tokens: the decoded path, MLX decode
    assert c.packed_len > 0


def test_state_lists_the_arrays_a_cache_holds():
    from rq_core.generate import cache_arrays

    f = FP16Cache()
    assert f.state == []
    f.attend(_rand((B, HKV * G, 3, D), 1), _rand((B, HKV, 3, D), 2), _rand((B, HKV, 3, D), 3), scale=SCALE)
    assert f.state[0] is f.keys and f.state[1] is f.values
    c = _cache()
    held = [c.k_codes, c.k_norms, c.v_codes, c.v_norms, c._fk, c._fv]
    assert len(c.state) == 6 and all(a is b for a, b in zip(c.state, held))
    assert len(cache_arrays([f, c])) == 8
