"""How the library reports: every module logs to ``logging.getLogger(__name__)`` (loggers under
``cascade``, ``cache`` and ``configs``): progress at INFO, fallbacks that cost speed at WARNING.
Code that imports cascade sees what its own logging configuration shows; the command-line entry
points show the messages on stderr (``show_logs``)."""

from __future__ import annotations

import logging
import sys

LIBRARY_LOGGERS = ("cascade", "cache", "configs")


class _EntryPointHandler(logging.StreamHandler):
    """The stderr handler ``show_logs`` installs (one per library logger, replaced on each call)."""


def show_logs(verbose: bool = False, quiet: bool = False) -> None:
    """For an entry point: the library's messages on stderr, one line each: INFO and above by
    default, DEBUG too with ``verbose``, only WARNING and above with ``quiet``."""
    level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    for name in LIBRARY_LOGGERS:
        logger = logging.getLogger(name)
        for handler in [handler for handler in logger.handlers if isinstance(handler, _EntryPointHandler)]:
            logger.removeHandler(handler)
        handler = _EntryPointHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(message)s"))
        logger.addHandler(handler)
        logger.setLevel(level)
