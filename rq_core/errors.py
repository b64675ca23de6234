"""One exception type for user-facing errors: the CLI prints its message as one line and exits 2."""


class RQError(Exception):
    """A problem with the user's input (file, flag, recipe, budget); never a bug in rq."""
