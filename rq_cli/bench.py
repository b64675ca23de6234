"""`rq bench`: decode tok/s (median, min, max), prefill tok/s, peak memory and KV bytes per context and KV mode."""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from rq_cli.common import (COUNT, EDGE_LAYERS, FP16_WINDOW, POSITIVE, SEED, console, edge_layers_arg, fp16_window_arg,
                           gpu_first_run_note, handle_errors, parse_list, print_json, progress_bar)
from rq_core.errors import RQError

MiB = 1 << 20


def parse_contexts(text: str) -> list[int]:
    """'512,2K,128k' → [512, 2048, 131072]."""
    out = []
    for part in text.split(","):
        p = part.strip().lower()
        if not p:
            continue
        mult = 1024 if p.endswith("k") else 1
        try:
            n = int(p[:-1] if mult > 1 else p) * mult
        except ValueError:
            raise RQError(f"bad --context {text!r}: give token counts separated by commas, e.g. 2K,32K,128K")
        if n < 1:
            raise RQError(f"bad --context {text!r}: lengths must be positive")
        out.append(n)
    if not out:
        raise RQError("--context is empty")
    return out


def _table(report: dict) -> None:
    t = Table(title=f"rq bench · {report['model']} · {report['tokens']} tokens x {report['repeats']} repeats "
                    f"({report['backend']})")
    for col in ("context", "KV", "decode tok/s", "min", "max", "peak MiB", "KV MiB", "KV / fp16-equiv."):
        t.add_column(col, justify="right")
    for r in report["decode"]:
        d = r["decode_tok_per_s"]
        ratio = r["kv_bytes"] / r["kv_bytes_fp16"] if r["kv_bytes_fp16"] else float("nan")
        t.add_row(str(r["context"]), r["kv"], f"{d['median']:.2f}", f"{d['min']:.2f}", f"{d['max']:.2f}",
                  f"{r['peak_memory_bytes'] / MiB:.0f}", f"{r['kv_bytes'] / MiB:.1f}", f"{ratio:.3f}")
    console.print(t)
    for p in report["prefill"]:
        s = p["prefill_tok_per_s"]
        console.print(f"prefill {p['tokens']} tokens, {p['kv']} KV: {s['median']:.1f} tok/s "
                      f"(min {s['min']:.1f}, max {s['max']:.1f}), peak {p['peak_memory_bytes'] / MiB:.0f} MiB")


@handle_errors(tokens=POSITIVE, repeats=POSITIVE, prefill_tokens=COUNT, fp16_window=COUNT, edge_layers=COUNT, seed=SEED)
def bench(
    model: Optional[str] = typer.Argument(None, help="Checkpoint directory or hub id (default: the bundled model)."),
    context: str = typer.Option("2K,32K,128K", "--context", "-c",
                                help="Context lengths, comma-separated (2K = 2048); filled with random K/V."),
    kv: str = typer.Option("fp16,isoquant3", "--kv", help="KV cache modes, comma-separated: fp16, isoquant3, turbo3."),
    tokens: int = typer.Option(128, "--tokens", "-n", help="Greedy tokens decoded per measurement."),
    repeats: int = typer.Option(3, "--repeats", help="Interleaved repetitions of every (context, KV) cell."),
    prefill_tokens: int = typer.Option(512, "--prefill-tokens",
                                       help="Real prefill measured on this many random tokens (0 = skip)."),
    fp16_window: Optional[int] = FP16_WINDOW,
    edge_layers: Optional[int] = EDGE_LAYERS,
    seed: int = typer.Option(0, "--seed", help="Seed of the synthetic context and prompt."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Decode speed, prefill speed, peak memory and KV bytes per context and KV mode, in one process, interleaved."""
    import mlx.core as mx

    from rq_core.bench import bench as run_bench, check_contexts, kv_settings
    from rq_core.checkpoint import context_length, load, load_config, resolve_model_path
    from rq_core.profile import backend

    contexts = parse_contexts(context)
    modes = parse_list(kv, str, "--kv")
    modes = [m.strip() for m in modes]
    kvs = kv_settings(modes, fp16_window=fp16_window_arg(fp16_window), edge_layers=edge_layers_arg(edge_layers))
    path = resolve_model_path(model)
    check_contexts(contexts, tokens, context_length(load_config(path)))  # refused before the weights load
    ckpt = load(path, tokenizer=False, cpu_float32=True)  # as `rq run`: float32 on the CPU for small models
    gpu_first_run_note()
    with progress_bar(disable=json_out, elapsed=True) as progress:
        report = run_bench(ckpt.model, ckpt.config, contexts, kvs, tokens=tokens, repeats=repeats,
                           prefill_tokens=prefill_tokens, seed=seed, progress=progress)
    report = {"model": str(ckpt.path), "model_type": ckpt.model_type, "backend": backend(),
              "mlx_version": mx.__version__, **report}
    if json_out:
        print_json(report)
    else:
        _table(report)
