"""`rq eval ...`: quality measurements."""

from __future__ import annotations

import typer

from rq_cli.common import fail

app = typer.Typer(no_args_is_help=True)


@app.command("ppl")
def ppl() -> None:
    """Perplexity over held-out text (not implemented yet)."""
    fail("'rq eval ppl' is not implemented yet in this version", code=3)
