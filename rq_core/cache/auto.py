"""`--kv auto`: the KV mode a run takes when none is named, decided in one place.

Compress only where it pays: fp16 when fp16 K/V for the planned context fits the memory budget and fp16 is not
slower on this backend at this context; isoquant3 otherwise.

- CPU (or MLX without GPU kernels): the compressed cache decodes on the reference path, slower than fp16, so fp16
  unless the budget forces compression.
- GPU (Metal, CUDA): isoquant3 from LONG_CONTEXT tokens when the fused attention kernel takes every compressed
  layer's shape (rq_core.attention.dispatch.fused_declines), fp16 below; where the kernel declines a shape the
  compressed layers would take the reference path, so fp16 unless the budget forces compression.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Iterable, Optional, Sequence

AUTO = "auto"
COMPRESSED = "isoquant3"  # what auto compresses with
# From this many tokens of context a GPU with the fused kernel runs the compressed cache rather than fp16. Whole model
# on an H200 (benchmarks/decode_vs_mlxlm.py, benchmarks/results/decode_vs_mlxlm.json), IsoQuant-3's tok/s against
# fp16's: at 128K Gemma 4 26B-A4B 1.45x, Nemotron 3 Nano 1.29x; at 32K Qwen3-30B-A3B 1.25x, Nemotron 3 Nano 1.09x,
# Gemma 4 0.91x (so not below 128K). A Metal GPU's memory bandwidth is a tenth of an H200's, so a step's K/V reads
# weigh more there; no Metal machine has measured the whole model.
LONG_CONTEXT = 131072


@dataclasses.dataclass(frozen=True)
class Fit:
    """Whether fp16 and compressed K/V for the planned context fit the memory budget (the pager's plan: top-k expert
    slots a layer left), and the least budget each needs in bytes. The default: no budget, both fit."""

    fp16: bool = True
    compressed: bool = True
    fp16_need: int = 0
    compressed_need: int = 0


@dataclasses.dataclass(frozen=True)
class AutoChoice:
    """The mode auto picked and why (one line, for the stats line and --json's kv_auto_reason)."""

    mode: str
    reason: str


def choose(*, backend: Optional[str], context: int, fit: Fit = Fit(),
           declined: Sequence[str] = ()) -> tuple[str, str]:
    """(mode, reason) for a run of `context` tokens. backend: 'cuda' or 'metal' where the GPU kernels run, None on
    the CPU; fit: what fits the memory budget at this context; declined: why the fused kernel declines a compressed
    layer's shape on `backend` (empty: it takes every one). Where neither cache fits, the one needing less (the run
    then fails naming the least budget)."""
    if not fit.fp16:
        if fit.compressed:
            return COMPRESSED, f"fp16 KV for {context} tokens does not fit the memory budget"
        if fit.compressed_need < fit.fp16_need:
            return COMPRESSED, f"neither fp16 nor {COMPRESSED} KV for {context} tokens fits the memory budget; " \
                               f"{COMPRESSED} needs less"
        return "fp16", f"neither fp16 nor {COMPRESSED} KV for {context} tokens fits the memory budget; fp16 needs less"
    if backend is None:
        return "fp16", "on the CPU the compressed cache decodes slower than fp16 (no GPU kernels)"
    if declined:
        return "fp16", f"the fused {backend} kernel declines this model's attention ({declined[0]})"
    if context >= LONG_CONTEXT:
        return COMPRESSED, f"{context} tokens of context on {backend}: from {LONG_CONTEXT} tokens it compresses " \
                           "(K/V reads weigh more than the compressed cache's extra work)"
    return "fp16", f"{context} tokens of context on {backend}: below {LONG_CONTEXT} tokens it keeps fp16"


def kernel_backend() -> Optional[str]:
    """'cuda' or 'metal' when the default device is a GPU the kernels run on, else None."""
    import mlx.core as mx

    from rq_core.kernels import launch

    if mx.default_device() == mx.cpu:
        return None
    return launch.backend()


def attention_shapes(model: Any) -> list[tuple[int, int, int]]:
    """(head_dim, query heads, kv heads) of the model's full-attention layers (sliding-window layers keep fp16),
    distinct, in order."""
    out: list[tuple[int, int, int]] = []
    for m in model.modules():
        if all(hasattr(m, a) for a in ("n_heads", "n_kv_heads", "head_dim", "window")) and m.window is None:
            s = (int(m.head_dim), int(m.n_heads), int(m.n_kv_heads))
            if s not in out:
                out.append(s)
    return out


def declined_shapes(backend: str, shapes: Iterable[tuple[int, int, int]], settings: Any) -> list[str]:
    """Why the fused kernel would decline a decode step of each shape with the codebooks a compressed cache of
    `settings` takes there (its own and its edge layers'), with and without the fp16 window."""
    from rq_core.attention.dispatch import fused_declines

    iso = dataclasses.replace(settings, mode=COMPRESSED)
    out = []
    for d, hq, hkv in shapes:
        books = [dict(bits=iso.bits, key_bits=iso.key_bits, pair_points=iso.pairs_for(d))]
        if iso.edge_layers:
            books.append(dict(bits=iso.edge_bits))
        whys = (fused_declines(backend, head_dim=d, q_heads=hq, kv_heads=hkv, window=window, **cb)
                for cb in books for window in ((True, False) if iso.fp16_window else (False,)))
        why = next((w for w in whys if w is not None), None)
        if why is not None:  # the first decline of each shape
            out.append(f"head_dim {d}, {hq}/{hkv} heads: {why}")
    return out


def budget_fit(model: Any, config: dict, budget: Optional[int], settings: Any, *, context: int,
               prefill_chunk: int = 512, index: Optional[dict] = None) -> Fit:
    """What fits `budget` bytes beside the loaded model's weights at `context` tokens: fp16 K/V, and the compressed
    cache of `settings` (its prefill_fp16 and edge layers), as the pager plans them (Fit() without a budget)."""
    if budget is None:
        return Fit()
    from rq_core.paging.pager import slots_for_budget

    plans = [slots_for_budget(model, config, budget, context=context, prefill_chunk=prefill_chunk, kv_mode=mode,
                              index=index, **kw)
             for mode, kw in (("fp16", {}), (COMPRESSED, dict(prefill_fp16=settings.prefill_fp16,
                                                              edge_layers=settings.edge_layers)))]
    return Fit(bool(plans[0]["fits"]), bool(plans[1]["fits"]), plans[0]["min_budget_bytes"],
               plans[1]["min_budget_bytes"])


def decide(model: Any, config: dict, settings: Any, *, context: int, budget: Optional[int] = None,
           prefill_chunk: int = 512, index: Optional[dict] = None) -> AutoChoice:
    """auto's choice for a loaded model: `choose` asked with this machine's backend, the model's attention shapes and
    the budget's plan."""
    fit = budget_fit(model, config, budget, settings, context=context, prefill_chunk=prefill_chunk, index=index)
    return _choice(lambda: model, settings, context, fit)


def decide_unloaded(config: dict, settings: Any, *, context: int, fit: Fit) -> AutoChoice:
    """auto's choice for a checkpoint not loaded (`rq quantize --plan`): its attention shapes from the family's model
    built lazily (no weights read); fit: the planner's answers."""
    def build() -> Any:
        from rq_core.models import get_model_module

        module = get_model_module(config.get("model_type"))
        return module.Model(module.ModelArgs.from_dict(config))

    return _choice(build, settings, context, fit)


def _choice(model: Callable[[], Any], settings: Any, context: int, fit: Fit) -> AutoChoice:
    be = kernel_backend()
    shapes = attention_shapes(model())
    declined = declined_shapes(be, shapes, settings) if be is not None else []
    return AutoChoice(*choose(backend=be, context=context, fit=fit, declined=declined))
