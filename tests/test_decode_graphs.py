"""Traced decode graphs (rq_core.models.base.decode_graph): a decode step through them computes exactly what the
layers compute op by op, for every family and cache kind (with the expert pager: tests/test_pager.py)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from _tiny_models import FAMILY_CASES as CASES, make_tiny
from rq_core.cache.kv_cache import KVSettings
from rq_core.checkpoint import load
from rq_core.models.base import set_decode_graphs


@pytest.fixture(scope="module", params=sorted(CASES))
def model(request, tmp_path_factory):
    name = request.param
    family = name.split("-")[0]
    ck = make_tiny(family, tmp_path_factory.mktemp(name.replace("-", "_")), seed=3, config=CASES[name],
                   dtype="float32")
    return load(ck, tokenizer=False).model


def _traced(model) -> int:
    # graphs traced (a method seen once, run as written, has None)
    return sum(sum(f is not None for f in (m.__dict__.get("_decode_graphs") or {}).values()) for m in model.modules())


def _decode_logits(model, kv: KVSettings, graphs: bool) -> list[mx.array]:
    set_decode_graphs(model, graphs)
    cache = model.make_cache(kv)
    model(mx.array([[(7 * i) % 300 + 3 for i in range(19)]]), cache=cache)  # a prompt past Gemma's window of 8
    for c in cache:
        c.end_prefill()
    out = []
    for t in (5, 11, 17, 23, 29, 31, 37, 41, 43, 47):
        out.append(model(mx.array([[t]]), cache=cache))
        mx.eval(out[-1])
    return out


@pytest.mark.parametrize("mode", ["fp16", "isoquant3"])
def test_traced_decode_equals_the_layers_op_by_op(model, mode):
    kv = KVSettings(mode=mode)
    plain = _decode_logits(model, kv, graphs=False)
    assert _traced(model) == 0
    traced = _decode_logits(model, kv, graphs=True)
    assert _traced(model) > 0  # the steps did go through traced graphs
    for a, b in zip(plain, traced):
        assert mx.array_equal(a, b), float(mx.abs(a - b).max())


def test_a_prompt_runs_the_layers_as_written(model):
    set_decode_graphs(model, True)
    model(mx.array([[3, 4, 5, 6]]), cache=model.make_cache(KVSettings(mode="fp16")))
    assert _traced(model) == 0


def test_the_first_one_token_call_runs_as_written(model):
    set_decode_graphs(model, True)
    cache = model.make_cache(KVSettings(mode="fp16"))
    model(mx.array([[3]]), cache=cache)  # a one-token prompt: seen, not traced
    assert _traced(model) == 0
    model(mx.array([[4]]), cache=cache)
    assert _traced(model) > 0


def test_a_dropped_model_frees_its_weights_without_the_cycle_collector(tmp_path):
    import gc

    ck = make_tiny("qwen3_moe", tmp_path / "m", seed=1, dtype="float32")
    gc.collect()
    base = mx.get_active_memory()
    gc.disable()
    try:
        m = load(ck, tokenizer=False).model
        cache = m.make_cache(KVSettings(mode="fp16"))
        for t in ([[1, 2, 3]], [[4]], [[5]]):
            mx.eval(m(mx.array(t), cache=cache))
        assert _traced(m) > 0
        held = mx.get_active_memory() - base
        del m, cache
        assert mx.get_active_memory() - base < held / 10  # the graphs hold their module weakly
    finally:
        gc.enable()
