"""Model families against transformers' golden outputs (tests/make_golden.py), and checkpoint loading.

Every family with a tests/golden/<family>/golden.json is tested: float32 logits on the 32-token prompt
within 1e-4 (max abs diff / max abs logit), greedy 16 tokens exact, IsoQuant-3 agreement, KV bytes.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest

from rq_core.checkpoint import build_model, context_length, load, load_weights
from rq_core.errors import RQError
from rq_core.generate import generate
from rq_core.cache.kv_cache import FP16Cache, KVSettings
from rq_core.models import MODEL_TYPES, base

GOLDEN = Path(__file__).parent / "golden"
FAMILIES = sorted(p.parent.name for p in GOLDEN.glob("*/golden.json"))

# IsoQuant-3 vs fp16 top-1 agreement, teacher-forced: prefill 8 prompt tokens (compressed at end_prefill), then
# decode the rest of the prompt and 64 fp16-greedy tokens one at a time through the compressed cache (88 positions)
# and compare each argmax with the fp16 model's. Measured on the CPU (deterministic; `pytest -s` prints each):
# positions that agree, of 88. The bound allows 2 positions fewer (these tiny random models have small logit
# margins, so a codebook or rotation change of the last float bits can flip one or two argmaxes).
ISO_AGREEMENT_COUNT = {"gemma4": 80, "gemma4_text": 72, "nemotron_h": 74, "qwen2_moe": 72, "qwen3_moe": 64}
ISO_AGREEMENT_SLACK = 2
CONTINUATION = 64
# Our float32 forward against transformers' float32 logits, max |diff| / max |ref|: worst measured 3.46e-6 (gemma4;
# 5.0e-7 to 1.4e-6 for the others, this file's tests); the bound is 3x that, room for another BLAS summation order.
F32_REL = 1e-5


def _golden(family: str) -> tuple[dict, np.ndarray]:
    g = json.loads((GOLDEN / family / "golden.json").read_text())
    logits = np.array(mx.load(str(GOLDEN / family / "golden.safetensors"))["logits"])
    return g, logits


_CACHE: dict[str, object] = {}


def _ckpt(family: str):
    if family not in _CACHE:
        _CACHE[family] = load(GOLDEN / family / "model")
    return _CACHE[family]


def _rel(a: np.ndarray, ref: np.ndarray) -> float:
    return float(np.abs(a - ref).max() / np.abs(ref).max())


def test_goldens_exist() -> None:
    assert {"qwen3_moe", "qwen2_moe"} <= set(FAMILIES)


@pytest.mark.parametrize("family", FAMILIES)
def test_logits_match_transformers(family: str) -> None:
    g, ref = _golden(family)
    model = _ckpt(family).model
    out = np.array(model(mx.array([g["prompt_ids"]]))[0].astype(mx.float32))
    assert out.shape == ref.shape
    assert _rel(out, ref) < F32_REL
    # The same through fp16 caches, prompt fed in chunks of 5 (exercises cache offsets and windows).
    cache = model.make_cache(KVSettings())
    ids = g["prompt_ids"]
    chunks = [np.array(model(mx.array([ids[i:i + 5]]), cache=cache)[0].astype(mx.float32))
              for i in range(0, len(ids), 5)]
    assert _rel(np.concatenate(chunks), ref) < F32_REL


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_matches_transformers(family: str) -> None:
    g, _ = _golden(family)
    res = generate(_ckpt(family).model, g["prompt_ids"], max_tokens=len(g["greedy"]), temp=0.0,
                   kv=KVSettings(mode="fp16"), prefill_chunk=7)
    assert res.tokens == g["greedy"]
    assert res.prompt_tokens == len(g["prompt_ids"]) and res.generated_tokens == len(g["greedy"])


def _teacher_forced_agreement(model, ids: list[int], target: list[int], kv: KVSettings, n0: int = 8) -> float:
    cache = model.make_cache(kv)
    logits = model(mx.array([ids[:n0]]), cache=cache)[0, -1]
    for c in cache:
        c.end_prefill()
    preds = [int(mx.argmax(logits))]
    for t in ids[n0:-1]:
        preds.append(int(mx.argmax(model(mx.array([[t]]), cache=cache)[0, -1])))
    want = target[n0 - 1:]
    assert len(preds) == len(want)
    return float(np.mean([p == w for p, w in zip(preds, want)]))


def _compressed_layers(model, kv: KVSettings) -> list[int]:
    """Layers whose cache differs from the fp16 run's: the ones the KV mode compresses."""
    fp16 = model.make_cache(KVSettings())
    comp = model.make_cache(kv)
    return [i for i, (a, b) in enumerate(zip(fp16, comp)) if type(a) is not type(b)]


@pytest.mark.parametrize("family", FAMILIES)
def test_isoquant_agreement_and_bytes(family: str) -> None:
    g, _ = _golden(family)
    ckpt = _ckpt(family)
    model = ckpt.model
    kv = KVSettings(mode="isoquant3")
    ctx = context_length(ckpt.config) or 10**9
    n_cont = max(len(g["greedy"]), min(CONTINUATION, ctx - len(g["prompt_ids"]) - 1))
    cont = generate(model, g["prompt_ids"], max_tokens=n_cont, kv=KVSettings()).tokens
    assert cont[:len(g["greedy"])] == g["greedy"]  # the fp16 reference is transformers' (test above)
    ids = g["prompt_ids"] + cont
    target = [int(t) for t in np.array(model(mx.array([ids]))[0]).argmax(-1)]
    assert _teacher_forced_agreement(model, ids, target[:-1], KVSettings(mode="fp16")) == 1.0
    agree = _teacher_forced_agreement(model, ids, target[:-1], kv)
    print(f"{family}: isoquant3 teacher-forced top-1 agreement with fp16 = {agree:.3f} over {len(ids) - 8} positions")
    n = len(ids) - 8
    assert n == 88
    # < 1: a cache that compressed nothing would score 1.0
    assert (ISO_AGREEMENT_COUNT[family] - ISO_AGREEMENT_SLACK) / n <= agree < 1.0, (family, agree * n)

    # Bytes: every compressed layer holds 256 / 50 = 5.12x fewer bytes than fp16 would for the same tokens (head dim
    # 128: 48 bytes of 3-bit codes + a 2-byte norm per vector against 256; measured 5.12 in every family).
    layers = _compressed_layers(model, kv)
    assert layers, "isoquant3 compresses no layer"
    cache = model.make_cache(kv)
    res = generate(model, g["prompt_ids"], max_tokens=len(g["greedy"]), kv=kv, cache=cache)
    assert res.generated_tokens == len(g["greedy"])
    for i in layers:
        assert cache[i].offset == len(g["prompt_ids"]) + len(g["greedy"]) - 1
        assert cache[i].fp16_nbytes * 50 == cache[i].nbytes * 256 > 0, (i, cache[i].nbytes, cache[i].fp16_nbytes)
    assert res.kv_bytes == sum(c.nbytes for c in cache) and res.kv_bytes_fp16 == sum(c.fp16_nbytes for c in cache)
    free = np.mean([a == b for a, b in zip(res.tokens, g["greedy"])])
    print(f"{family}: isoquant3 free-running greedy agreement = {free:.3f}")


# ---------------------------------------------------------------------------------- loading variants
QWEN = [f for f in ("qwen3_moe", "qwen2_moe") if f in FAMILIES]


def _fuse_like_transformers5(weights: dict, num_experts: int) -> dict:
    """Per-expert hub names → transformers 5's fused `experts.gate_up_proj` / `experts.down_proj`."""
    out = dict(weights)
    prefixes = {k.split(".experts.")[0] for k in weights if ".experts.0.gate_proj.weight" in k}
    for p in prefixes:
        gate = [out.pop(f"{p}.experts.{e}.gate_proj.weight") for e in range(num_experts)]
        up = [out.pop(f"{p}.experts.{e}.up_proj.weight") for e in range(num_experts)]
        down = [out.pop(f"{p}.experts.{e}.down_proj.weight") for e in range(num_experts)]
        out[f"{p}.experts.gate_up_proj"] = mx.concatenate([mx.stack(gate), mx.stack(up)], axis=1)
        out[f"{p}.experts.down_proj"] = mx.stack(down)
    assert prefixes
    return out


@pytest.mark.parametrize("family", QWEN)
def test_sanitize_fused_and_stacked_layouts(family: str) -> None:
    g, ref = _golden(family)
    path = GOLDEN / family / "model"
    config = json.loads((path / "config.json").read_text())
    weights = load_weights(path)
    n_exp = config.get("num_experts") or config["num_local_experts"]
    x = mx.array([g["prompt_ids"]])
    fused = build_model(config, _fuse_like_transformers5(weights, n_exp))
    assert _rel(np.array(fused(x)[0]), ref) < F32_REL
    # mlx-lm / rq layout (already stacked under switch_mlp) passes through unchanged.
    from mlx.utils import tree_flatten

    stacked = dict(tree_flatten(fused.parameters()))
    assert any(".switch_mlp.gate_proj.weight" in k for k in stacked)
    again = build_model(config, stacked)
    assert _rel(np.array(again(x)[0]), ref) < F32_REL


QUANT_REL = {"qwen3_moe": 0.298331, "qwen2_moe": 0.465619}


@pytest.mark.parametrize("family", QWEN)
def test_quantized_checkpoint_loads(family: str, tmp_path: Path) -> None:
    """An mlx-lm style quantized checkpoint (per-path `quantization` entries) loads and computes the same."""
    g, ref = _golden(family)
    src = GOLDEN / family / "model"
    model = load(src, tokenizer=False).model
    gs = 32

    def pred(p: str, m: nn.Module):
        if not hasattr(m, "to_quantized"):
            return False
        w = m.weight
        if w.shape[-1] % gs:  # inner dim must be a multiple of the group size
            return False
        if p.endswith("mlp.gate"):
            return {"group_size": gs, "bits": 8}  # routers at 8 bits, as recipes do
        return True

    nn.quantize(model, group_size=gs, bits=4, class_predicate=pred)
    from mlx.utils import tree_flatten

    weights = dict(tree_flatten(model.parameters()))
    qcfg: dict = {"group_size": gs, "bits": 4}
    for name, m in model.named_modules():
        if hasattr(m, "to_quantized") and not hasattr(m, "scales") and hasattr(m, "weight"):
            qcfg[name] = False
        elif name.endswith("mlp.gate") and hasattr(m, "scales"):
            qcfg[name] = {"group_size": gs, "bits": 8}
    out = tmp_path / "q"
    shutil.copytree(src, out)
    (out / "model.safetensors").unlink()
    mx.save_safetensors(str(out / "model.safetensors"), weights)
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization"] = qcfg
    (out / "config.json").write_text(json.dumps(cfg))

    loaded = load(out).model
    assert any(type(m).__name__ == "QuantizedSwitchLinear" for _, m in loaded.named_modules())
    x = mx.array([g["prompt_ids"]])
    want = np.array(model(x)[0])
    got = np.array(loaded(x)[0])
    assert _rel(got, want) == 0.0  # the same weights through the same ops: measured bit-identical
    # 4-bit weights (8-bit routers) of the tiny golden model against its float logits: deterministic, so pinned to
    # what was measured (`pytest -s` on this test with a print of _rel), to 1e-4 relative: F32_REL's summation-order
    # room (1e-5 of the largest logit) moves this ratio by at most ~3e-5 of itself.
    assert _rel(got, ref) == pytest.approx(QUANT_REL[family], rel=1e-4)


# --------------------------------------------------------------------------------------- primitives
def test_registry_names_supported_types() -> None:
    assert {"qwen3_moe", "qwen2_moe", "nemotron_h", "gemma4"} <= set(MODEL_TYPES)
    with pytest.raises(RQError, match="supported: .*qwen3_moe"):
        MODEL_TYPES["llama"]


def test_rope_params_spellings() -> None:
    assert base.rope_params({"rope_theta": 5e5}) == (5e5, None)
    assert base.rope_params({"rope_parameters": {"rope_type": "default", "rope_theta": 1e6}}) == (1e6, None)
    # a default rope that rotates half of each head keeps its factor (dropped, every dim would rotate)
    half = {"rope_parameters": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}
    theta, sc = base.rope_params(half)
    assert theta == 1e4 and sc["partial_rotary_factor"] == 0.5
    assert base.make_rope(16, theta, sc).dims == 8
    theta, sc = base.rope_params({"rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 2.0}})
    assert theta == 1e4 and sc["factor"] == 2.0
    per_type = {"rope_parameters": {"sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
                                    "full_attention": {"rope_type": "proportional", "rope_theta": 1e6,
                                                       "partial_rotary_factor": 0.25}}}
    assert base.rope_params(per_type, "sliding_attention") == (1e4, None)
    theta, sc = base.rope_params(per_type, "full_attention")
    assert theta == 1e6 and sc["rope_type"] == "proportional"
    # proportional: a quarter of the dims rotate (pairs (j, j + 8) for j < 2 in rotate-half layout).
    rope = base.make_rope(16, theta, sc)
    x = mx.random.normal((1, 1, 3, 16))
    y, xn = np.array(rope(x, offset=5)), np.array(x)
    moved = [0, 1, 8, 9]
    still = [i for i in range(16) if i not in moved]
    assert np.allclose(y[..., still], xn[..., still])
    assert not np.allclose(y[..., moved], xn[..., moved])
    # linear scaling = positions divided by the factor.
    lin = base.make_rope(16, 1e4, {"rope_type": "linear", "factor": 2.0})
    plain = base.make_rope(16, 1e4, None)
    # measured 0.0 (the same angles); 1e-6 is 4 float32 ulps at the largest |value|, 2.0
    assert np.allclose(np.array(lin(x, offset=4)[..., 2:3, :]), np.array(plain(x, offset=1)[..., 2:3, :]), atol=1e-6)


def test_switch_glu_matches_per_expert_loop() -> None:
    mx.random.seed(0)
    sg = base.SwitchGLU(32, 16, 4)
    x = mx.random.normal((2, 40, 32))  # 160 (token, k) pairs: takes the sorted path
    inds = mx.random.randint(0, 4, (2, 40, 2))
    y = np.array(sg(x, inds))
    for b, t, j in [(0, 0, 0), (1, 39, 1), (0, 17, 1)]:
        e = int(inds[b, t, j])
        xv = x[b, t]
        h = nn.silu(sg.gate_proj.weight[e] @ xv) * (sg.up_proj.weight[e] @ xv)
        # measured 0.0 against the loop (values up to 0.16); 1e-7 is ~8 float32 ulps there
        assert np.allclose(y[b, t, j], np.array(sg.down_proj.weight[e] @ h), rtol=0, atol=1e-7)
    y_small = np.array(sg(x[:, :3], inds[:, :3]))  # unsorted path
    assert np.allclose(y_small, y[:, :3], rtol=0, atol=2e-7)  # measured 0.0 (values up to 0.33)


def test_switch_glu_half_precision_on_any_device() -> None:
    # MLX's CPU gather_mm is float32-only at these sizes; bf16 checkpoints must still run (CI is CPU).
    mx.random.seed(2)
    sg = base.SwitchGLU(1024, 64, 8)
    x = mx.random.normal((1, 3, 1024))
    for inds in (mx.array([[[0, 5], [7, 7], [2, 3]]]), mx.random.randint(0, 8, (1, 3, 4))):
        want = np.array(sg(x, inds))
        half = base.SwitchGLU(1024, 64, 8)
        half.update(sg.parameters())
        half.set_dtype(mx.bfloat16)
        got = half(x.astype(mx.bfloat16), inds)
        assert got.dtype == mx.bfloat16
        # bf16 (8-bit mantissa, eps 2^-8 = 0.0039): measured 0.0047 and 0.0043 of max |want|; 2x the larger
        assert np.abs(np.array(got.astype(mx.float32)) - want).max() < 0.01 * np.abs(want).max()


def test_switch_glu_dense_prompt_matches_the_quantized_banks(monkeypatch) -> None:
    """A prompt's token copies through the banks dequantized whole and one gather_mm (a GPU's prompt path) compute what
    gather_qmm on the codes computes; only where SwitchGLU.dense_prompt says so (enough rows, no pager, a GPU)."""
    mx.random.seed(3)
    sg = base.SwitchGLU(128, 64, 8)
    nn.quantize(sg, group_size=32, bits=2, class_predicate=lambda _, m: isinstance(m, base.SwitchLinear))
    x = mx.random.normal((1, 40, 128))
    inds = mx.random.randint(0, 8, (1, 40, 2))
    want = np.array(sg(x, inds))
    monkeypatch.setattr(base, "DENSE_PROMPT_ROWS", 64)
    assert not sg.dense_prompt(80)  # the CPU: no dense path
    monkeypatch.setattr(base.mx, "default_device", lambda: mx.gpu)
    assert not sg.dense_prompt(80)  # a GPU other than NVIDIA's: gather_qmm
    monkeypatch.setattr(base.mx.cuda, "is_available", lambda: True)
    assert sg.dense_prompt(80) and not sg.dense_prompt(63)
    # what `rq run --plan` without a budget adds to the plan: the largest bank (all three alike here)
    assert base.dense_prompt_bank_bytes(sg, 80) == sg.up_proj.dense_bytes and base.dense_prompt_bank_bytes(sg, 63) == 0
    sg.__dict__["pager_layer"] = object()
    assert not sg.dense_prompt(80)  # a pager's slot banks: not planned with that room
    del sg.__dict__["pager_layer"]
    monkeypatch.setattr(base, "DENSE_PROMPT_BYTES", sg.up_proj.dense_bytes - 1)
    assert not sg.dense_prompt(80)
    monkeypatch.setattr(base, "DENSE_PROMPT_BYTES", sg.up_proj.dense_bytes)
    got = np.array(sg(x, inds))  # the same sorted rows, each bank dequantized (MLX's CPU gather_mm: float32)
    assert sg.up_proj.dense_bytes == 8 * 64 * 128 * 4
    # measured 0.0 (values up to 0.45): the CPU's gather_qmm dequantizes as mx.dequantize does; 1e-5 is ~300 float32
    # ulps there, room for another order of the sums
    assert np.abs(got - want).max() < 1e-5


def test_dense_prompt_holds_one_layers_banks_however_deep_the_chunk(monkeypatch) -> None:
    """A prompt chunk through many MoE layers: each projection is evaluated before the next bank is dequantized, so
    the peak does not grow with the layers (queued lazily, MLX dequantized every layer's banks as the chunk's graph
    started: 8 layers of 32 MiB banks peaked at 598 MiB)."""
    monkeypatch.setattr(base.mx, "default_device", lambda: mx.gpu)
    monkeypatch.setattr(base.mx.cuda, "is_available", lambda: True)
    monkeypatch.setattr(base, "DENSE_PROMPT_ROWS", 64)
    mx.random.seed(4)
    layers = []
    for _ in range(8):
        sg = base.SwitchGLU(256, 256, 16)
        nn.quantize(sg, group_size=64, bits=2, class_predicate=lambda _, m: isinstance(m, base.SwitchLinear))
        layers.append(sg)
    mx.eval([sg.parameters() for sg in layers])
    x, inds = mx.random.normal((1, 64, 256)), mx.random.randint(0, 16, (1, 64, 4))
    mx.eval(x, inds)

    def peak(n: int) -> int:
        mx.reset_peak_memory()
        before = mx.get_active_memory()
        h = x
        for sg in layers[:n]:
            h = h + sg(h, inds).sum(-2) * 0.01
        mx.eval(h)
        return mx.get_peak_memory() - before

    bank = layers[0].up_proj.dense_bytes  # 4 MiB
    one, eight = peak(1), peak(8)
    assert one >= bank  # the dense path ran
    # measured one layer 9.0 MiB, eight 9.1 MiB; the banks queued lazily would add three 4 MiB banks a layer
    assert eight < one + bank


def test_sample_greedy_top_p_and_seed() -> None:
    from rq_core.generate import sample

    logits = mx.array([[0.0, 3.0, 2.9, -1.0]])
    assert int(sample(logits, 0.0)[0]) == 1
    assert all(int(sample(logits, 1.0, top_p=1e-6)[0]) == 1 for _ in range(20))  # nucleus of one token
    mx.random.seed(7)
    a = [int(sample(logits, 1.0, top_p=0.9)[0]) for _ in range(50)]
    mx.random.seed(7)
    b = [int(sample(logits, 1.0, top_p=0.9)[0]) for _ in range(50)]
    assert a == b and set(a) <= {1, 2} and len(set(a)) == 2  # token 0 and 3 fall outside the 0.9 nucleus


class _NextTokenModel:
    """Logits over 16 tokens: `peak` at the last input token + 1 (mod 16), 0 elsewhere; no caches. Records the width
    of each call's input (the prompt's chunks, then one token a decode step)."""

    V = 16

    def __init__(self, peak: float = 10.0) -> None:
        self.peak, self.widths = peak, []

    def __call__(self, inputs: mx.array, cache=None, last: bool = False) -> mx.array:
        self.widths.append(inputs.shape[1])
        nxt = (inputs[0, -1].item() + 1) % self.V
        row = mx.where(mx.arange(self.V) == nxt, self.peak, 0.0)
        return mx.broadcast_to(row, (1, inputs.shape[1], self.V))

    def make_cache(self, kv=None) -> list:
        return []


@pytest.mark.parametrize("chunk", [1, 2, 3, 4, 5])
def test_prefill_in_chunks_samples_after_the_last_prompt_token(chunk: int) -> None:
    """The prompt runs in chunks of `prefill_chunk`, the last one whole or not (4 tokens: [4], [2, 2], [3, 1], ...):
    the first sampled token follows the prompt's last token whether or not the chunk size divides the prompt."""
    m = _NextTokenModel()
    res = generate(m, [1, 2, 3, 4], max_tokens=3, prefill_chunk=chunk)
    assert res.tokens == [5, 6, 7]
    n = -(-4 // chunk)
    assert m.widths[:n] == [min(chunk, 4 - i * chunk) for i in range(n)] and m.widths[n:] == [1, 1]


def test_seed_zero_repeats_a_sampled_generation() -> None:
    """seed=0 is a seed like any other: two sampled runs with it give the same tokens whatever was drawn in between
    (equal logits: each token is a draw from 16)."""
    a = generate(_NextTokenModel(peak=0.0), [1], max_tokens=12, temp=1.0, seed=0).tokens
    mx.random.uniform(shape=(4,))  # the global key moves on
    b = generate(_NextTokenModel(peak=0.0), [1], max_tokens=12, temp=1.0, seed=0).tokens
    assert a == b and len(set(a)) > 2


def test_routing_helpers() -> None:
    logits = mx.array([[0.0, 5, 1, 1, 3, 3, -2, 9]])
    inds, w = base.route_softmax_topk(logits, 2, norm_topk_prob=True)
    assert set(np.array(inds)[0].tolist()) == {1, 7} and np.isclose(float(w.sum()), 1.0)
    # Group top-k: groups (0,5) (1,1) (3,3) (-2,9); best two by top-2 sum are (3,3) and (0,5).
    inds, w = base.route_sigmoid_group_topk(logits, 2, n_group=4, topk_group=2, routed_scaling_factor=2.0)
    got = sorted(np.array(inds)[0].tolist())
    assert got[0] == 1 and got[1] in (4, 5)
    assert np.isclose(float(w.sum()), 2.0)
    # The correction bias changes the choice but not the weights' source (sigmoid of the logits).
    bias = mx.array([0.0, 0, 0, 0, 0, 0, 0, 10])
    inds, w = base.route_sigmoid_group_topk(logits, 1, correction_bias=bias, norm_topk_prob=False)
    assert int(inds[0, 0]) == 7 and np.isclose(float(w[0, 0]), float(mx.sigmoid(mx.array(9.0))))


def test_sliding_window_cache_matches_direct_attention() -> None:
    mx.random.seed(1)
    B, H, L, D, W = 1, 2, 13, 16, 4
    q, k, v = (mx.random.normal((B, H, L, D)) for _ in range(3))
    want = np.array(base.attend(None, q, k, v, scale=0.25, window=W))
    c = base.SlidingWindowCache(W)
    parts = [c.attend(q[:, :, i:i + 3], k[:, :, i:i + 3], v[:, :, i:i + 3], scale=0.25, mask=base.attention_mask(3))
             for i in range(0, L, 3)]
    # measured 0.0 (values up to 2.4); 1e-6 is 4 float32 ulps there
    assert np.allclose(np.concatenate([np.array(p) for p in parts], axis=2), want, atol=1e-6)
    assert c.offset == L and c.valid == W and c.keys.shape[2] == W  # a ring of `window` slots


@pytest.mark.parametrize("family", ["qwen3_moe", "nemotron_h", "gemma4"])
def test_a_prompts_end_computes_the_head_at_its_last_position_alone(family, tmp_path, monkeypatch):
    """model(x, cache, last=True) is the full logits' last row, [B, 1, vocab]; generate's prefill asks for it on the
    prompt's last chunk (and only there), so the chunk x vocabulary head is never computed."""
    from tests._tiny_models import available, make_tiny

    from rq_core.generate import prefill

    if not available(family):
        pytest.skip(f"{family} is not built here")
    model = load(make_tiny(family, tmp_path / family), tokenizer=False).model
    ids = mx.array([list(range(3, 23))], mx.int32)
    full = model(ids, cache=model.make_cache())
    last = model(ids, cache=model.make_cache(), last=True)
    assert last.shape == (1, 1, full.shape[-1])
    assert mx.allclose(last[:, 0], full[:, -1], atol=1e-5).item()
    asked = []
    real = type(model).__call__
    monkeypatch.setattr(type(model), "__call__", lambda self, x, cache=None, last=False: asked.append(
        (x.shape[1], last)) or real(self, x, cache, last))
    y, _ = prefill(model, list(range(3, 23)), model.make_cache(), chunk=8)
    assert asked == [(8, False), (8, False), (4, True)]
    assert y.item() == mx.argmax(full[0, -1]).item()
