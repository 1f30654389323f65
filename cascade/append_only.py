"""Files written one whole line at a time (job results, sweep rows), which a kill can cut short."""

from __future__ import annotations

from pathlib import Path


def drop_torn_line(path: Path) -> None:
    """Cut a last line that has no newline (a write a kill interrupted: never a finished record)."""
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with open(path, "r+b") as handle:
            handle.truncate(data.rfind(b"\n") + 1)
