"""RotaryQuant core: everything behind the `rq` command line."""

__version__ = "0.1.0"
