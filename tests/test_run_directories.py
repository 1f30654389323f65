"""Measurement scripts without ``--out``: the report and a ``manifest.json`` go to a new run directory
under ``$CASCADE_HOME/runs/<script>/``, and nothing is written where the script was started from."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest

from tests.scripts import linked_home, run_script

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.slow
@pytest.mark.parametrize(
    "script, report, options",
    [
        (
            "divergence",
            "divergence.json",
            ["--context", "48", "--prompts", "1", "--new-tokens", "2", "--dtype", "float32"],
        ),
        (
            "agreement",
            "agreement.json",
            ["--contexts", "200", "--budgets", "0.5", "--policies", "streaming", "--new-tokens", "3"],
        ),
        ("evaluate_draft", "draft_evaluation.json", ["--contexts", "64", "--evaluated", "4", "--new-tokens", "2"]),
    ],
)
def test_a_run_writes_its_report_and_manifest_to_a_new_run_directory(script, report, options, smollm2_dir, tmp_path):
    home = linked_home(tmp_path / "home")
    started_in = tmp_path / "work"
    started_in.mkdir()
    run_script(
        [sys.executable, str(SCRIPTS / f"{script}.py"), *options],
        cwd=started_in,
        env={**os.environ, "CASCADE_HOME": str(home)},
    )
    [run_dir] = (home / "runs" / script).iterdir()
    assert sorted(path.name for path in run_dir.iterdir()) == sorted([report, "manifest.json"])
    assert json.loads((run_dir / report).read_text())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["command"][1:] == [str(SCRIPTS / f"{script}.py"), *options]
    assert manifest["settings"]["out"] is None and manifest["machine"]["cpu_count"] >= 1
    assert manifest["started"] <= manifest["ended"]
    assert not any(started_in.iterdir())
