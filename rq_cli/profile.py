"""`rq profile`: where a decode step's time goes, per attention kernel, and whether compressing KV pays."""

from __future__ import annotations

import typer
from rich.table import Table

from rq_cli.common import (COUNT, FRACTION, POSITIVE, Json, KvCompressed, KvConfig, MemoryBudget, ModelArg, ModelOpt,
                           Pager, check_kv_flags, parse_contexts, console, gpu_first_run_note, handle_errors, kv_settings,
                           memory_budget_of, model_arg, pager_policy, print_json, recipe_of)
from rq_core.errors import RQError


def _table(report: dict) -> None:
    from rq_core.attention.dispatch import format_paths

    t = Table(title=f"decode step, ms ({report['kv_mode']} KV, {report['backend']}"
                    f"{', reference path' if report['reference_path'] else ''})")
    parts = [k for k in ("kv_attention", "sliding_attention", "experts", "ssm", "rest")
             if k in ("kv_attention", "rest") or any(r["attribution"][k] > 0 for r in report["results"])]
    names = {"kv_attention": "KV attn", "sliding_attention": "sliding", "experts": "experts", "ssm": "SSM",
             "rest": "rest"}
    for col in ["context", "step", "tok/s"] + [names[p] for p in parts] + ["KV share", "fp16 step", "vs fp16",
                                                                           "verdict"]:
        t.add_column(col, justify="right")
    for r in report["results"]:
        a = r["attribution"]
        fp16 = "-" if r["fp16_step_ms"] is None else f"{r['fp16_step_ms']:.2f}"
        vs = "-" if r["step_vs_fp16"] is None else f"{r['step_vs_fp16']:.2f}x"
        t.add_row(str(r["context"]), f"{r['measured_step_ms']:.2f}", f"{1e3 / r['measured_step_ms']:.1f}",
                  *[f"{a[p]:.2f}" for p in parts], f"{r['kv_attention_share']:.1%}", fp16, vs,
                  "[green]go[/]" if r["verdict"] == "go" else "[yellow]no-go[/]")
    console.print(t)
    console.print("step, fp16 step: measured whole decode steps of the compressed and the fp16 cache; vs fp16: "
                  "their ratio; the parts and KV share: each component timed alone, op by op, against the step run "
                  "op by op (no traced graphs)", highlight=False)
    console.print(f"attention paths (compressed layers): {format_paths(report['attention_paths'])}", highlight=False)
    staged = [r for r in report["results"] if r["kernels"]]
    if staged:
        k = Table(title="attention stages, ms per decode step (all full-attention layers)")
        k.add_column("context", justify="right")
        for name in ("rot q", "A qk", "B smax", "C v", "D rot⁻¹"):
            k.add_column(name, justify="right")
        k.add_column("sum/attn", justify="right")
        k.add_column("C")
        for r in staged:
            ratio = r.get("kernels_to_attention")
            k.add_row(str(r["context"]), *[f"{v:.3f}" for v in r["kernels"].values()],
                      "-" if ratio is None else f"{ratio:.2f}", str(r["strategy"]))
        console.print(k)
    why = next((r["stages_unavailable"] for r in report["results"] if r.get("stages_unavailable")), None)
    if why:
        console.print(f"no attention stages: the four-kernel pipeline does not cover this shape ({why})",
                      highlight=False)
    thr, share = report["threshold"], report["share_verdict"]
    share_note = (f"KV attention is above {thr:.0%} of the step from {report['share_go_from_context']} tokens"
                  if share == "go" else f"KV attention stays at or below {thr:.0%} of the step")
    if report["verdict"] == "go":
        first = next(r for r in report["results"] if r["verdict"] == "go")
        console.print(f"[green]go[/] from {first['context']} tokens of context: {first['verdict_reason']}; "
                      f"compressing the KV cache pays there ({share_note}).", highlight=False)
    else:
        last = report["results"][-1]
        console.print(f"[yellow]no-go[/]: {last['verdict_reason']}; at these contexts compressing the KV cache saves "
                      f"memory but does not speed up decoding ({share_note}).", highlight=False)


@handle_errors(threshold=FRACTION, tolerance=FRACTION, repeats=POSITIVE, warmup=COUNT)
def profile(
    model: ModelArg = None,
    model_opt: ModelOpt = None,
    context: str = typer.Option("512,2048", "--context", "-c", metavar="N,...",
                                help="Context lengths, comma-separated (2K = 2048)."),
    kv: KvCompressed = None,
    kv_config: KvConfig = None,
    threshold: float = typer.Option(0.20, "--threshold", metavar="X",
                                    help="KV-attention share above which the share rule (share_verdict) says go."),
    tolerance: float = typer.Option(0.05, "--tolerance", metavar="X",
                                    help="How much slower than fp16's step the compressed step may be and still "
                                         "count as not slower (0.05: 5%)."),
    fill: str = typer.Option("synthetic", "--fill", metavar="HOW",
                             help="How the context is built: synthetic (random K/V appended) or prefill "
                                  "(random tokens through the model)."),
    repeats: int = typer.Option(7, "--repeats", metavar="N", help="Timed repeats per measurement (median reported)."),
    warmup: int = typer.Option(2, "--warmup", metavar="N", help="Untimed warm-up runs per measurement."),
    memory_budget: MemoryBudget = None,
    pager: Pager = None,
    json_out: Json = False,
) -> None:
    """Time one decode step per context, the compressed cache's and fp16's: the five attention kernels, KV attention
    vs experts, SSM, rest, and whether the compressed step is not slower than fp16's (the verdict)."""
    from rq_core.checkpoint import load, resolve_model_path, text_config
    from rq_core.tools.profile import profile_model

    model = model_arg(model, model_opt)
    contexts = parse_contexts(context)
    check_kv_flags(kv, kv_config)
    # As `rq run` does: float32 compute on the CPU where it costs little memory (the pager casts pages to it).
    path = resolve_model_path(model)
    rec = recipe_of(path)
    memory_budget = memory_budget_of(rec, path, memory_budget)
    ckpt = load(path, tokenizer=False, cpu_float32=True)
    gpu_first_run_note()
    settings = kv_settings(rec, kv, kv_config, default_mode="isoquant3")  # the cache `rq run` makes
    kv = settings.mode
    limit = text_config(ckpt.config).get("max_position_embeddings")
    if limit and max(contexts) > limit:
        console.print(f"[yellow]note:[/] context {max(contexts)} is beyond the model's {limit} positions "
                      "(timing is still meaningful, outputs are not)")

    pager_obj, fits = None, None
    if memory_budget is not None:
        from rq_cli.run_pager import attach_pager

        pager_obj = attach_pager(ckpt, memory_budget, pager_policy(rec, pager), False, json_out,
                                 context=max(contexts) + 64,
                                 prefill_chunk=512, kv_mode=kv, edge_layers=settings.edge_layers)
        from rq_core.cache.auto import budget_fit
        from rq_core.quant.recipe import parse_size

        budget = parse_size(memory_budget, "--memory-budget")
        fits = lambda n: budget_fit(ckpt.model, ckpt.config, budget, settings, context=n + 64).fp16  # noqa: E731

    def progress(r: dict) -> None:
        if not json_out:
            fp16 = f", fp16 step {r['fp16_step_ms']:.3f} ms" if r["fp16_step_ms"] is not None else ""
            console.print(f"  context {r['context']}: step {r['measured_step_ms']:.3f} ms{fp16}, "
                          f"KV attention {r['kv_attention_share']:.1%}", highlight=False)

    report = profile_model(ckpt.model, contexts, kv=settings, fill=fill,
                           vocab_size=text_config(ckpt.config).get("vocab_size"),
                           warmup=warmup, repeats=repeats, threshold=threshold, on_context=progress,
                           tolerance=tolerance, fp16_fits=fits)
    report["model"] = str(ckpt.path)
    report["model_type"] = ckpt.model_type
    # Expert time ("experts") includes the pager's reads; its counters over the whole profile:
    report["pager"] = pager_obj.report().as_dict() if pager_obj is not None else None
    if json_out:
        print_json(report)
    else:
        _table(report)
