"""`rq profile`."""

from __future__ import annotations

from rq_cli.common import fail


def profile() -> None:
    """Not implemented yet."""
    fail("'rq profile' is not implemented yet in this version", code=3)
