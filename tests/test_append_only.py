"""Append-only files refuse what their writer did not make, untouched, and cut only a torn last line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from cascade.ablation.store import COLUMNS, RunTable
from cascade.errors import CascadeError

RUN = {
    "run_id": "r1",
    "preset": "self-spec",
    "document": "lcet10",
    "context": 1000,
    "new_tokens": 16,
    "temperature": 0.0,
    "policy": "",
    "budget_share": "",
    "settings": "{}",
    "tokens_per_s": 10.0,
    "ms_per_token": 100.0,
    "prefill_s": 1.0,
    "tokens_per_verify": 2.0,
    "predicted_speedup": 1.5,
    "acceptance": json.dumps({"0:target/retrieval": 0.8}),
    "mean_accepted_run": "{}",
    "stage_time_s": "{}",
    "wall_s": 3.0,
}


def header_and_row(tmp_path: Path) -> list[bytes]:
    """The lines (without newlines) of a table holding RUN, as RunTable writes them."""
    path = tmp_path / "written.csv"
    RunTable(path).append(RUN)
    return path.read_bytes().split(b"\r\n")[:2]


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda header, row: b"name,score\r\nada,3\r\nbob,", "is not a sweep table: its first line is not the header"),
        (lambda header, row: b"notes without a newline", "is not a sweep table"),
        (
            lambda header, row: b"\r\n".join([header, row[:30], row, b"r2,self"]),
            f"runs.csv:2 is not a row of {len(COLUMNS)} columns, so the sweep table is damaged; "
            "fix or delete that line",
        ),
    ],
)
def test_a_file_that_is_not_an_intact_sweep_table_is_refused_as_it_is(tmp_path, damage, message):
    path = tmp_path / "runs.csv"
    content = damage(*header_and_row(tmp_path))
    path.write_bytes(content)
    with pytest.raises(CascadeError, match=message):
        RunTable(path)
    assert path.read_bytes() == content


def test_a_header_or_row_cut_short_is_removed(tmp_path):
    header, row = header_and_row(tmp_path)
    path = tmp_path / "runs.csv"
    path.write_bytes(header[:12])  # killed while writing the header
    assert RunTable(path).rows() == {} and path.read_bytes() == b""
    path.write_bytes(b"\r\n".join([header, row, b"r2,self-spec,lcet"]))
    rows = RunTable(path).rows()
    assert list(rows) == ["r1"] and rows["r1"]["acceptance"] == {"0:target/retrieval": 0.8}
    assert path.read_bytes() == header + b"\r\n" + row + b"\r\n"


def test_a_directory_is_refused(tmp_path):
    with pytest.raises(CascadeError, match="is a directory; give a file path"):
        RunTable(tmp_path)
