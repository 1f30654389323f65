"""The one exception type for bad input: the CLIs print its message and exit non-zero."""


class CascadeError(Exception):
    """A user-facing error: what was wrong and what is allowed instead."""
