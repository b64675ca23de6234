"""`rq run`."""

from __future__ import annotations

from rq_cli.common import fail


def run() -> None:
    """Not implemented yet."""
    fail("'rq run' is not implemented yet in this version", code=3)
