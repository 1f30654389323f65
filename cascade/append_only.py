"""Files written one whole line at a time (job results, sweep rows), which a kill can cut short.

Only the writer knows what its lines look like, so it passes a check of them: a file is changed only
after every line has passed, and one that the writer did not make is refused as it is.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from cascade.errors import CascadeError

LineCheck = Callable[[int, bytes, bool], None]
"""``check(number, line, unfinished)`` raises CascadeError unless line ``number`` (from 1, without its
newline) could be the writer's; ``unfinished``: it is the last line and has no newline."""


def prepare_for_append(path: Path, check: LineCheck) -> None:
    """Make sure ``path`` can be appended to (creating it) and ``check`` accepts each of its lines, then
    cut a last line that has no newline (a write a kill interrupted: never a finished record)."""
    create_appendable(path)
    data = path.read_bytes()
    *finished, unfinished = data.split(b"\n")
    for number, line in enumerate(finished, start=1):
        check(number, line, False)
    if unfinished:
        check(len(finished) + 1, unfinished, True)
        with open(path, "r+b") as handle:
            handle.truncate(len(data) - len(unfinished))


def create_appendable(path: Path) -> None:
    """Create ``path`` (and its folder) unless it exists; CascadeError if it cannot be appended to."""
    if path.is_dir():
        raise CascadeError(f"{path} is a directory; give a file path")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CascadeError(f"cannot create the folder {path.parent} for {path}: {exc.strerror or exc}") from None
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644))
    except OSError as exc:
        raise CascadeError(
            f"cannot append to {path}: {exc.strerror or exc}; give a file in a writable folder"
        ) from None
