"""`rq soak`."""

from __future__ import annotations

from rq_cli.common import fail


def soak() -> None:
    """Not implemented yet."""
    fail("'rq soak' is not implemented yet in this version", code=3)
