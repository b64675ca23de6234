"""A decode step's layer as one traced graph with its cache's attention inside (rq_core.models.base.decode_layer): a
compressed cache's bookkeeping around the graph (the window's spill, its buffers, the codes' growth), or a sliding
window's ring, gives the attention the layers compute op by op. On the CPU the fused kernel is stood in for by MLX ops
that read the launch's inputs as the kernel does (every length from `meta`, the window's rows from the whole buffers);
the kernel itself is checked against float64 by tests/test_kernel_window.py and, on a GPU, tools/gpu_check.py."""

from __future__ import annotations

import mlx.core as mx
import pytest

from _ref_launch import RefLaunch
from _tiny_models import FAMILY_CASES as CASES, make_tiny
from rq_core.attention import dispatch
from rq_core.cache.kv_cache import FP16Cache, IsoQuantCache, KVSettings
from rq_core.checkpoint import load
from rq_core.models.base import SlidingWindowCache, layers_as_written, set_decode_graphs

KV = KVSettings(mode="isoquant3", pair_points=(), fp16_window=4)


@pytest.fixture(params=sorted(CASES))
def model(request, tmp_path):
    family = request.param.split("-")[0]
    ck = make_tiny(family, tmp_path / "m", seed=5, config=CASES[request.param], dtype="float32")
    return load(ck, tokenizer=False).model


@pytest.fixture
def reference_launch(monkeypatch):
    monkeypatch.setattr(dispatch, "decode_launch", lambda store, qshape, qdtype, scale: RefLaunch(store))
    # small growth steps: the codes grow (a new shape, traced again) and the window's buffer is rebuilt many times
    monkeypatch.setattr(IsoQuantCache, "step", 16)
    monkeypatch.setattr(IsoQuantCache, "decode_room", (8, 8))
    RefLaunch.calls = 0


def _decode(model, steps: int = 45, kv: KVSettings = KV, prompt: int = 21, rollback: int = 0) -> tuple[list, list]:
    """Logits of `steps` decode steps after a prompt; with `rollback` every that many steps one step is run, rolled
    back (each cache's mark) and run again, as speculation does."""
    cache = model.make_cache(kv)
    model(mx.array([[(5 * i) % 300 + 3 for i in range(prompt)]]), cache=cache)
    for c in cache:
        c.end_prefill()
    out = []
    for t in range(steps):
        x = mx.array([[(11 * t) % 300 + 1]])
        if rollback and t % rollback == rollback - 1:
            undo = [c.mark() for c in cache]
            mx.eval(model(mx.array([[7]]), cache=cache))
            for u in undo:
                u()
        out.append(model(x, cache=cache))
        mx.eval(out[-1])
    return out, cache


def _layer_graphs(model, cache_type: type | None = None) -> int:
    """decode_layer graphs the model's layers hold (for caches of `cache_type`: any)."""
    return sum(1 for layer in model.layers for k in (layer.__dict__.get("_decode_graphs") or {})
               if isinstance(k, tuple) and k[0] == "decode_layer" and cache_type in (None, k[3]))


def test_traced_layers_give_the_attention_of_the_layers_op_by_op(model, reference_launch):
    set_decode_graphs(model, False)
    plain, plain_cache = _decode(model)
    assert RefLaunch.calls == 0
    set_decode_graphs(model, True)
    traced, cache = _decode(model)
    # every step after each layer's first went through its graph (the launch is called once per trace)
    assert _layer_graphs(model) > 0 and RefLaunch.calls > 0
    compressed = [c for c in cache if isinstance(c, IsoQuantCache)]
    assert compressed and all(c.attention_path == ("fused", None) for c in compressed)
    for i, (a, b) in enumerate(zip(plain, traced)):
        assert mx.allclose(a, b, atol=2e-4, rtol=1e-4), (i, float(mx.abs(a - b).max()))
    # the caches hold the same tokens in the same places (exactly in the first layer, whose K/V come from the
    # embeddings alone; later layers' within the attention's rounding)
    pairs = [(p, c) for p, c in zip(plain_cache, cache) if isinstance(c, IsoQuantCache)]
    for i, (p, c) in enumerate(pairs):
        assert (p.packed_len, p.fp16_len, p.offset) == (c.packed_len, c.fp16_len, c.offset)
        same = mx.array_equal if i == 0 else lambda a, b: mx.allclose(a, b, atol=1e-4)
        for a, b in zip(p.fp16_segment(), c.fp16_segment()):
            assert same(a, b)
        if i == 0:
            for a, b in ((p.k_codes, c.k_codes), (p.v_norms, c.v_norms)):
                assert mx.array_equal(a[:, :, : p.packed_len], b[:, :, : c.packed_len])


@pytest.mark.parametrize("window,prompt,rollback", [(1, 21, 0), (2, 21, 0), (8, 3, 0), (4, 21, 5)])
def test_windows_short_prompts_and_rolled_back_steps(model, reference_launch, window, prompt, rollback):
    """A window of one token (never traced), of two, a prompt shorter than the window (nothing packed at first), and
    steps rolled back: the traced steps give the layers' attention op by op."""
    import dataclasses

    kv = dataclasses.replace(KV, fp16_window=window)
    set_decode_graphs(model, False)
    plain, _ = _decode(model, 30, kv, prompt, rollback)
    set_decode_graphs(model, True)
    traced, cache = _decode(model, 30, kv, prompt, rollback)
    assert (_layer_graphs(model, IsoQuantCache) > 0) == (window > 1)
    for i, (a, b) in enumerate(zip(plain, traced)):
        assert mx.allclose(a, b, atol=2e-4, rtol=1e-4), (i, float(mx.abs(a - b).max()))


def test_one_model_two_kv_settings(model, reference_launch):
    """Caches of other codebooks, widths and rotations on one model (each layer keeps a graph for each launch plan)."""
    own_keys = KVSettings(mode="isoquant3", key_bits=4, pair_points=(), fp16_window=4)  # the keys' own codebook
    for kv in (KV, KVSettings(mode="turbo3", fp16_window=4, bits=4), own_keys):
        set_decode_graphs(model, False)
        plain, _ = _decode(model, 12, kv)
        set_decode_graphs(model, True)
        traced, _ = _decode(model, 12, kv)
        for a, b in zip(plain, traced):
            assert mx.allclose(a, b, atol=2e-4, rtol=1e-4), float(mx.abs(a - b).max())


def test_a_paged_layer_or_a_resumed_step_runs_as_written(model, reference_launch):
    from rq_core.models.base import StepResume, SwitchGLU, resuming

    set_decode_graphs(model, True)
    switches = [m for m in model.modules() if isinstance(m, SwitchGLU)]
    class Marked:  # as an expert pager marks the banks it serves (not stepping: the experts run as written)
        def serves_a_token(self) -> bool:
            return False

        def stepping(self) -> bool:
            return False

    for s in switches:
        s.__dict__["pager_layer"] = Marked()
    try:
        _decode(model, 5)
    finally:
        for s in switches:
            del s.__dict__["pager_layer"]
    moe_layers = sum(any(isinstance(m, SwitchGLU) for m in layer.modules()) for layer in model.layers)
    traced_layers = sum(1 for layer in model.layers if any(
        isinstance(k, tuple) and k[0] == "decode_layer" for k in (layer.__dict__.get("_decode_graphs") or {})))
    assert traced_layers <= len(model.layers) - moe_layers  # only layers no pager serves
    with resuming(StepResume()):
        cache = model.make_cache(KV)
        mx.eval(model(mx.array([[3, 4, 5, 6, 7, 8]]), cache=cache))
        for c in cache:
            c.end_prefill()
        calls = RefLaunch.calls
        for t in (9, 10, 11):
            mx.eval(model(mx.array([[t]]), cache=cache))
        assert RefLaunch.calls == calls  # a step that may run again from a layer is built layer by layer


def test_one_graph_a_layer_serves_the_next_cache(model, reference_launch):
    set_decode_graphs(model, True)
    _decode(model, steps=6)

    def layer_graphs():
        return {(i, k): id(f) for i, layer in enumerate(model.layers)
                for k, f in layer.__dict__["_decode_graphs"].items() if k[0] == "decode_layer"}

    kept = layer_graphs()
    assert kept
    _decode(model, steps=6)
    assert layer_graphs() == kept


def test_layers_run_as_written_with_graphs_off_or_hooked(model, reference_launch):
    set_decode_graphs(model, True)
    with layers_as_written(model):
        _decode(model, steps=5)
    assert RefLaunch.calls == 0 and _layer_graphs(model) == 0
    cache = model.make_cache(KVSettings(mode="fp16"))
    for t in ([[3, 4, 5]], [[6]], [[7]], [[8]]):
        mx.eval(model(mx.array(t), cache=cache))
    assert _layer_graphs(model, FP16Cache) == 0  # a growing fp16 cache's attention is not traced


def test_packed_buffers_keep_room_where_decode_steps_are_traced(monkeypatch):
    import rq_core.kernels.launch as K
    from rq_core.paging.planner import cache_tokens

    assert IsoQuantCache.packed_rows(2000) == 2048  # no GPU kernels: no traced steps, no room
    monkeypatch.setattr(K, "available", lambda: True)
    assert IsoQuantCache.packed_rows(2000) == 3072  # at least 1,024 more
    assert IsoQuantCache.packed_rows(40000) == 45056  # an eighth more
    assert IsoQuantCache.packed_rows(200000) == 208384  # at most 8,192 more
    assert IsoQuantCache.packed_rows(2000, decoding=False) == 2048  # a prompt's buffers: as it needs
    assert cache_tokens(40000, "isoquant3") == 45056 and cache_tokens(40000, "fp16") == 40192  # the plan counts it


def test_a_launch_is_traced_only_for_the_queries_it_was_made_for(model, reference_launch):
    """The launch holds the shape, dtype and scale of its cache's last decode step as written: a graph traced with
    other queries is refused, not run with the wrong scale."""
    set_decode_graphs(model, True)
    _, cache = _decode(model, steps=3)
    c = next(c for c in cache if isinstance(c, IsoQuantCache))
    shape, dtype, scale = c.decode_query
    c.decode_query = (shape, dtype, scale * 2)
    with pytest.raises(ValueError, match="traced for a plan made for"):
        model(mx.array([[9]]), cache=cache)


@pytest.mark.parametrize("prompt,rollback", [(3, 0), (21, 0), (5, 4)])
def test_sliding_window_rings_are_traced_filling_and_full(model, prompt, rollback):
    """fp16 rings of sliding-window layers (Gemma 4's) or of --max-kv-size: a decode step's layer is one graph, masked
    while the ring fills (a prompt shorter than the window) and unmasked once it is full, with rolled-back steps; the
    logits are the layers' op by op."""
    kv = KVSettings(mode="fp16", max_kv_size=8)
    set_decode_graphs(model, False)
    plain, _ = _decode(model, 20, kv, prompt, rollback)
    set_decode_graphs(model, True)
    traced, cache = _decode(model, 20, kv, prompt, rollback)
    rings = [c for c in cache if isinstance(c, SlidingWindowCache)]
    assert rings and all(c.valid == c.window for c in rings)
    plans = {k[1] for layer in model.layers for k in (layer.__dict__.get("_decode_graphs") or {})
             if isinstance(k, tuple) and k[0] == "decode_layer"}
    assert plans == ({"filling", "full"} if prompt < 7 else {"full"})
    for i, (a, b) in enumerate(zip(plain, traced)):
        assert mx.allclose(a, b, atol=2e-4, rtol=1e-4), (i, float(mx.abs(a - b).max()))


def test_a_ring_takes_trims_and_a_new_dtype(model):
    """Rings rolled back by trim (filling again with every slot live) and a model cast to another dtype after traced
    steps (a ring's graph holds no plan made for the queries: traced again, not refused) keep the layers' logits."""
    from mlx.utils import tree_map

    kv = KVSettings(mode="fp16", max_kv_size=8)
    weights = tree_map(lambda a: a, model.parameters())

    def run() -> list:
        model.update(weights)
        cache = model.make_cache(kv)
        model(mx.array([[(5 * i) % 300 + 3 for i in range(12)]]), cache=cache)
        out = []
        for t in range(14):
            if t == 6:
                for c in cache:
                    c.trim(1)
            out.append(model(mx.array([[(11 * t) % 300 + 1]]), cache=cache))
            mx.eval(out[-1])
            if t == 9:  # the weights' dtype changes mid-decode; graphs are dropped with it
                model.set_dtype(mx.bfloat16)
                set_decode_graphs(model, model.__dict__.get("_decode_graphs") is not False)
        return out

    set_decode_graphs(model, False)
    plain = run()
    set_decode_graphs(model, True)
    traced = run()
    assert _layer_graphs(model) > 0
    for i, (a, b) in enumerate(zip(plain, traced)):
        # measured 0.0 at every step; from step 10 on bf16, where a fused chain may round once less (0.05: ~6 ulps)
        tol = 2e-4 if i < 10 else 0.05
        assert mx.allclose(a.astype(mx.float32), b.astype(mx.float32), atol=tol, rtol=tol), \
            (i, float(mx.abs(a - b).max()))
