"""scripts/acceptance.py: bad input gets a specific error and exit 2, no traceback, an earlier --out kept; a rerun
continues its --out; without --out a run directory."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.scripts import linked_home

SMALL = ("--contexts", "200", "--budgets", "0.1", "--policies", "streaming", "--new-tokens", "4")
"""A sweep of one tiny cell; a test's own options come after and replace these."""


def acceptance(*args: str, **kwargs) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "scripts/acceptance.py", *SMALL, *args], capture_output=True, text=True, **kwargs
    )


def assert_refused(result: subprocess.CompletedProcess, message: str) -> None:
    assert result.returncode == 2, result.stdout
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["--gamma", "0"], "--gamma must be from 1 to 64; got 0"),
        (["--new-tokens", "0"], "--new-tokens must be from 1 to 1000000; got 0"),
        (["--tree", "64"], "--tree must be from 0 to 63; got 64"),
        (["--contexts", "200", "0"], "--contexts are prompt lengths in tokens, each >= 1; got [200, 0]"),
        (["--budgets", "0.05", "1.5"], "--budgets are shares of the prompt in (0, 1]; got [0.05, 1.5]"),
    ],
)
def test_out_of_range_options_are_refused_while_parsing(tmp_path, args, message):
    assert_refused(acceptance(*args, "--out", str(tmp_path / "acceptance.json")), message)
    assert not (tmp_path / "acceptance.json").exists()


def test_a_context_longer_than_the_document_is_an_error_not_a_traceback(smollm2_dir, tmp_path):
    result = acceptance("--contexts", "99999999", "--out", str(tmp_path / "acceptance.json"))
    assert_refused(result, "error: document 'lcet10' has only ")
    assert "99999999 were asked for" in result.stderr


@pytest.mark.parametrize(
    "text, message",
    [
        ("{not json", "cannot read {out} to continue its rows (Expecting property name"),
        ('["rows"]', "{out} is not a report of this script (settings and rows)"),
        (
            json.dumps({"settings": {"document": "lcet10", "gamma": 4}, "rows": []}),
            "{out} holds rows measured with other settings (gamma: 4",
        ),
    ],
)
def test_an_out_file_it_cannot_continue_is_refused_and_kept(tmp_path, text, message):
    out = tmp_path / "acceptance.json"
    out.write_text(text)
    result = acceptance("--out", str(out))
    assert_refused(result, f"error: {message.format(out=out)}")
    assert out.read_text() == text


@pytest.mark.slow
def test_a_rerun_keeps_measured_rows_and_fresh_measures_them_again(smollm2_dir, tmp_path):
    out = tmp_path / "acceptance.json"
    assert acceptance("--out", str(out), "--prompt-cache", "none").returncode == 0
    report = json.loads(out.read_text())
    report["rows"][0]["acceptance"] = 12345.0  # what the next runs must keep, or replace
    out.write_text(json.dumps(report))
    assert acceptance("--out", str(out), "--prompt-cache", "none").returncode == 0
    assert json.loads(out.read_text())["rows"][0]["acceptance"] == 12345.0
    assert acceptance("--out", str(out), "--prompt-cache", "none", "--fresh").returncode == 0
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 1 and 0 <= rows[0]["acceptance"] <= 1


@pytest.mark.slow
def test_without_out_the_report_and_its_manifest_go_to_a_new_run_directory(smollm2_dir, tmp_path):
    home = linked_home(tmp_path / "home")
    result = acceptance("--prompt-cache", "none", env={**os.environ, "CASCADE_HOME": str(home)})
    assert result.returncode == 0, result.stderr
    [run_dir] = (home / "runs" / "acceptance").iterdir()
    report = json.loads((run_dir / "acceptance.json").read_text())
    assert len(report["rows"]) == 1 and report["settings"]["out"] == str(run_dir / "acceptance.json")
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["settings"]["contexts"] == [200] and manifest["started"] <= manifest["ended"]
