"""`rq quantize`."""

from __future__ import annotations

from rq_cli.common import fail


def quantize() -> None:
    """Not implemented yet."""
    fail("'rq quantize' is not implemented yet in this version", code=3)
