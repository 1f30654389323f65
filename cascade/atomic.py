"""Files written whole or not at all: a reader never sees half a file, and an old file survives a
failed write."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

PARTIAL = ".partial-"
"""What the name of a file or directory being written carries, before the writer's process id."""


def partial_path(path: Path) -> Path:
    """The temporary file beside ``path`` that ``replacing`` writes to (one per process)."""
    return path.with_name(f".{path.name}{PARTIAL}{os.getpid()}")


@contextlib.contextmanager
def replacing(path: Path) -> Iterator[Path]:
    """Yields a temporary path beside ``path`` to write; when the block ends it is renamed onto
    ``path``, or removed if the block raised."""
    partial = partial_path(path)
    try:
        yield partial
        os.replace(partial, path)
    except BaseException:
        with contextlib.suppress(OSError):
            partial.unlink(missing_ok=True)
        raise


def write_text(path: Path, text: str) -> None:
    """``path.write_text(text)`` (UTF-8), atomically."""
    with replacing(path) as partial:
        partial.write_text(text, encoding="utf-8")
