"""The job's JSONL output: one whole line per finished document, on disk before the next one starts.

A line is written with one ``write`` on an append-only descriptor and fsync'd. A kill can still
cut a long line short; such a torn last line was never a finished document, so opening the log
removes it. A document counts as done for a job when it has a summary line with the job's config hash.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cascade.append_only import drop_torn_line


class ResultLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        drop_torn_line(path)

    def records(self) -> list[dict]:
        if not self.path.exists():
            return []
        return [json.loads(line) for line in self.path.read_text(encoding="utf-8").splitlines() if line.strip()]

    def done(self, config_hash: str) -> set[str]:
        """Ids summarized under ``config_hash`` (failed documents are not done: a rerun retries them)."""
        return {record["id"] for record in self.records()
                if "summary" in record and record.get("stats", {}).get("config_hash") == config_hash}

    def append(self, record: dict) -> None:
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(line)
            while view:  # a regular file takes it in one write; loop in case it does not
                view = view[os.write(descriptor, view):]
            os.fsync(descriptor)
        finally:
            os.close(descriptor)
