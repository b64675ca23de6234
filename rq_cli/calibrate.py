"""`rq calibrate-codebook`."""

from __future__ import annotations

from rq_cli.common import fail


def calibrate_codebook() -> None:
    """Not implemented yet."""
    fail("'rq calibrate-codebook' is not implemented yet in this version", code=3)
