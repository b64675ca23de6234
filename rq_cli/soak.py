"""`rq soak`: generate for minutes or hours; track memory, throughput and quality; judge stability."""

from __future__ import annotations

from typing import Optional

import typer
from rich.live import Live
from rich.table import Table

from rq_cli.common import (FRACTION, POSITIVE, SEED, KvCompressed, KvConfig, MemoryBudget, ModelArg, ModelOpt, Pager,
                           Range, Seed, TopP, check_kv_flags, console, gpu_first_run_note, handle_errors, kv_settings,
                           memory_budget_of, model_arg, pager_policy, print_json, recipe_of)
from rq_core.errors import RQError

MB = 1 << 20


def _fmt(x: Optional[float], spec: str, none: str = "-") -> str:
    return none if x is None else format(x, spec)


def render(report: dict) -> Table:
    """The live view: the latest sample and the running verdict."""
    sm = report["summary"]
    last = report["samples"][-1] if report["samples"] else {}
    t = Table(title=f"rq soak · {report['kv_mode']} KV · {report['status']} · "
                    f"{report['elapsed_s']:.0f}/{report['duration_s']:.0f} s", show_header=False)
    t.add_column("what")
    t.add_column("value", justify="right")
    t.add_row("samples / generations / tokens", f"{sm['samples']} / {sm['generations']} / {sm['tokens_generated']}")
    t.add_row("decode tok/s (last, mean)", f"{_fmt(last.get('decode_tok_per_s'), '.1f')}, "
                                           f"{_fmt(sm['decode_tok_per_s_mean'], '.1f')}")
    t.add_row("RSS now / peak (MB)", f"{last.get('rss_bytes', 0) / MB:.1f} / {sm['peak_rss_bytes'] / MB:.1f}")
    t.add_row("MLX active / peak (MB)", f"{last.get('active_bytes', 0) / MB:.1f} / {sm['peak_memory_bytes'] / MB:.1f}")
    g = sm["memory_growth"]
    t.add_row("memory growth (MB/h, fit)", _fmt(None if g["slope_bytes_per_hour"] is None
                                                 else g["slope_bytes_per_hour"] / MB, "+.1f"))
    t.add_row("memory CV (decode)", _fmt(sm["memory_cv"], ".2%"))
    t.add_row("throughput drift", _fmt(sm["throughput_drift"], "+.1%"))
    if last.get("pager"):
        p = last["pager"]
        t.add_row("pager hit rate", _fmt(p.get("hit_rate"), ".1%"))
    gates = ", ".join(f"{k} {'ok' if v['passed'] else 'FAIL'}" for k, v in sm["gates"].items())
    t.add_row("checks", gates or "-")
    verdict = "[green]passing[/]" if sm["passed"] else "[red]failing[/]: " + "; ".join(sm["failures"])
    t.add_row("verdict", verdict)
    return t


_DURATION = Range(min=0, min_open=True)


@handle_errors(hours=_DURATION, minutes=_DURATION, seconds=_DURATION, interval=_DURATION, max_tokens=POSITIVE,
               max_prompt=Range(min=8), temp=Range(min=0), top_p=Range(0, 1, min_open=True), seed=SEED,
               max_growth_mb=Range(min=0), max_throughput_drop=FRACTION)
def soak(
    model: ModelArg = None,
    model_opt: ModelOpt = None,
    hours: Optional[float] = typer.Option(None, "--hours", metavar="H", show_default=False, help="How long to run."),
    minutes: Optional[float] = typer.Option(None, "--minutes", metavar="M", show_default=False,
                                            help="How long to run (instead of --hours)."),
    seconds: Optional[float] = typer.Option(None, "--seconds", hidden=True),
    report: str = typer.Option(..., "--report", metavar="FILE", show_default=False,
                               help="Report file (JSON), rewritten atomically at every sample."),
    kv: KvCompressed = None,
    kv_config: KvConfig = None,
    interval: Optional[float] = typer.Option(None, "--interval", metavar="S", show_default=False,
                                             help="Seconds between samples (default: ~20 samples, 1-60 s)."),
    max_tokens: int = typer.Option(64, "--max-tokens", "-n", metavar="N",
                                   help="Most tokens a generation (fewer than `rq run`'s default: many generations "
                                        "from varied prompts)."),
    max_prompt: int = typer.Option(256, "--max-prompt", metavar="N",
                                   help="Longest prompt in tokens (prompts vary from 8 up to this)."),
    temp: float = typer.Option(0.8, "--temp", metavar="T",
                               help="Sampling temperature (0 = greedy). Here sampling is on by default (temperature "
                                    "0.8, top-p 0.95, unlike `rq run`), so the generations vary."),
    top_p: TopP = 0.95,
    seed: Seed = 0,
    max_growth_mb: float = typer.Option(64.0, "--max-growth-mb", metavar="MB",
                                        help="Memory growth allowed over the run (MB)."),
    max_throughput_drop: float = typer.Option(0.30, "--max-throughput-drop", metavar="X",
                                              help="Allowed fall of decode tok/s, start to end (fraction)."),
    memory_budget: MemoryBudget = None,
    pager: Pager = None,
    json_out: bool = typer.Option(False, "--json", help="Print the final report as one JSON object."),
) -> None:
    """Generate continuously from varied prompts; exit 1 when memory grows, speed drifts or a check fails."""
    from rq_core.checkpoint import load, resolve_model_path
    from rq_core.tools.soak import Soak, SoakSettings, Thresholds, default_interval

    model = model_arg(model, model_opt)
    given = [x for x in (hours, minutes, seconds) if x is not None]
    if len(given) != 1:
        raise RQError("give exactly one of --hours or --minutes")
    duration = (hours or 0) * 3600 + (minutes or 0) * 60 + (seconds or 0)
    if duration <= 0:
        raise RQError("the duration must be positive")
    check_kv_flags(kv, kv_config)
    # As `rq run` does: float32 compute on the CPU where it costs little memory (the pager casts pages to it).
    path = resolve_model_path(model)
    rec = recipe_of(path)
    memory_budget = memory_budget_of(rec, path, memory_budget)
    ckpt = load(path, cpu_float32=True)
    gpu_first_run_note()
    kvs = kv_settings(rec, kv, kv_config, default_mode="isoquant3")  # rq run's cache
    kv = kvs.mode
    settings = SoakSettings(duration_s=duration, interval_s=interval or default_interval(duration), kv_mode=kv,
                            max_tokens=max_tokens, max_prompt=max_prompt, temp=temp, top_p=top_p, seed=seed,
                            thresholds=Thresholds(max_growth_mb=max_growth_mb,
                                                  max_throughput_drop=max_throughput_drop))
    pager_obj = None
    if memory_budget is not None:
        from rq_cli.run_pager import attach_pager

        pager_obj = attach_pager(ckpt, memory_budget, pager_policy(rec, pager), False, json_out,
                                 context=settings.max_prompt + max_tokens, prefill_chunk=512, kv_mode=kv,
                                 edge_layers=kvs.edge_layers)
    live = Live(console=console, auto_refresh=False, transient=False) if console.is_terminal else None

    def on_sample(rep: dict) -> None:
        if live is not None:
            live.update(render(rep), refresh=True)

    runner = Soak(ckpt, settings, report, kv=kvs, pager=pager_obj, on_sample=on_sample)
    if live is not None:
        with live:
            final = runner.run()
    else:
        final = runner.run()
    if json_out:
        print_json(final)
    else:
        if live is None:
            console.print(render(final))
        console.print(f"report: {report}")
    if not final["passed"]:
        raise typer.Exit(1)
