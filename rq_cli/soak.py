"""`rq soak`: generate for minutes or hours; track memory, throughput and quality; judge stability."""

from __future__ import annotations

from typing import Optional

import typer
from rich.live import Live
from rich.table import Table

from rq_cli.common import (COUNT, EDGE_LAYERS, FP16_WINDOW, FRACTION, POSITIVE, SEED, Range, console, edge_layers_arg,
                           fp16_window_arg, gpu_first_run_note, handle_errors, print_json)
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
               max_prompt=Range(min=8), temp=Range(min=0), seed=SEED, max_growth_mb=Range(min=0),
               max_throughput_drop=FRACTION, fp16_window=COUNT, edge_layers=COUNT)
def soak(
    model: Optional[str] = typer.Argument(None, help="Checkpoint directory or hub id (default: the bundled model)."),
    hours: Optional[float] = typer.Option(None, "--hours", help="How long to run."),
    minutes: Optional[float] = typer.Option(None, "--minutes", help="How long to run (instead of --hours)."),
    seconds: Optional[float] = typer.Option(None, "--seconds", hidden=True),
    report: str = typer.Option(..., "--report", help="Report file (JSON), rewritten atomically at every sample."),
    kv: str = typer.Option("isoquant3", "--kv", help="KV cache mode: fp16, isoquant3, turbo3."),
    rotation: str = typer.Option("wht_so4", "--rotation", help="Rotation variant of a compressed KV mode."),
    fp16_window: Optional[int] = FP16_WINDOW,
    edge_layers: Optional[int] = EDGE_LAYERS,
    interval: Optional[float] = typer.Option(None, "--interval",
                                             help="Seconds between samples (default: ~20 samples, 1-60 s)."),
    max_tokens: int = typer.Option(64, "--max-tokens", help="Tokens per generation."),
    max_prompt: int = typer.Option(256, "--max-prompt",
                                   help="Longest prompt in tokens (prompts vary from 8 up to this)."),
    temp: float = typer.Option(0.8, "--temp", help="Sampling temperature of the generations."),
    seed: int = typer.Option(0, "--seed"),
    max_growth_mb: float = typer.Option(64.0, "--max-growth-mb", help="Memory growth allowed over the run (MB)."),
    max_throughput_drop: float = typer.Option(0.30, "--max-throughput-drop",
                                              help="Allowed fall of decode tok/s, start to end (fraction)."),
    memory_budget: Optional[str] = typer.Option(None, "--memory-budget",
                                                help="Page routed experts from disk to fit this budget (e.g. 16GB)."),
    pager: str = typer.Option("lru", "--pager", help="Expert paging policy with --memory-budget: lru (the only one)."),
    json_out: bool = typer.Option(False, "--json", help="Print the final report as one JSON object."),
) -> None:
    """Generate continuously from varied prompts; exit 1 when memory grows, speed drifts or a check fails."""
    from rq_core.checkpoint import load
    from rq_core.kv_cache import KVSettings, KV_MODES
    from rq_core.soak import Soak, SoakSettings, Thresholds, default_interval

    given = [x for x in (hours, minutes, seconds) if x is not None]
    if len(given) != 1:
        raise RQError("give exactly one of --hours or --minutes")
    duration = (hours or 0) * 3600 + (minutes or 0) * 60 + (seconds or 0)
    if duration <= 0:
        raise RQError("the duration must be positive")
    if kv not in KV_MODES:
        raise RQError(f"unknown KV mode {kv!r} (choose from: {', '.join(KV_MODES)})")
    # As `rq run` does: float32 compute on the CPU for small models, unless experts are paged.
    ckpt = load(model, cpu_float32=memory_budget is None)
    gpu_first_run_note()
    settings = SoakSettings(duration_s=duration, interval_s=interval or default_interval(duration), kv_mode=kv,
                            max_tokens=max_tokens, max_prompt=max_prompt, temp=temp, seed=seed,
                            thresholds=Thresholds(max_growth_mb=max_growth_mb,
                                                  max_throughput_drop=max_throughput_drop))
    kvs = KVSettings(mode=kv, rotation=rotation, seed=seed, fp16_window=fp16_window_arg(fp16_window),
                     edge_layers=edge_layers_arg(edge_layers))  # rq run's cache
    pager_obj = None
    if memory_budget is not None:
        from rq_cli.run_pager import attach_pager

        pager_obj = attach_pager(ckpt, memory_budget, pager, False, json_out, context=settings.max_prompt + max_tokens,
                                 prefill_chunk=512, kv_mode=kv, edge_layers=kvs.edge_layers)
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
