"""`rq eval ppl | niah | gates`: quality of a KV mode on a model (default: the bundled one)."""

from __future__ import annotations

from typing import Optional

import typer

from rq_cli.common import (COUNT, EDGE_LAYERS, FP16_WINDOW, KEY_BITS, PAIR_POINTS, POSITIVE, SEED, console,
                           edge_layers_arg, fp16_window_arg, gpu_first_run_note, handle_errors, key_bits_arg,
                           pair_points_arg, parse_list, print_json)
from rq_core.errors import RQError

app = typer.Typer(no_args_is_help=True)

MODEL_ARG = typer.Argument(None, help="Checkpoint directory or Hugging Face hub id (default: the bundled model).")
def _ids(em, text: Optional[str]):
    from rq_core.eval import encode_ids, load_heldout_text

    return encode_ids(em.tokenizer, load_heldout_text(text))


@app.command("ppl")
@handle_errors(context=POSITIVE, windows=POSITIVE, step=POSITIVE, prefill_chunk=POSITIVE, key_bits=POSITIVE,
               fp16_window=COUNT, edge_layers=COUNT)
def ppl(
    model: Optional[str] = MODEL_ARG,
    kv: str = typer.Option("fp16", "--kv", help="KV cache: fp16, isoquant3 or turbo3."),
    rotation: Optional[str] = typer.Option(None, "--rotation",
                                           help="IsoQuant rotation: wht_so4 (default), wht, so4, so3, "
                                                "rwht_so4 (random signs first)."),
    context: Optional[int] = typer.Option(None, "--context", help="Window length (default: the model's context)."),
    windows: Optional[int] = typer.Option(None, "--windows", help="Score at most this many windows."),
    step: int = typer.Option(32, "--step", help="Decode tokens per step while scoring (1 = token by token)."),
    text: Optional[str] = typer.Option(None, "--text", help="Text file to score (default: the bundled held-out plays)."),
    key_bits: Optional[int] = KEY_BITS,
    pair_points: Optional[str] = PAIR_POINTS,
    fp16_window: Optional[int] = FP16_WINDOW,
    edge_layers: Optional[int] = EDGE_LAYERS,
    prefill_fp16: Optional[str] = typer.Option(None, "--prefill-fp16",
                                               help="A compressed cache keeps at most N of a window's prefilled tokens "
                                                    "in fp16, compressing older ones as the chunks arrive, or 'all' "
                                                    "(default: 4096, as rq run)."),
    prefill_chunk: int = typer.Option(512, "--prefill-chunk", help="Prefilled tokens per step."),
    value_gain: bool = typer.Option(True, "--value-gain/--no-value-gain",
                                    help="Scale the values' stored norms by the codebook's reconstruction gain "
                                         "1 / (1 - D) (kv.value_gain; default on)."),
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Perplexity over held-out text: each window's first half is prefilled, the second half is scored
    as decode reads the (compressed) cache."""
    from rq_core.eval import check_context, kv_settings, load_eval_model, perplexity

    from rq_core.kv_cache import DEFAULT_PREFILL_FP16, prefill_fp16_value

    bound = DEFAULT_PREFILL_FP16 if prefill_fp16 is None else prefill_fp16_value(prefill_fp16, "--prefill-fp16")
    if rotation is not None and kv != "isoquant3":
        raise RQError("--rotation applies to --kv isoquant3 only (turbo3 uses a dense rotation)")
    settings = kv_settings(kv, rotation, fp16_window=fp16_window_arg(fp16_window), key_bits=key_bits_arg(kv, key_bits),
                           pair_points=pair_points_arg(kv, pair_points, key_bits), prefill_fp16=bound,
                           value_gain=value_gain, edge_layers=edge_layers_arg(edge_layers))
    em = load_eval_model(model)
    gpu_first_run_note()
    ctx = check_context(em.context if context is None else context, em.context)
    res = perplexity(em.model, _ids(em, text), settings, context=ctx, step=step, max_windows=windows,
                     prefill_chunk=prefill_chunk)
    if json_out:
        print_json(res.as_dict())
        return
    rot = f" ({res.rotation})" if res.rotation else ""
    rot += f", fp16 window {res.fp16_window}" if res.fp16_window else ""
    console.print(f"ppl [bold]{res.ppl:.3f}[/] over {res.tokens} decode-scored tokens, {res.windows} window(s) of "
                  f"{res.context}, KV {res.kv_mode}{rot}", highlight=False)


@app.command("niah")
@handle_errors(trials=POSITIVE, seed=SEED, key_bits=POSITIVE, fp16_window=COUNT, edge_layers=COUNT)
def niah_cmd(
    model: Optional[str] = MODEL_ARG,
    kv: str = typer.Option("isoquant3,turbo3", "--kv", help="KV modes to test (comma-separated); fp16 always runs."),
    rotation: Optional[str] = typer.Option(None, "--rotation", help="IsoQuant rotation (default wht_so4)."),
    lengths: str = typer.Option("512,1024,2048", "--lengths", help="Prompt lengths in tokens (comma-separated)."),
    depths: str = typer.Option("0.1,0.5,0.9", "--depths", help="Needle depths in [0, 1] (comma-separated)."),
    trials: int = typer.Option(4, "--trials", help="Needles per cell."),
    seed: int = typer.Option(0, "--seed"),
    key_bits: Optional[int] = KEY_BITS,
    pair_points: Optional[str] = PAIR_POINTS,
    fp16_window: Optional[int] = FP16_WINDOW,
    edge_layers: Optional[int] = EDGE_LAYERS,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Needle in a haystack: a secret number hidden in the held-out plays, asked for at the end."""
    from rq_core.eval import kv_settings, load_eval_model, needle_token_pieces, niah

    Ls = parse_list(lengths, int, "--lengths")
    Ds = parse_list(depths, float, "--depths")
    if any(not 0 <= d <= 1 for d in Ds):
        raise RQError("--depths must lie in [0, 1]")
    modes = ["fp16"] + [m for m in parse_list(kv, str, "--kv") if m != "fp16"]
    settings = [kv_settings(m, rotation if m == "isoquant3" else None, fp16_window=fp16_window_arg(fp16_window),
                            key_bits=key_bits_arg(m, key_bits), pair_points=pair_points_arg(m, pair_points, key_bits),
                            edge_layers=edge_layers_arg(edge_layers))
                for m in modes]
    em = load_eval_model(model)
    gpu_first_run_note()
    too_long = [L for L in Ls if L > em.context]
    if too_long:
        raise RQError(f"--lengths {too_long} exceed the model's trained context of {em.context}")
    res = niah(em.model, _ids(em, None), needle_token_pieces(em.tokenizer), settings, lengths=Ls, depths=Ds,
               trials=trials, seed=seed)
    if json_out:
        print_json(res)
        return
    from rich.table import Table

    t = Table(title=f"needle retrieval ({trials} needle(s) per cell)")
    t.add_column("KV")
    for L in Ls:
        for d in Ds:
            t.add_column(f"{L}@{d:g}", justify="right")
    t.add_column("mean", justify="right")
    for name, r in res["modes"].items():
        t.add_row(name, *[f"{c['accuracy']:.2f}" for c in r["cells"]], f"{r['accuracy']:.2f}")
    console.print(t)
    for name, r in res["modes"].items():
        if "paired" in r:
            pr = r["paired"]
            console.print(f"{name} against fp16, same needles: {pr['lost']} lost, {pr['gained']} gained "
                          f"(McNemar exact p = {pr['mcnemar_p']:.3f})")


@app.command("gates")
@handle_errors(key_bits=POSITIVE, fp16_window=COUNT, edge_layers=COUNT)
def gates_cmd(
    model: Optional[str] = MODEL_ARG,
    kv: str = typer.Option("isoquant3", "--kv", help="KV mode to gate against fp16."),
    rotation: Optional[str] = typer.Option(None, "--rotation", help="IsoQuant rotation (default wht_so4)."),
    gates_file: Optional[str] = typer.Option(None, "--gates", help="Thresholds TOML (default: the bundled gates.toml)."),
    key_bits: Optional[int] = KEY_BITS,
    pair_points: Optional[str] = PAIR_POINTS,
    fp16_window: Optional[int] = FP16_WINDOW,
    edge_layers: Optional[int] = EDGE_LAYERS,
    json_out: bool = typer.Option(False, "--json", help="Print one JSON object."),
) -> None:
    """Twelve quality gates of a KV mode against fp16; exits 1 if any gate fails."""
    from rq_core.eval import GateRunner, kv_settings, load_eval_model, load_gates

    if rotation is not None and kv != "isoquant3":
        raise RQError("--rotation applies to --kv isoquant3 only")
    cfg = load_gates(gates_file)
    settings = kv_settings(kv, rotation, fp16_window=fp16_window_arg(fp16_window), key_bits=key_bits_arg(kv, key_bits),
                           pair_points=pair_points_arg(kv, pair_points, key_bits), edge_layers=edge_layers_arg(edge_layers))
    em = load_eval_model(model)
    gpu_first_run_note()
    rep = GateRunner(em, cfg, _ids(em, None)).run(settings)
    if json_out:
        print_json(rep.as_dict())
    else:
        from rich.table import Table

        t = Table(title=f"quality gates: {rep.label} vs fp16 — {rep.passed}/{len(rep.gates)} passed")
        for col in ("gate", "value", "threshold", "result"):
            t.add_column(col)
        for g in rep.gates:
            t.add_row(g["name"], f"{g['value']:.4g}", g["threshold"], "[green]pass[/]" if g["passed"] else "[red]FAIL[/]")
        console.print(t)
    if rep.passed < len(rep.gates):
        raise typer.Exit(1)
