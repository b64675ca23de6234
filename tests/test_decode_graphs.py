"""Traced decode graphs (rq_core.models.base.decode_graph): a decode step through them computes exactly what the
layers compute op by op, for every family and cache kind, and the expert pager turns them off."""

from __future__ import annotations

import copy

import mlx.core as mx
import pytest

from _tiny_models import TINY, make_tiny
from rq_core.cache.kv_cache import KVSettings
from rq_core.checkpoint import load
from rq_core.models.base import set_decode_graphs

# Gemma 4 with the parts the plain tiny config leaves out: per-layer inputs and a KV-sharing layer
GEMMA_PLE = copy.deepcopy(TINY["gemma4"])
GEMMA_PLE["text_config"].update({"hidden_size_per_layer_input": 16, "vocab_size_per_layer_input": 320,
                                 "num_kv_shared_layers": 1, "num_hidden_layers": 4,
                                 "layer_types": ["sliding_attention", "full_attention", "sliding_attention",
                                                 "full_attention"]})
CASES = {"qwen3_moe": None, "qwen2_moe": None, "nemotron_h": None, "gemma4": None, "gemma4-ple-shared": GEMMA_PLE}


@pytest.fixture(scope="module", params=sorted(CASES))
def model(request, tmp_path_factory):
    name = request.param
    family = name.split("-")[0]
    ck = make_tiny(family, tmp_path_factory.mktemp(name.replace("-", "_")), seed=3, config=CASES[name],
                   dtype="float32")
    return load(ck, tokenizer=False).model


def _traced(model) -> int:
    return sum(len(m.__dict__.get("_decode_graphs") or {}) for m in model.modules())


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
