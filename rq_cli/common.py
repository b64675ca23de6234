"""Helpers shared by the commands: one-line errors, JSON output, the console."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import sys
from pathlib import Path
import typing
from typing import Annotated, Any, Callable, Iterator, List, Optional

import typer
from rich.console import Console

from rq_core.errors import RQError
from rq_core.textio import check_utf8, dumps_strict, finite_or_none

console = Console(stderr=True)


# typer re-exports click's errors (newer typer vendors click); their common base is ClickException.
_USAGE_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


def _no_type_tags(params: list, metavars: dict[str, str]) -> list:
    """Help without type tags: a flag shows nothing after it, a value its metavar, an argument its name."""
    for p in params:
        if isinstance(p, typer.core.TyperArgument):
            p.display_type_rich = lambda ctx: None  # the help's argument column shows its name alone
        elif p.metavar is None:
            p.metavar = "" if getattr(p, "is_flag", False) else metavars.get(p.bare_type(), "TEXT")
    return params


class RQGroup(typer.core.TyperGroup):
    """A group of commands (`rq`, `rq eval`) whose help has no type tags, as RQCommand's."""

    def get_params(self, ctx: Any) -> list:
        return _no_type_tags(super().get_params(ctx), RQCommand._METAVARS)


class OneLineErrors(RQGroup):
    """The root command: a usage error (unknown flag, a value that is not a number) is one line too."""

    def main(self, *args: Any, standalone_mode: bool = True, **kwargs: Any) -> Any:
        if not standalone_mode:
            return super().main(*args, standalone_mode=False, **kwargs)
        try:
            rv = super().main(*args, standalone_mode=False, **kwargs)
        except _USAGE_ERROR as e:
            if type(e).__name__ == "NoArgsIsHelpError":  # the help was shown; that is not an error line
                sys.exit(e.exit_code)
            ctx = getattr(e, "ctx", None)
            hint = f" (see `{ctx.command_path} --help`)" if ctx is not None else ""
            print_error(f"{e.format_message()}{hint}")
            sys.exit(e.exit_code)
        except typer.Abort:
            print_error("aborted")
            sys.exit(1)
        sys.exit(rv if isinstance(rv, int) else 0)


def print_error(message: str) -> None:
    from rich.markup import escape

    # escaped: a path or value with [brackets] is text, not markup
    console.print(f"[bold red]error:[/] {escape(message)}", highlight=False, soft_wrap=True)


def fail(message: str, code: int = 2) -> None:
    """Print one clear error line and exit non-zero (never a traceback)."""
    print_error(message)
    raise typer.Exit(code)


@dataclasses.dataclass(frozen=True)
class Range:
    """Allowed values of a numeric flag: min/max (None: unbounded), each end open or closed."""

    min: Optional[float] = None
    max: Optional[float] = None
    min_open: bool = False
    max_open: bool = False

    def check(self, v: float, flag: str) -> None:
        def num(x: float) -> str:
            return str(int(x)) if float(x).is_integer() else f"{x:g}"

        low = self.min is None or (v > self.min if self.min_open else v >= self.min)
        high = self.max is None or (v < self.max if self.max_open else v <= self.max)
        if low and high:
            return
        if self.max is None:
            raise RQError(f"{flag} must be {'>' if self.min_open else '>='} {num(self.min)} (got {num(v)})")
        if self.min is None:
            raise RQError(f"{flag} must be {'<' if self.max_open else '<='} {num(self.max)} (got {num(v)})")
        raise RQError(f"{flag} must be in {'(' if self.min_open else '['}{num(self.min)}, {num(self.max)}"
                      f"{')' if self.max_open else ']'} (got {num(v)})")


COUNT = Range(min=0)  # tokens, layers, repeats that may be zero
POSITIVE = Range(min=1)  # counts that must be at least one
SEED = Range(0, 2**63 - 1)  # what mx.random.seed takes
FRACTION = Range(0, 1)


def param_decls(fn: Callable, name: str) -> tuple[str, ...]:
    """The flags a parameter is typed as (`--max-tokens`, `-n`), from its typer.Option default or its Annotated
    alias (common.py); () for an argument."""
    p = inspect.signature(fn).parameters[name]
    if hasattr(p.default, "param_decls"):
        return tuple(p.default.param_decls or ())
    hint = typing.get_type_hints(fn, include_extras=True).get(name)
    info = next((m for m in getattr(hint, "__metadata__", ()) if hasattr(m, "param_decls")), None)
    if info is None:
        return ()
    # inside Annotated, typer reads the first flag (which typer.Option takes as its default) as a flag
    first = (info.default,) if isinstance(info.default, str) and info.default.startswith("-") else ()
    return first + tuple(info.param_decls or ())


def _flag_names(fn: Callable) -> dict[str, str]:
    """Parameter name -> the flag the user typed it as (`--temp`, or the argument's NAME)."""
    names = {}
    for name in inspect.signature(fn).parameters:
        decls = [d for d in param_decls(fn, name) if d.startswith("--")]
        names[name] = decls[0] if decls else name.upper()
    return names


def check_args(kwargs: dict[str, Any], ranges: dict[str, Range], flags: dict[str, str]) -> None:
    """Every number finite and inside its declared Range; every string valid UTF-8."""
    for name, v in kwargs.items():
        flag = flags.get(name, name)
        if isinstance(v, bool) or v is None:
            continue
        if isinstance(v, float) and not math.isfinite(v):
            raise RQError(f"{flag} must be a finite number (got {v})")
        if isinstance(v, (int, float)) and name in ranges:
            ranges[name].check(v, flag)
        elif isinstance(v, (str, Path)):
            check_utf8(str(v), flag)
        elif isinstance(v, (list, tuple)):  # a repeatable option
            for x in v:
                check_utf8(str(x), flag)


def handle_errors(fn: Optional[Callable] = None, /, **ranges: Range) -> Callable:
    """Wrap a command: check its arguments (numbers finite and in their `ranges`, given per parameter
    name; strings UTF-8), then turn RQError (and a few well-understood OS errors) into one line + exit 2.
    Use as `@handle_errors` or `@handle_errors(temp=Range(min=0), ...)`."""
    if fn is None:
        return functools.partial(handle_errors, **ranges)
    unknown = set(ranges) - set(inspect.signature(fn).parameters)
    if unknown:  # a typo would silently leave a flag unchecked
        raise TypeError(f"{fn.__name__} has no parameter(s) {', '.join(sorted(unknown))}")
    flags = _flag_names(fn)

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            check_args(kwargs, ranges, flags)
            return fn(*args, **kwargs)
        except RQError as e:
            fail(str(e))
        except FileNotFoundError as e:
            fail(f"file not found: {e.filename or e}")
        except OSError as e:  # permission denied, disk full, a directory where a file was expected
            fail(f"{e.strerror or e}: {e.filename}" if e.filename else str(e))
        except KeyboardInterrupt:
            fail("interrupted", code=130)

    wrapper.ranges = ranges  # type: ignore[attr-defined]  # for tests: which flags have bounds
    return wrapper


@contextlib.contextmanager
def progress_bar(disable: bool = False, elapsed: bool = False) -> Iterator[Callable[[str, int, int], None]]:
    """A transient bar per stage on stderr; yields the `progress(stage, done, total)` callback rq_core takes."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    cols = [TextColumn("{task.description}"), BarColumn(), TextColumn("{task.completed}/{task.total}")]
    bar = Progress(*cols, *([TimeElapsedColumn()] if elapsed else []), console=console, disable=disable,
                   transient=True)
    tasks: dict[str, Any] = {}

    def progress(stage: str, done: int, total: int) -> None:
        if not tasks:
            bar.start()  # only once work starts: an early error stays one line, with no blank line before it
        if stage not in tasks:
            tasks[stage] = bar.add_task(stage, total=total)
        bar.update(tasks[stage], completed=done, total=total)

    try:
        yield progress
    finally:
        if tasks:
            bar.stop()


def print_json(obj: Any) -> None:
    """Machine-readable output on stdout: one strict JSON object (a NaN or infinite measurement is null)."""
    sys.stdout.write(dumps_strict(finite_or_none(obj), indent=None, default=_default) + "\n")
    sys.stdout.flush()


def _default(o: Any) -> Any:
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, np.ndarray):
            return o.tolist()
    except ImportError:  # pragma: no cover
        pass
    return str(o)


def gpu_first_run_note() -> None:
    """On stderr: a note when this looks like the first GPU run on the machine (rq_core.kernels.cache.first_run_note),
    so minutes of MLX compiling its kernels do not read as a hang."""
    from rq_core.kernels.cache import first_run_note

    note = first_run_note()
    if note:
        console.print(f"[dim]rq: {note}[/dim]")


class RQCommand(typer.core.TyperCommand):
    """A command whose help reads as mlx-lm's and llama.cpp's: a value's metavar (N, SIZE, MODE) instead of a type
    tag, nothing after a flag, and arguments in the usage line as MODEL or [MODEL]."""

    _METAVARS = {"int": "N", "float": "X", "str": "TEXT"}

    def get_params(self, ctx: Any) -> list:
        return _no_type_tags(super().get_params(ctx), self._METAVARS)  # the command's, and --help

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        rv = [self.options_metavar] if self.options_metavar else []
        for p in self.get_params(ctx):
            if isinstance(p, typer.core.TyperArgument):
                name = p.metavar or p.name.upper()
                rv.append(name if p.required else f"[{name}]")
            else:
                rv.extend(p.get_usage_pieces(ctx))
        return rv


# rq_core.quant.recipe.KV_KEYS less mode (that is --kv), spelled out so that --help does not import MLX (a test keeps
# them equal)
KV_CONFIG_KEYS = ("bits", "rotation", "codebook", "fp16_window", "prefill_fp16", "norm_correction", "value_gain",
                  "seed", "key_bits", "pair_points", "edge_layers", "edge_bits")

# The options and arguments that several commands share, each defined once here; a command's default goes in
# its signature (`temp: Temp = 0.0`).
ModelArg = Annotated[Optional[str], typer.Argument(
    metavar="MODEL", show_default=False,
    help="Checkpoint directory or Hugging Face hub id (default: the bundled model).")]
ModelOpt = Annotated[Optional[str], typer.Option(
    "--model", "-m", metavar="MODEL", show_default=False, help="The model, as the MODEL argument.")]
MaxTokens = Annotated[int, typer.Option("--max-tokens", "-n", metavar="N", help="Most tokens to generate.")]
Temp = Annotated[float, typer.Option("--temp", metavar="T", help="Sampling temperature (0 = greedy).")]
TopP = Annotated[float, typer.Option("--top-p", metavar="P", help="Nucleus sampling: keep the most likely tokens "
                                                                 "whose mass reaches P (1 = off).")]
TopK = Annotated[int, typer.Option("--top-k", metavar="K", help="Sample from the K most likely tokens (0 = off).")]
MinP = Annotated[float, typer.Option("--min-p", metavar="P", help="Drop tokens less likely than P times the most "
                                                                 "likely one (0 = off).")]
Seed = Annotated[int, typer.Option("--seed", metavar="N", help="Random seed for sampling.")]
Kv = Annotated[Optional[str], typer.Option(
    "--kv", metavar="MODE", show_default=False,
    help="KV cache of full-attention layers: fp16, isoquant3 or turbo3 (default: the checkpoint's recipe.toml "
         "kv.mode, else fp16).")]
KvAuto = Annotated[Optional[str], typer.Option(
    "--kv", metavar="MODE", show_default=False,
    help="KV cache of full-attention layers: auto, fp16, isoquant3 or turbo3 (default: the checkpoint's recipe.toml "
         "kv.mode, else auto: fp16 where fp16 K/V for the planned context fits --memory-budget and is not slower "
         "on this machine, else isoquant3; the stats line and --json say which and why).")]
KvCompressed = Annotated[Optional[str], typer.Option(
    "--kv", metavar="MODE", show_default=False,
    help="KV cache of full-attention layers: fp16, isoquant3 or turbo3 (default: the checkpoint's recipe.toml "
         "kv.mode, else isoquant3, since this command measures a compressed cache against fp16).")]
KvConfig = Annotated[Optional[List[str]], typer.Option(
    "--kv-config", metavar="KEY=VALUE", show_default=False,
    help="Set a key of the recipe's kv table over the checkpoint's recipe.toml, e.g. pair_points=off, "
         "edge_layers=0, fp16_window=64, rotation=so4, prefill_fp16=all (repeatable; checked as a recipe is). "
         f"Keys: {', '.join(KV_CONFIG_KEYS)}.")]
MemoryBudget = Annotated[Optional[str], typer.Option(
    "--memory-budget", metavar="SIZE", show_default=False,
    help="Keep the run inside SIZE (e.g. 16GB): routed experts beyond what fits are paged from the expert pages "
         "(see `rq pack`). Default: the recipe's pager.memory_budget when the checkpoint is packed, else everything "
         "resident.")]
Pager = Annotated[Optional[str], typer.Option(
    "--pager", metavar="POLICY", show_default=False,
    help="Expert paging policy with --memory-budget: lru, the only one (default: the recipe's pager.policy, else lru).")]
MaxKvSize = Annotated[Optional[int], typer.Option(
    "--max-kv-size", metavar="N", show_default=False,
    help="Bound the KV cache as mlx-lm's --max-kv-size: full-attention layers keep only the newest N tokens "
         "(fp16 K/V; with a compressed --kv it is refused, --kv auto becomes fp16). Default: every token.")]
PrefillChunk = Annotated[int, typer.Option("--prefill-chunk", metavar="N", help="Prompt tokens per prefill step.")]
Json = Annotated[bool, typer.Option("--json", help="Print one JSON object.")]


def model_arg(positional: Optional[str], option: Optional[str], required: bool = False) -> Optional[str]:
    """MODEL or --model (the same model given both ways is fine); None: the bundled model."""
    if positional is not None and option is not None and positional != option:
        raise RQError(f"two models given: {positional} and --model {option}")
    m = positional if positional is not None else option
    if m is None and required:
        raise RQError("missing MODEL (a checkpoint directory or hub id, or --model)")
    return m


def recipe_of(path: Path) -> Any:
    """The checkpoint's recipe.toml (written by `rq quantize`), or None."""
    if (Path(path) / "recipe.toml").is_file():
        from rq_core.quant import recipe

        return recipe.load(Path(path) / "recipe.toml")
    return None


def check_kv_flags(kv: Optional[str], kv_config: Optional[list[str]], auto: bool = False) -> None:
    """A bad --kv or --kv-config fails before a model loads."""
    kv_settings(None, kv, kv_config, auto=auto)


def kv_settings(rec: Any, kv: Optional[str], kv_config: Optional[list[str]], default_mode: str = "fp16",
                auto: bool = False) -> Any:
    """The KV cache settings every command builds: the recipe's [kv] (else the defaults `rq run` uses), then --kv,
    then each --kv-config KEY=VALUE, checked as a recipe is. The mode left unset (no --kv, a recipe without kv.mode
    or with kv.mode = "auto") is "auto" for a command that runs one cache and picks it (`auto`: run, serve, chat;
    rq_core.cache.auto), else `default_mode`; --kv auto is refused by the others."""
    from rq_core.cache.auto import AUTO
    from rq_core.cache.kv_cache import DEFAULT_EDGE_LAYERS, DEFAULT_FP16_WINDOW, KV_MODES, KVSettings
    from rq_core.quant.recipe import apply_kv_config

    modes = KV_MODES + ((AUTO,) if auto else ())
    if kv == AUTO and not auto:
        raise RQError(f"--kv auto picks one cache for a run (rq run, serve, chat); here choose from: "
                      f"{', '.join(KV_MODES)}")
    if kv is not None and kv not in modes:
        raise RQError(f"unknown --kv {kv!r} (choose from: {', '.join(modes)})")
    base = rec.kv if rec is not None else KVSettings(mode=AUTO, fp16_window=DEFAULT_FP16_WINDOW,
                                                     edge_layers=DEFAULT_EDGE_LAYERS)
    if kv is not None:
        base = dataclasses.replace(base, mode=kv)
    if base.mode == AUTO and not auto:
        base = dataclasses.replace(base, mode=default_mode)
    return apply_kv_config(base, kv_config or [])


def memory_budget_of(rec: Any, path: Path, memory_budget: Optional[str], pages: Optional[str] = None) -> Optional[str]:
    """--memory-budget, else the recipe's pager.memory_budget when the checkpoint is packed for paging, else None
    (everything resident)."""
    if memory_budget is None and rec is not None and rec.pager.memory_budget:
        from rq_core.paging.pack import INDEX, find_pages

        if (find_pages(path, pages) / INDEX).is_file():
            return rec.pager.memory_budget
    return memory_budget


def pager_policy(rec: Any, pager: Optional[str]) -> str:
    """--pager, else the recipe's [pager] policy, else lru."""
    return pager if pager is not None else rec.pager.policy if rec is not None else "lru"

def parse_contexts(text: str) -> list[int]:
    """'512,2K,128k' -> [512, 2048, 131072] (--context of profile and bench)."""
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


def parse_list(s: str, cast, name: str) -> list:
    try:
        vals = [cast(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise RQError(f"{name} must be a comma-separated list (got {s!r})")
    if not vals:
        raise RQError(f"{name} is empty")
    return vals
