"""`rq pack`."""

from __future__ import annotations

from rq_cli.common import fail


def pack() -> None:
    """Not implemented yet."""
    fail("'rq pack' is not implemented yet in this version", code=3)
