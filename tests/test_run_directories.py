"""Measurement scripts without ``--out``: the report and a ``manifest.json`` go to a new run directory
under ``$CASCADE_HOME/runs/<script>/``. Each runs from the root of a fresh copy of the repository,
importing that copy's code, and leaves its ``git status`` empty: a run never writes into the tree.
(``train_draft.py`` is not here: it takes ``--work`` and ``--out`` and has no default to write to.)"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from cascade import kernels
from cascade.tuning import Tuning
from tests.scripts import linked_home, run_script

REPO = Path(__file__).resolve().parents[1]
TINY_GRID = {
    "defaults": {"preset": "self-spec", "document": "lcet10", "context": 300, "new_tokens": 2, "temperature": 0.0},
    "sweeps": {
        "acceptance_by_budget": {
            "vary": {"policy": ["streaming"], "budget_share": [0.2]},
            "plot": {"x": "budget_share", "y": "acceptance", "series": "policy"},
        }
    },
}
QUICKEST = [  # script, report, options ({tiny}, {grid}: filled in by the test)
    ("divergence", "divergence.json", "--context 48 --prompts 1 --new-tokens 2 --dtype float32"),
    ("agreement", "agreement.json", "--contexts 200 --budgets 0.5 --policies streaming --new-tokens 3"),
    ("evaluate_draft", "draft_evaluation.json", "--contexts 64 --evaluated 4 --new-tokens 2"),
    ("acceptance", "acceptance.json", "--contexts 200 --budgets 0.1 --policies streaming --new-tokens 4"),
    ("ablate", "runs.csv", "--grid {grid} --target {tiny}"),
    (
        "bench",
        "bench.json",
        "--impls autoregressive --contexts 96 --new-tokens 4 --repeats 1 --warmups 0 --dtype float32 --target {tiny}",
    ),
    (
        "prefix_reuse",
        "prefix_reuse.json",
        "--context 40 --questions 2 --new-tokens 2 --dtype float32 --target {tiny} --set prefill_chunk=16",
    ),
    ("roofline", "roofline.json", "--shape llama-68m --contexts 300 --repeats 1 --kernels eager"),
    ("attention_bench", "attention.json", "--keys 300 --queries 1 --nodes --repeats 1"),
    ("product_chain_bench", "product_chain.json", "--layers 1 --repeats 1"),
]
NEEDS_WEIGHT_KERNEL = {"product_chain_bench"}


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


@pytest.fixture(scope="module")
def repository_copy(tmp_path_factory) -> Path:
    """The files of this checkout (tracked, and untracked ones git does not ignore) committed in a new
    repository, so that its ``git status --porcelain`` is empty before a script runs."""
    if not (REPO / ".git").exists() or shutil.which("git") is None:
        pytest.skip("needs a git checkout and git")
    copy = tmp_path_factory.mktemp("checkout")
    for name in git("ls-files", "-z", "--cached", "--others", "--exclude-standard", cwd=REPO).split("\0"):
        if name and (REPO / name).is_file():
            (copy / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(REPO / name, copy / name)
    git("init", "-q", cwd=copy)
    git("add", "-A", cwd=copy)
    git("-c", "user.name=test", "-c", "user.email=test@localhost", "commit", "-qm", "snapshot", cwd=copy)
    assert git("status", "--porcelain", cwd=copy) == ""
    return copy


@pytest.mark.slow
@pytest.mark.parametrize("script, report, options", QUICKEST, ids=[case[0] for case in QUICKEST])
def test_a_run_writes_its_report_and_manifest_to_a_new_run_directory_and_nothing_into_the_tree(
    script, report, options, repository_copy, smollm2_dir, tiny_dir, tmp_path
):
    if script in NEEDS_WEIGHT_KERNEL and not kernels.weight_kernel_available():
        pytest.skip("cascade's weight kernel does not run here")
    home = linked_home(tmp_path / "home")
    grid = tmp_path / "grid.yaml"
    grid.write_text(json.dumps(TINY_GRID))
    options = options.format(tiny=tiny_dir, grid=grid).split()
    command = [sys.executable, f"scripts/{script}.py", *options]
    env = {**os.environ, "CASCADE_HOME": str(home), "PYTHONPATH": str(repository_copy), "PYTHONDONTWRITEBYTECODE": "1"}
    run_script(command, cwd=repository_copy, env=env)
    assert git("status", "--porcelain", "--ignored", cwd=repository_copy) == ""
    [run_dir] = (home / "runs" / script).iterdir()
    written = {path.name for path in run_dir.iterdir()}
    assert {report, "manifest.json"} <= written
    if report.endswith(".json"):
        assert json.loads((run_dir / report).read_text())
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["command"][1:] == [f"scripts/{script}.py", *options]
    assert manifest["machine"]["cpu_count"] >= 1
    assert set(manifest["machine"]["tuning"]) == {field.name for field in dataclasses.fields(Tuning)}
    assert manifest["started"] <= manifest["ended"]
