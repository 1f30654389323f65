"""Atomic writes: a file is replaced whole, or left as it was."""

from __future__ import annotations

import pytest

from cascade import atomic


def test_a_write_replaces_the_file_and_leaves_no_partial(tmp_path):
    path = tmp_path / "report.json"
    path.write_text("old")
    atomic.write_text(path, "new")
    assert path.read_text() == "new" and [p.name for p in tmp_path.iterdir()] == ["report.json"]


def test_a_failed_write_keeps_the_old_file_and_removes_its_partial(tmp_path):
    path = tmp_path / "report.json"
    path.write_text("old")
    with pytest.raises(RuntimeError), atomic.replacing(path) as partial:
        partial.write_text("half")
        assert partial.parent == tmp_path and partial.name.startswith(".report.json" + atomic.PARTIAL)
        raise RuntimeError("interrupted")
    assert path.read_text() == "old" and [p.name for p in tmp_path.iterdir()] == ["report.json"]
