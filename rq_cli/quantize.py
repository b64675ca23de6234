"""`rq quantize MODEL --recipe NAME|PATH -o OUT [--calib FILE] [--analyze] [--plan] [--json]`."""

from __future__ import annotations

from typing import Any, Optional

import typer

from rq_cli.common import ModelOpt, console, handle_errors, model_arg, print_json, progress_bar
from rq_core.errors import RQError


@handle_errors
def quantize(
    model: Optional[str] = typer.Argument(None, metavar="MODEL", show_default=False,
                                          help="Checkpoint directory or Hugging Face hub id (or --model)."),
    model_opt: ModelOpt = None,
    recipe: str = typer.Option(..., "--recipe", "-r", help="Bundled recipe name (e.g. qwen3-16gb) or a .toml path."),
    out: Optional[str] = typer.Option(None, "--out", "-o", help="Output directory (new or empty; written atomically, never replaced)."),
    calib: Optional[str] = typer.Option(None, "--calib", help="Calibration text file (default: bundled text)."),
    analyze: bool = typer.Option(False, "--analyze", help="Report per-role activation kurtosis on the calibration text."),
    plan: bool = typer.Option(False, "--plan", help="Print the memory plan (no weights read) and exit."),
    budget: Optional[str] = typer.Option(None, "--memory-budget", help="Budget for --plan (default: the recipe's)."),
    shard_size: str = typer.Option("2GB", "--shard-size", help="Largest output shard."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Quantize a checkpoint by role with a TOML recipe."""
    from rq_core.quant import recipe as rq_recipe
    from rq_core.checkpoint import load_config, resolve_model_path

    model = model_arg(model, model_opt, required=True)

    rec = rq_recipe.load(recipe)
    if plan:
        from rq_core.paging.planner import plan as make_plan, render

        from pathlib import Path

        mp = Path(model)  # a config.json file alone is enough for a plan
        cfg = load_config(mp) if mp.is_file() and mp.suffix == ".json" else load_config(resolve_model_path(model))
        size = rq_recipe.parse_size(budget, "--memory-budget") if budget else None
        rec, why = _kv_mode_for_plan(cfg, rec, size)
        p = make_plan(cfg, rec, budget=size)
        if json_out:
            print_json({"plan": p.as_dict(), "kv_mode": rec.kv.mode, "kv_auto_reason": why})
        else:
            console.print(render(p))
            console.print(f"KV {rec.kv.mode}{f' (auto: {why})' if why else ''}", highlight=False, soft_wrap=True)
        return
    if out is None and analyze:  # analysis only
        from rq_core.quant.quantize import analyze as run_analyze

        a = run_analyze(model, rec, calib=calib)
        if json_out:
            print_json({"analyze": a, "recipe": rec.name})
        else:
            for role, k in sorted(a["kurtosis"].items()):
                console.print(f"kurtosis {role:<14} {k:8.2f}", highlight=False)
        return
    if out is None:
        raise RQError("missing -o/--out OUT (the output directory)")

    from rq_core.quant.quantize import quantize as run_quantize

    with progress_bar(disable=json_out, elapsed=True) as progress:
        res = run_quantize(model, rec, out, calib=calib, analyze_roles=analyze,
                           shard_bytes=rq_recipe.parse_size(shard_size, "--shard-size"), progress=progress)
    if json_out:
        print_json({"quantize": res.as_dict(), "recipe": rec.name})
        return
    from rq_core.paging.planner import fmt_bytes

    if res.kurtosis:
        for role, k in sorted(res.kurtosis.items()):
            console.print(f"  kurtosis {role:<14} {k:8.2f}", highlight=False)
    if res.promoted:
        console.print(f"  promoted to {rec.promote.bits}-bit: {', '.join(res.promoted)}", highlight=False)
    console.print(f"wrote {res.out}: {res.quantized}/{res.tensors} tensors quantized, {res.shards} shard(s), "
                  f"{fmt_bytes(res.bytes_in)} -> {fmt_bytes(res.bytes_out)}, "
                  f"peak MLX memory {fmt_bytes(res.peak_memory_bytes)}", highlight=False)


def _kv_mode_for_plan(cfg: dict, rec: Any, budget: Optional[int]) -> tuple[Any, Optional[str]]:
    """The recipe with kv.mode = "auto" resolved as a run would resolve it at the recipe's pager.context (the
    planner's fits and K/V bytes), and auto's reason; as it is for a named mode."""
    import dataclasses

    from rq_core.cache.auto import AUTO, COMPRESSED, Fit, decide_unloaded
    from rq_core.paging.planner import plan as make_plan

    if rec.kv.mode != AUTO:
        return rec, None
    p16, pc = (make_plan(cfg, dataclasses.replace(rec, kv=dataclasses.replace(rec.kv, mode=m)), budget=budget)
               for m in ("fp16", COMPRESSED))
    need = [p.kv_bytes + p.prefill_fp16_bytes for p in (p16, pc)]  # what differs between the two caches' needs
    c = decide_unloaded(cfg, rec.kv, context=p16.context, fit=Fit(p16.fits, pc.fits, *need))
    return dataclasses.replace(rec, kv=dataclasses.replace(rec.kv, mode=c.mode)), c.reason


@handle_errors
def dequantize(
    model: Optional[str] = typer.Argument(None, metavar="MODEL", show_default=False,
                                          help="A quantized checkpoint directory or hub id (default: the bundled "
                                               "model)."),
    model_opt: ModelOpt = None,
    out: Optional[str] = typer.Option(None, "--out", "-o",
                                      help="Output directory (new or empty; written atomically, never replaced)."),
    shard_size: str = typer.Option("2GB", "--shard-size", help="Largest output shard."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Write a full-precision copy of a quantized checkpoint: its weights dequantized (what they hold, no more), as a
    source for `rq quantize`."""
    from rq_core.quant import recipe as rq_recipe
    from rq_core.quant.quantize import dequantize as run_dequantize

    model = model_arg(model, model_opt)
    if out is None:
        raise RQError("missing -o/--out OUT (the output directory)")
    with progress_bar(disable=json_out, elapsed=True) as progress:
        res = run_dequantize(model, out, shard_bytes=rq_recipe.parse_size(shard_size, "--shard-size"),
                             progress=progress)
    if json_out:
        print_json({"dequantize": res.as_dict()})
        return
    from rq_core.paging.planner import fmt_bytes

    console.print(f"wrote {res.out}: {res.dequantized}/{res.tensors} tensors dequantized, "
                  f"{fmt_bytes(res.bytes_in)} -> {fmt_bytes(res.bytes_out)}", highlight=False)
