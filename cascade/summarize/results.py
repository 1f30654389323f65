"""The job's JSONL output: one whole line per finished document, on disk before the next one starts.

A line is written with one ``write`` on an append-only descriptor and fsync'd. A kill can still
cut a long line short; such a torn last line was never a finished document, so opening the log
removes it. A file that is not a result log, or one damaged elsewhere, is refused as it is.
A document counts as done for a job when it has a summary line with the job's config hash.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from cascade.append_only import prepare_for_append
from cascade.errors import CascadeError


class ResultLog:
    def __init__(self, path: Path) -> None:
        self.path = path
        prepare_for_append(path, self.check_line)

    def check_line(self, number: int, line: bytes, unfinished: bool) -> None:
        """A line must be a record or blank; the last one, if it has no newline, a record cut short."""
        if unfinished and not cut_short(line):
            raise self.refusal(number, "has no newline at its end and is not a record cut short")
        if not unfinished and line.strip() and not is_record(line):
            raise self.refusal(number, 'is not a JSON object with an "id"')

    def refusal(self, number: int, problem: str) -> CascadeError:
        """The error for a file with a bad line ``number``: not a result log, or a damaged one."""
        if number == 1:
            return CascadeError(f"{self.path} is not a result log: line 1 {problem}; give another --output")
        return CascadeError(
            f"{self.path}:{number} {problem}, so the result log is damaged; fix or delete that "
            "line, or give another --output"
        )

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_bytes().split(b"\n") if line.strip()]

    def done(self, config_hash: str) -> set[str]:
        """Ids summarized under ``config_hash`` (failed documents are not done: a rerun retries them)."""
        return {
            record["id"]
            for record in self.records()
            if "summary" in record and record.get("stats", {}).get("config_hash") == config_hash
        }

    def append(self, record: dict) -> None:
        line = (json.dumps(record, ensure_ascii=False) + "\n").encode("utf-8")
        descriptor = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        try:
            view = memoryview(line)
            while view:  # a regular file takes it in one write; loop in case it does not
                view = view[os.write(descriptor, view) :]
            os.fsync(descriptor)
        finally:
            os.close(descriptor)


def is_record(line: bytes) -> bool:
    """Whether ``line`` holds a record: a JSON object with an "id"."""
    try:
        record = json.loads(line.decode("utf-8"))
    except ValueError:  # not UTF-8, or not JSON
        return False
    return isinstance(record, dict) and "id" in record


def cut_short(line: bytes) -> bool:
    """Whether ``line`` could be a record a kill cut short: the start of a JSON object, not a whole one."""
    if not line.startswith(b"{"):
        return False
    try:
        json.loads(line.decode("utf-8"))
    except ValueError:  # cut inside a character, or before the object's end
        return True
    return False
