"""`rq bench`: decode tok/s (median, min, max), prefill tok/s, peak memory and KV bytes per context and KV mode."""

from __future__ import annotations

from typing import Optional

import typer
from rich.table import Table

from rq_cli.common import (COUNT, POSITIVE, SEED, Json, KvConfig, ModelArg, ModelOpt, check_kv_flags, console,
                           gpu_first_run_note, handle_errors, kv_settings, model_arg, parse_contexts, parse_list,
                           print_json, progress_bar, recipe_of)
from rq_core.errors import RQError

MiB = 1 << 20


def _table(report: dict) -> None:
    from rq_core.attention.dispatch import format_paths

    t = Table(title=f"rq bench · {report['model']} · {report['tokens']} tokens x {report['repeats']} repeats "
                    f"({report['backend']})")
    for col in ("context", "KV", "decode tok/s", "min", "max", "peak MiB", "KV MiB", "KV / fp16-equiv.", "attention"):
        t.add_column(col, justify="right")
    for r in report["decode"]:
        d = r["decode_tok_per_s"]
        ratio = r["kv_bytes"] / r["kv_bytes_fp16"] if r["kv_bytes_fp16"] else float("nan")
        t.add_row(str(r["context"]), r["kv"], f"{d['median']:.2f}", f"{d['min']:.2f}", f"{d['max']:.2f}",
                  f"{r['peak_memory_bytes'] / MiB:.0f}", f"{r['kv_bytes'] / MiB:.1f}", f"{ratio:.3f}",
                  format_paths(r["attention_paths"]))
    console.print(t)
    for p in report["prefill"]:
        s = p["prefill_tok_per_s"]
        console.print(f"prefill {p['tokens']} tokens, {p['kv']} KV: {s['median']:.1f} tok/s "
                      f"(min {s['min']:.1f}, max {s['max']:.1f}), peak {p['peak_memory_bytes'] / MiB:.0f} MiB")


@handle_errors(tokens=POSITIVE, repeats=POSITIVE, prefill_tokens=COUNT, seed=SEED)
def bench(
    model: ModelArg = None,
    model_opt: ModelOpt = None,
    context: str = typer.Option("2K,32K,128K", "--context", "-c", metavar="N,...",
                                help="Context lengths, comma-separated (2K = 2048); filled with random K/V."),
    kv: str = typer.Option("fp16,isoquant3", "--kv", metavar="MODE,...",
                           help="KV cache modes, comma-separated: fp16, isoquant3, turbo3 (each with the checkpoint's "
                                "recipe.toml kv settings, else rq run's defaults)."),
    kv_config: KvConfig = None,
    tokens: int = typer.Option(128, "--tokens", "-n", metavar="N", help="Greedy tokens decoded in each timed run."),
    repeats: int = typer.Option(3, "--repeats", metavar="N",
                                help="Repetitions of every (context, KV) cell; at a context the KV modes decode in "
                                     "turns of 16 tokens, their caches held together (peaks are reported per mode)."),
    prefill_tokens: int = typer.Option(512, "--prefill-tokens", metavar="N",
                                       help="Random prompt tokens prefilled to time prefill (0 = skip)."),
    seed: int = typer.Option(0, "--seed", metavar="N", help="Seed of the synthetic context and prompt."),
    json_out: Json = False,
) -> None:
    """Decode speed, prefill speed, peak memory and KV bytes per context and KV mode, in one process, interleaved."""
    import mlx.core as mx

    from rq_core.tools.bench import bench as run_bench, check_contexts
    from rq_core.checkpoint import context_length, load, load_config, resolve_model_path
    from rq_core.tools.profile import backend

    contexts = parse_contexts(context)
    modes = [m.strip() for m in parse_list(kv, str, "--kv")]
    for m in modes:
        check_kv_flags(m, kv_config)
    path = resolve_model_path(model_arg(model, model_opt))
    rec = recipe_of(path)
    kvs = [kv_settings(rec, m, kv_config) for m in modes]  # the caches `rq run --kv MODE` makes
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
