"""scripts/bench.py end to end on tiny checkpoints: presets with overrides side by side, and
transformers continuing from the prompt K/V the cascade cases stored."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest


def test_bench_compares_overridden_presets_and_continues_transformers_from_stored_prompts(
        tmp_path, tiny_dir, tiny_draft_dir):
    out = tmp_path / "bench.json"
    command = [sys.executable, "scripts/bench.py", "--impls", "autoregressive", "speculative+stages.0.gamma=2",
               "transformers", "--contexts", "96", "--new-tokens", "8", "--repeats", "1", "--warmups", "0",
               "--dtype", "float32", "--target", str(tiny_dir), "--draft", str(tiny_draft_dir),
               "--prompt-cache", str(tmp_path / "prompts"), "--out", str(out)]
    subprocess.run(command, capture_output=True, text=True, check=True)
    runs = {run["preset"]: run for run in json.loads(out.read_text())["runs"]}
    assert list(runs) == ["autoregressive", "speculative+stages.0.gamma=2", "transformers"]
    expected = runs["autoregressive"]["token_ids"]
    assert len(expected) == 8
    assert runs["speculative+stages.0.gamma=2"]["token_ids"] == expected  # lossless, gamma overridden
    assert runs["speculative+stages.0.gamma=2"]["runs"][0]["stats"]["stages"][0]["mean_gamma"] <= 2
    # transformers' decode continued from our stored prompt K/V: the same tokens in float32
    assert runs["transformers"]["token_ids"] == expected
    assert runs["transformers"]["prefill_tokens_per_s"] is None  # not prefilled: loaded


def test_bench_rejects_overrides_on_transformers():
    command = [sys.executable, "scripts/bench.py", "--impls", "transformers+stages.0.gamma=2"]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 2
    assert "expected one of autoregressive" in result.stderr


@pytest.mark.parametrize("option, value, least", [("--warmups", "-1", 0), ("--repeats", "0", 1),
                                                  ("--new-tokens", "1", 2), ("--contexts", "0", 1)])
def test_bench_refuses_counts_below_their_least(tmp_path, option, value, least):
    out = tmp_path / "bench.json"
    command = [sys.executable, "scripts/bench.py", "--impls", "autoregressive", option, value, "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{option} must be >= {least}; got {value}" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("option", ["--target", "--draft"])
def test_bench_refuses_a_checkpoint_directory_that_is_not_one_while_parsing(tmp_path, option):
    out = tmp_path / "bench.json"
    command = [sys.executable, "scripts/bench.py", "--impls", "speculative", option, str(tmp_path / "absent"),
               "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"argument {option}: model directory {tmp_path / 'absent'} does not exist" in result.stderr
    assert not out.exists()
