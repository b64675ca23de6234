"""`rq eval ppl | niah | gates`: quality of a KV mode on a model (default: the bundled one)."""

from __future__ import annotations

from typing import Optional

import typer

from rq_cli.common import (POSITIVE, SEED, Json, Kv, KvCompressed, KvConfig, ModelArg, ModelOpt, PrefillChunk,
                           RQCommand, RQGroup, check_kv_flags, console, gpu_first_run_note, handle_errors, kv_settings,
                           model_arg, parse_list, print_json, recipe_of)
from rq_core.errors import RQError

app = typer.Typer(no_args_is_help=True, cls=RQGroup)


def _ids(em, text: Optional[str]):
    from rq_core.tools.eval import encode_ids, load_heldout_text

    return encode_ids(em.tokenizer, load_heldout_text(text))


@app.command("ppl", cls=RQCommand)
@handle_errors(context=POSITIVE, windows=POSITIVE, step=POSITIVE, prefill_chunk=POSITIVE)
def ppl(
    model: ModelArg = None,
    model_opt: ModelOpt = None,
    kv: Kv = None,
    kv_config: KvConfig = None,
    context: Optional[int] = typer.Option(None, "--context", metavar="N", show_default=False,
                                          help="Window length (default: the model's context)."),
    windows: Optional[int] = typer.Option(None, "--windows", metavar="N", show_default=False,
                                          help="Score at most this many windows."),
    step: int = typer.Option(32, "--step", metavar="N",
                             help="Decode tokens per step while scoring (1 = token by token)."),
    text: Optional[str] = typer.Option(None, "--text", metavar="FILE", show_default=False,
                                       help="Text file to score (default: the bundled held-out plays)."),
    prefill_chunk: PrefillChunk = 512,
    json_out: Json = False,
) -> None:
    """Perplexity over held-out text: each window's first half is prefilled, the second half is scored
    as decode reads the (compressed) cache."""
    from rq_core.tools.eval import check_context, load_eval_model, perplexity

    model = model_arg(model, model_opt)
    check_kv_flags(kv, kv_config)
    em = load_eval_model(model)
    settings = kv_settings(recipe_of(em.path), kv, kv_config)
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


@app.command("niah", cls=RQCommand)
@handle_errors(trials=POSITIVE, seed=SEED)
def niah_cmd(
    model: ModelArg = None,
    model_opt: ModelOpt = None,
    kv: str = typer.Option("isoquant3,turbo3", "--kv", metavar="MODES",
                           help="KV modes to test, comma-separated (several, unlike the other commands' one: each is "
                                "compared with fp16, which always runs)."),
    kv_config: KvConfig = None,
    lengths: str = typer.Option("512,1024,2048", "--lengths", metavar="N,...",
                                help="Prompt lengths in tokens (comma-separated)."),
    depths: str = typer.Option("0.1,0.5,0.9", "--depths", metavar="X,...",
                               help="Needle depths in [0, 1] (comma-separated)."),
    trials: int = typer.Option(4, "--trials", metavar="N", help="Needles per cell."),
    seed: int = typer.Option(0, "--seed", metavar="N", help="Random seed of the needles' numbers and places."),
    json_out: Json = False,
) -> None:
    """Needle in a haystack: a secret number hidden in the held-out plays, asked for at the end."""
    from rq_core.tools.eval import load_eval_model, needle_token_pieces, niah

    model = model_arg(model, model_opt)
    Ls = parse_list(lengths, int, "--lengths")
    Ds = parse_list(depths, float, "--depths")
    if any(not 0 <= d <= 1 for d in Ds):
        raise RQError("--depths must lie in [0, 1]")
    modes = ["fp16"] + [m for m in parse_list(kv, str, "--kv") if m != "fp16"]
    for m in modes:
        check_kv_flags(m, kv_config)
    em = load_eval_model(model)
    rec = recipe_of(em.path)
    settings = [kv_settings(rec, m, kv_config) for m in modes]
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


@app.command("gates", cls=RQCommand)
@handle_errors
def gates_cmd(
    model: ModelArg = None,
    model_opt: ModelOpt = None,
    kv: KvCompressed = None,
    kv_config: KvConfig = None,
    gates_file: Optional[str] = typer.Option(None, "--gates", metavar="FILE", show_default=False,
                                             help="Thresholds TOML (default: the bundled gates.toml)."),
    json_out: Json = False,
) -> None:
    """Twelve quality gates of a KV mode against fp16; exits 1 if any gate fails."""
    from rq_core.tools.eval import GateRunner, load_eval_model, load_gates

    model = model_arg(model, model_opt)
    check_kv_flags(kv, kv_config)
    cfg = load_gates(gates_file)
    em = load_eval_model(model)
    settings = kv_settings(recipe_of(em.path), kv, kv_config, default_mode="isoquant3")
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
