"""Render one chat template in a child process (see rq_core.tokenizer.render_chat_template).

Run as a script, not imported: it reads {"template", "context", "max_chars", "max_bytes"} as JSON on stdin
and writes {"text": ...} or {"error": ...} as JSON on stdout. Templates come from checkpoints and are
untrusted: jinja2's sandbox keeps them from Python's internals, `range` is bounded, the output is cut at
max_chars, this process' memory is capped, and the parent kills it when its time is up.
"""

import os
import sys

# Run as a script, this folder (rq_core/) comes first on sys.path: its modules must not shadow the stdlib's
# or jinja2's imports (rq_core/tools/profile.py would hide the stdlib's profile).
_HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != _HERE]

import json  # noqa: E402
from datetime import datetime  # noqa: E402

MAX_RANGE = 100_000


def _limit_memory(max_bytes: int) -> None:
    try:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (max_bytes, max_bytes))
    except (ImportError, ValueError, OSError):  # macOS does not enforce RLIMIT_AS; the time limit still holds
        pass


def _render(req: dict) -> str:
    import jinja2
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(msg: str) -> None:
        raise jinja2.exceptions.TemplateError(msg)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def bounded_range(*args):
        if not args or not all(isinstance(a, int) and not isinstance(a, bool) for a in args):
            raise jinja2.exceptions.TemplateError(f"range() takes integers (got {', '.join(map(repr, args))})")
        r = range(*args)
        if len(r) > MAX_RANGE:
            raise jinja2.exceptions.TemplateError(f"range() of {len(r)} items (at most {MAX_RANGE})")
        return r

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = tojson
    env.globals.update(raise_exception=raise_exception, range=bounded_range,
                       strftime_now=lambda fmt: datetime.now().strftime(fmt))
    max_chars = int(req["max_chars"])
    parts, n = [], 0
    for piece in env.from_string(req["template"]).generate(**req["context"]):
        n += len(piece)
        if n > max_chars:
            raise jinja2.exceptions.TemplateError(f"its output is longer than {max_chars} characters")
        parts.append(piece)
    return "".join(parts)


def main() -> None:
    req = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    _limit_memory(int(req["max_bytes"]))
    try:
        out = {"text": _render(req)}
    except RecursionError:
        out = {"error": "it nests too deeply"}
    except MemoryError:
        out = {"error": f"it needs more than {int(req['max_bytes']) >> 20} MiB of memory"}
    except Exception as e:  # a template's own error (TemplateError, TypeError, ...): its message
        out = {"error": f"{e}" if isinstance(e, _template_error()) else f"{type(e).__name__}: {e}"}
    sys.stdout.buffer.write(json.dumps(out, ensure_ascii=True).encode("ascii"))


def _template_error() -> type:
    import jinja2

    return jinja2.exceptions.TemplateError


if __name__ == "__main__":
    main()
