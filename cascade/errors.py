"""The one exception type for bad input, and how every entry point reports it."""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import ParamSpec

from cascade.logs import show_logs

P = ParamSpec("P")


class CascadeError(ValueError):
    """A user-facing error: what was wrong and what is allowed instead (a ValueError, so Python
    callers of ``cascade.LLM`` may catch either)."""


def entry_point(main: Callable[P, int | None]) -> Callable[P, int]:
    """An entry point's ``main``, returning its exit status: what ``main`` returns (None: 0); a
    CascadeError ends it with ``error: <message>`` on stderr and status 2 (no traceback), Ctrl-C
    with ``interrupted`` and status 130 (where ``main`` does not say more itself). The library's
    log messages go to stderr (``show_logs``; ``main`` may call it again with its own options)."""

    @functools.wraps(main)
    def run(*args: P.args, **kwargs: P.kwargs) -> int:
        show_logs()
        try:
            return main(*args, **kwargs) or 0
        except CascadeError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
        except KeyboardInterrupt:
            print("\ninterrupted", file=sys.stderr)
            return 130

    return run
