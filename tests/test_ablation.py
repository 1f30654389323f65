"""Ablation sweeps: grid expansion, the settings of a run, the resumable CSV, where a sweep writes, and a whole
tiny sweep."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from cascade.ablation.grid import Grid, expand, load_grid, make_run
from cascade.ablation.measure import config_settings, sparse_stage
from cascade.ablation.store import RunTable
from cascade.errors import CascadeError
from tests.scripts import linked_home, run_script
from tests.test_append_only import RUN

REPO = Path(__file__).resolve().parents[1]
BASE = {"preset": "self-spec", "document": "lcet10", "context": 1000, "new_tokens": 8, "temperature": 0.0}


def test_expansion_adds_one_autoregressive_baseline_per_condition_and_runs_each_setting_once():
    grid = Grid.model_validate(
        {
            "defaults": BASE,
            "sweeps": {
                "a": {"vary": {"stages.0.gamma": [2, 4]}},
                "b": {"vary": {"stages.0.gamma": [4], "temperature": [0.0, 0.6]}},
            },
        }
    )
    runs = expand(grid)
    baselines = [run for run in runs if run.get("preset") == "autoregressive"]
    assert [run.get("temperature") for run in baselines] == [0.0, 0.6] and runs[:2] == baselines
    assert len(runs) == 2 + 3  # gamma 4 at temperature 0 is in both sweeps: one run
    assert make_run({**BASE, "stages.0.gamma": 2}).id == runs[2].id  # ids follow settings only


def test_a_bad_grid_says_what_is_wrong(tmp_path):
    path = tmp_path / "grid.yaml"
    path.write_text("defaults: {}\nsweeps: {a: {vary: {}, colour: red}}\n")
    with pytest.raises(CascadeError, match=r"invalid grid .*sweeps.a.vary: .*sweeps.a.colour: Extra inputs"):
        load_grid(path)
    with pytest.raises(CascadeError, match="a run needs preset, document"):
        make_run({"context": 5})


def test_zero_repeats_are_refused_before_any_run(tmp_path):
    command = [
        sys.executable,
        "scripts/ablate.py",
        "--repeats",
        "0",
        "--grid",
        str(tmp_path / "absent.yaml"),
        "--out",
        str(tmp_path / "out"),
    ]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--repeats must be >= 1 (measured generations per run); got 0" in result.stderr
    assert not (tmp_path / "out").exists()


def test_a_target_that_is_not_a_checkpoint_is_refused_while_parsing(tmp_path):
    command = [sys.executable, "scripts/ablate.py", "--target", str(tmp_path), "--out", str(tmp_path / "out")]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"argument --target: {tmp_path} is not a Hugging Face checkpoint: it has no config.json" in result.stderr
    assert not (tmp_path / "out").exists()


def test_policy_and_budget_share_set_the_sparse_target_stage(smollm2_dir):
    assert (sparse_stage("self-spec"), sparse_stage("triforce")) == (0, 1)
    run = make_run({**BASE, "preset": "triforce", "policy": "h2o", "budget_share": 0.1, "stages.1.gamma": 3})
    settings = config_settings(run, smollm2_dir, "float32")
    assert settings["stages.1.cache"] == {"kind": "h2o", "budget": 128, "recent": 64}  # 100 -> 128 (granule 64)
    assert settings["stages.1.optional"] is False and settings["stages.1.gamma"] == 3
    assert list(settings).index("stages.1.cache") < list(settings).index("stages.1.gamma")
    assert "target.rope_scaling" not in settings
    long = config_settings(make_run({**BASE, "context": 12000}), smollm2_dir, "float32")
    assert long["target.rope_scaling"] == {"kind": "yarn", "factor": 2.0}


def test_the_table_drops_a_torn_row_and_decodes_what_it_reads(tmp_path):
    table = RunTable(tmp_path / "runs.csv")
    table.append(RUN)
    with open(tmp_path / "runs.csv", "a") as handle:
        handle.write("r2,self-spec,lcet10,10")  # killed mid-row
    rows = RunTable(tmp_path / "runs.csv").rows()
    assert list(rows) == ["r1"] and rows["r1"]["acceptance"] == {"0:target/retrieval": 0.8}
    assert rows["r1"]["context"] == 1000.0 and rows["r1"]["budget_share"] is None


def test_out_must_name_a_new_folder_and_resume_an_earlier_sweep(tiny_dir, tmp_path):
    earlier, missing = tmp_path / "earlier", tmp_path / "missing"
    earlier.mkdir()
    (earlier / "runs.csv").write_text("")
    command = [sys.executable, "scripts/ablate.py", "--quick", "--target", str(tiny_dir)]
    for option, folder, message in [
        ("--out", earlier, f"{earlier} already holds a sweep; continue it with --resume {earlier}"),
        ("--resume", missing, f"{missing} holds no runs.csv to resume"),
    ]:
        result = subprocess.run([*command, option, str(folder)], cwd=REPO, capture_output=True, text=True)
        assert result.returncode == 2 and "Traceback" not in result.stderr
        assert f"error: {message}" in result.stderr
    assert [path.name for path in earlier.iterdir()] == ["runs.csv"] and not missing.exists()


@pytest.mark.slow
def test_a_tiny_sweep_writes_a_run_directory_then_resumes_it_with_nothing_to_do(tiny_dir, tmp_path):
    grid = tmp_path / "grid.yaml"
    grid.write_text(
        json.dumps(
            {
                "defaults": {**BASE, "context": 600, "new_tokens": 4},
                "sweeps": {
                    "acceptance_by_budget": {
                        "vary": {"policy": ["retrieval", "streaming"], "budget_share": [0.2]},
                        "plot": {"x": "budget_share", "y": "acceptance", "series": "policy"},
                    },
                    "time_split": {
                        "set": {"budget_share": 0.2},
                        "vary": {"stages.0.gamma": [2, 3]},
                        "plot": {"kind": "time_split"},
                    },
                },
            }
        )
    )
    home = linked_home(tmp_path / "home")
    env = {**os.environ, "CASCADE_HOME": str(home)}
    command = [
        sys.executable,
        "scripts/ablate.py",
        "--grid",
        str(grid),
        "--target",
        str(tiny_dir),
        "--dtype",
        "float32",
    ]
    first = run_script(command, cwd=REPO, env=env)
    assert "5 runs in grid.yaml: 0 done, 5 to go" in first.stderr
    [out] = (home / "runs" / "ablate").iterdir()
    rows = RunTable(out / "runs.csv").rows()
    assert len(rows) == 5 and all(row["tokens_per_s"] > 0 for row in rows.values())
    summary = json.loads((out / "summary.json").read_text())
    assert [entry["policy"] for entry in summary["sweeps"]["acceptance_by_budget"]] == ["retrieval", "streaming"]
    assert all(entry["speedup"] > 0 for entry in summary["sweeps"]["time_split"])
    assert sorted(Path(path).name for path in summary["plots"]) == ["acceptance_by_budget.png", "time_split.png"]
    assert all(Path(path).stat().st_size > 1000 for path in summary["plots"])
    manifest = json.loads((out / "manifest.json").read_text())
    assert manifest["settings"]["grid"] == str(grid) and manifest["started"] <= manifest["ended"]

    again = run_script([*command, "--resume", str(out)], cwd=REPO, env=env)
    assert "5 runs in grid.yaml: 5 done, 0 to go" in again.stderr
    assert list((home / "runs" / "ablate").iterdir()) == [out]
