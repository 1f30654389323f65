"""The sweep's CSV: one row per finished run, appended and synced, so a killed sweep resumes."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

from cascade.ablation.grid import RUN_KEYS
from cascade.append_only import prepare_for_append
from cascade.errors import CascadeError

COLUMNS = (
    "run_id",
    *RUN_KEYS,
    "settings",
    "tokens_per_s",
    "ms_per_token",
    "prefill_s",
    "tokens_per_verify",
    "predicted_speedup",
    "acceptance",
    "mean_accepted_run",
    "stage_time_s",
    "wall_s",
)
NUMBERS = (
    "context",
    "new_tokens",
    "temperature",
    "budget_share",
    "tokens_per_s",
    "ms_per_token",
    "prefill_s",
    "tokens_per_verify",
    "predicted_speedup",
    "wall_s",
)
JSON_COLUMNS = ("settings", "acceptance", "mean_accepted_run", "stage_time_s")
HEADER = ",".join(COLUMNS)


class RunTable:
    def __init__(self, path: Path) -> None:
        self.path = path
        prepare_for_append(path, self.check_line)  # a row cut short by a kill: that run never finished

    def check_line(self, number: int, line: bytes, unfinished: bool) -> None:
        """The header, then rows of every column; a last line without newline may be the start of either."""
        text = line.decode("utf-8", errors="replace").removesuffix("\r")
        if number == 1 and not (HEADER.startswith(text) if unfinished else text == HEADER):
            raise CascadeError(
                f"{self.path} is not a sweep table: its first line is not the header {HEADER}; "
                "move it away or give another --out"
            )
        if number > 1 and not unfinished and len(next(csv.reader([text]))) != len(COLUMNS):
            raise CascadeError(
                f"{self.path}:{number} is not a row of {len(COLUMNS)} columns, so the sweep table "
                "is damaged; fix or delete that line, or give another --out"
            )

    def rows(self) -> dict[str, dict[str, Any]]:
        """Finished runs by id, numbers and JSON columns decoded."""
        with open(self.path, newline="") as handle:
            return {row["run_id"]: decode(row) for row in csv.DictReader(handle)}

    def append(self, row: dict[str, Any]) -> None:
        new = not self.path.exists() or self.path.stat().st_size == 0
        with open(self.path, "a", newline="") as handle:
            writer = csv.DictWriter(handle, fieldnames=COLUMNS)
            if new:
                writer.writeheader()
            writer.writerow(row)
            handle.flush()
            os.fsync(handle.fileno())


def decode(row: dict[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = dict(row)
    for key in NUMBERS:
        out[key] = float(row[key]) if row.get(key) not in (None, "") else None
    for key in JSON_COLUMNS:
        out[key] = json.loads(row[key]) if row.get(key) else {}
    return out
