"""Helpers shared by the commands: one-line errors, JSON output, the console."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import inspect
import math
import sys
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import typer
from rich.console import Console

from rq_core.errors import RQError
from rq_core.textio import check_utf8, dumps_strict, finite_or_none

console = Console(stderr=True)


# typer re-exports click's errors (newer typer vendors click); their common base is ClickException.
_USAGE_ERROR = next(c for c in typer.BadParameter.__mro__ if c.__name__ == "ClickException")


class OneLineErrors(typer.core.TyperGroup):
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


def _flag_names(fn: Callable) -> dict[str, str]:
    """Parameter name -> the flag the user typed it as (`--temp`, or the argument's NAME)."""
    names = {}
    for name, p in inspect.signature(fn).parameters.items():
        decls = [d for d in getattr(p.default, "param_decls", None) or () if d.startswith("--")]
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
    """On stderr: a note when this looks like the first GPU run on the machine (rq_core.kernel_cache.first_run_note),
    so minutes of MLX compiling its kernels do not read as a hang."""
    from rq_core.kernel_cache import first_run_note

    note = first_run_note()
    if note:
        console.print(f"[dim]rq: {note}[/dim]")


# --key-bits / --pair-points, shared by `rq eval` and `rq profile`
FP16_WINDOW = typer.Option(None, "--fp16-window",
                           help="Newest tokens kept unquantized in a compressed cache (default 32, as `rq run`; 0 = none).")


EDGE_LAYERS = typer.Option(None, "--edge-layers",
                           help="The first and last N compressed layers keep keys and values at 4 bits (default 1; "
                                "0 = none): on the bundled model they made 90% of the 3-bit cache's KL against fp16.")


def _count_arg(n: Optional[int], flag: str, default: str) -> int:
    """A non-negative count flag: rq_core.kv_cache's `default` (as `rq run`'s) when not given."""
    if n is None:
        from rq_core import kv_cache

        return getattr(kv_cache, default)
    if n < 0:
        raise RQError(f"{flag} must be >= 0 (got {n})")
    return n


def edge_layers_arg(n: Optional[int]) -> int:
    return _count_arg(n, "--edge-layers", "DEFAULT_EDGE_LAYERS")


def fp16_window_arg(n: Optional[int]) -> int:
    return _count_arg(n, "--fp16-window", "DEFAULT_FP16_WINDOW")


KEY_BITS = typer.Option(None, "--key-bits", help="Keys at this many bits, values at the mode's 3 (e.g. 4: needles "
                                                 "kept on the bundled model, 14% more KV bytes).")
PAIR_POINTS = typer.Option(None, "--pair-points",
                           help="Codebooks: keys' and values' points a pair of rotated coordinates (default 128,32 for "
                                "isoquant3: IsoQuant-3's bytes), or 'off' for scalar codebooks (the paper's).")


def key_bits_arg(kv: str, n: Optional[int]) -> Optional[int]:
    """--key-bits for a compressed mode (fp16 ignores it); checked as the cache checks bits."""
    if n is None or kv == "fp16":
        return None
    from rq_core.codebook import check_bits

    return check_bits(n)


def pair_points_arg(kv: str, spec: Optional[str], key_bits: Optional[int]) -> Optional[tuple]:
    """--pair-points "K,V" or "off" (scalar codebooks: ()) for a compressed mode (fp16 ignores it); None when not
    given (the settings' default)."""
    if spec is None or kv == "fp16":
        return None
    if spec.strip().lower() == "off":
        return ()
    if key_bits is not None:
        raise RQError("--key-bits and --pair-points cannot be combined")
    from rq_core.codebook import check_pair_points

    return check_pair_points(parse_list(spec, int, "--pair-points"))


def parse_list(s: str, cast, name: str) -> list:
    try:
        vals = [cast(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise RQError(f"{name} must be a comma-separated list (got {s!r})")
    if not vals:
        raise RQError(f"{name} is empty")
    return vals
