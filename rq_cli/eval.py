"""`rq eval ppl | niah | gates`: quality of a KV mode on a model (default: the bundled one)."""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, Optional

import typer
from rich.markup import escape

from rq_cli.common import (POSITIVE, SEED, Json, Kv, KvCompressed, KvConfig, ModelArg, ModelOpt, PrefillChunk,
                           RQCommand, RQGroup, check_kv_flags, console, gpu_first_run_note, handle_errors, kv_settings,
                           model_arg, parse_list, print_json, recipe_of)
from rq_core.errors import RQError

app = typer.Typer(no_args_is_help=True, cls=RQGroup)

# The default samples (each command's `--full` measures more); tests/test_eval.py checks the help says these.
PPL_WINDOWS = 2
NIAH_QUICK = {"lengths": "1024", "depths": "0.25,0.75", "trials": 1}
NIAH_FULL = {"lengths": "512,1024,2048", "depths": "0.1,0.5,0.9", "trials": 4}


def _ids(em, text: Optional[str]):
    from rq_core.tools.eval import encode_ids, load_heldout_text

    return encode_ids(em.tokenizer, load_heldout_text(text))


@contextlib.contextmanager
def _live(json_out: bool) -> Iterator[tuple[Callable[[str, int, int], None], Callable[[str], None]]]:
    """A bar with time left per stage on stderr, and partial results printed above it as they come
    (neither with --json, whose one object on stdout stays the only output)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
        TimeRemainingColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TextColumn("left"), TimeRemainingColumn(), console=console, disable=json_out)
    tasks: dict[str, Any] = {}

    def progress(stage: str, done: int, total: int) -> None:
        if not tasks:
            bar.start()  # only once work starts: an early error stays one line
        if stage not in tasks:
            tasks[stage] = bar.add_task(stage, total=total)
        bar.update(tasks[stage], completed=done, total=total)

    def note(text: str) -> None:
        if not json_out:
            bar.console.print(f"[dim]{escape(text)}[/]", highlight=False)

    try:
        yield progress, note
    finally:
        bar.stop()


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
                                          help=f"Score at most this many windows (default: {PPL_WINDOWS})."),
    full: bool = typer.Option(False, "--full", help="Score every window of the text."),
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
    if full and windows is not None:
        raise RQError("--full scores every window; leave out --windows")
    check_kv_flags(kv, kv_config)
    em = load_eval_model(model)
    settings = kv_settings(recipe_of(em.path), kv, kv_config)
    gpu_first_run_note()
    ctx = check_context(em.context if context is None else context, em.context)
    n = None if full else PPL_WINDOWS if windows is None else windows
    with _live(json_out) as (progress, note):
        res = perplexity(em.model, _ids(em, text), settings, context=ctx, step=step, max_windows=n,
                         prefill_chunk=prefill_chunk, progress=progress, note=note)
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
    lengths: Optional[str] = typer.Option(None, "--lengths", metavar="N,...", show_default=False,
                                          help=f"Prompt lengths in tokens, comma-separated (default: "
                                               f"{NIAH_QUICK['lengths']}; --full: {NIAH_FULL['lengths']})."),
    depths: Optional[str] = typer.Option(None, "--depths", metavar="X,...", show_default=False,
                                         help=f"Needle depths in [0, 1], comma-separated (default: "
                                              f"{NIAH_QUICK['depths']}; --full: {NIAH_FULL['depths']})."),
    trials: Optional[int] = typer.Option(None, "--trials", metavar="N", show_default=False,
                                         help=f"Needles per cell (default: {NIAH_QUICK['trials']}; "
                                              f"--full: {NIAH_FULL['trials']})."),
    full: bool = typer.Option(False, "--full", help="The larger grid of lengths, depths and needles per cell (a "
                                                    "flag given explicitly still sets its own)."),
    seed: int = typer.Option(0, "--seed", metavar="N", help="Random seed of the needles' numbers and places."),
    json_out: Json = False,
) -> None:
    """Needle in a haystack: a secret number hidden in the held-out plays, asked for at the end."""
    from rq_core.tools.eval import load_eval_model, needle_token_pieces, niah

    model = model_arg(model, model_opt)
    grid = NIAH_FULL if full else NIAH_QUICK
    lengths = grid["lengths"] if lengths is None else lengths
    depths = grid["depths"] if depths is None else depths
    trials = grid["trials"] if trials is None else trials
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
    with _live(json_out) as (progress, note):
        res = niah(em.model, _ids(em, None), needle_token_pieces(em.tokenizer), settings, lengths=Ls, depths=Ds,
                   trials=trials, seed=seed, progress=progress, note=note)
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
                                             help="Thresholds and sample sizes, TOML (default: the bundled "
                                                  "gates.toml)."),
    full: bool = typer.Option(False, "--full", help="Score every window of the held-out text for the perplexity "
                                                    "and KL gates, and the sample of the gates file's "
                                                    "\"full\" table for the others."),
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
    with _live(json_out) as (progress, note):
        rep = GateRunner(em, cfg, _ids(em, None), full=full, progress=progress, note=note).run(settings)
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
