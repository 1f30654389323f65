"""scripts/bench.py end to end on tiny checkpoints: presets with overrides side by side,
transformers continuing from the prompt K/V the cascade cases stored, and llama.cpp beside them
(where it is built)."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys

import pytest
from safetensors import safe_open

from cascade.peers.llamacpp import installed_build
from cascade.runs import run_files
from tests.scripts import linked_home, run_script

QUICK_RUN = ["--contexts", "96", "--new-tokens", "8", "--repeats", "1", "--warmups", "0"]
"""One round of 8 new tokens after 96, no warm-ups: the shortest run the bench tests make."""


def test_bench_compares_overridden_presets_and_continues_transformers_from_stored_prompts(
    tmp_path, tiny_dir, tiny_draft_dir
):
    home = linked_home(tmp_path / "home")  # no --out: the report goes to a new run directory under $CASCADE_HOME/runs
    command = [
        sys.executable,
        "scripts/bench.py",
        "--impls",
        "autoregressive",
        "speculative+stages.0.gamma=2",
        "transformers",
        *QUICK_RUN,
        "--dtype",
        "float32",
        "--target",
        str(tiny_dir),
        "--draft",
        str(tiny_draft_dir),
        "--prompt-cache",
        str(tmp_path / "prompts"),
    ]
    run_script(command, env={**os.environ, "CASCADE_HOME": str(home)})
    [run_dir] = (home / "runs" / "bench").iterdir()
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["command"][1:3] == ["scripts/bench.py", "--impls"] and manifest["machine"]["cpu_count"] >= 1
    assert manifest["settings"]["contexts"] == [96] and manifest["started"] <= manifest["ended"]
    report = json.loads((run_dir / "bench.json").read_text())
    assert report["runs"][0]["runs"][0]["bandwidth_bytes_per_s"] > 0
    assert report["runs"][0]["step_roofline_tokens_per_s"] is None  # float32: not priced
    runs = {run["preset"]: run for run in report["runs"]}
    assert list(runs) == ["autoregressive", "speculative+stages.0.gamma=2", "transformers"]
    # the preset's process also decoded autoregressively on the same loaded target
    speculative = runs["speculative+stages.0.gamma=2"]
    twin = speculative["runs"][0]
    before, after = twin["same_process_autoregressive_runs_tokens_per_s"]  # decoded before and after the case
    assert twin["same_process_autoregressive_tokens_per_s"] == pytest.approx(2 / (1 / before + 1 / after))
    assert speculative["speedup_in_same_process"] == pytest.approx(
        speculative["decode_tokens_per_s"] / speculative["runs"][0]["same_process_autoregressive_tokens_per_s"]
    )
    assert runs["autoregressive"]["speedup_in_same_process"] is None
    expected = runs["autoregressive"]["token_ids"]
    assert len(expected) == 8
    assert runs["speculative+stages.0.gamma=2"]["token_ids"] == expected  # lossless, gamma overridden
    assert runs["speculative+stages.0.gamma=2"]["runs"][0]["stats"]["stages"][0]["mean_gamma"] <= 2
    # transformers' decode continued from our stored prompt K/V: the same tokens in float32
    assert runs["transformers"]["token_ids"] == expected
    assert runs["transformers"]["prefill_tokens_per_s"] is None  # not prefilled: loaded


@pytest.mark.parametrize("pass_costs", ["cold", "carried"])
def test_bench_measures_a_first_request_cold_or_one_that_starts_from_a_warm_up_requests_pass_costs(
    tmp_path, tiny_dir, tiny_draft_dir, pass_costs
):
    """At any context: a cold case's warm-ups run on prompts too short for their pass costs to carry
    (so its cost model prices its passes from nothing), a carried case's on the measured prompt."""
    out = tmp_path / "bench.json"
    quick = ["--contexts", "96", "--new-tokens", "8", "--repeats", "1", "--warmups", "1"]
    run_script(
        [
            *(sys.executable, "scripts/bench.py", "--impls", "speculative", *quick, "--pass-costs", pass_costs),
            *("--dtype", "float32", "--target", str(tiny_dir), "--draft", str(tiny_draft_dir), "--out", str(out)),
        ]
    )
    report = json.loads(out.read_text())
    assert report["settings"]["pass_costs"] == pass_costs
    draft = report["runs"][0]["runs"][0]["stats"]["stages"][0]
    assert draft["costs_carried"] == (pass_costs == "carried")


@pytest.mark.parametrize("impl", ["transformers", "llama.cpp"])
def test_bench_rejects_overrides_on_implementations_other_than_presets(impl):
    command = [sys.executable, "scripts/bench.py", "--impls", f"{impl}+stages.0.gamma=2"]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 2
    assert "expected one of autoregressive" in result.stderr


@pytest.mark.llamacpp
@pytest.mark.skipif(installed_build() is None, reason="llama.cpp is not built (python -m cascade.peers build)")
@pytest.mark.parametrize("flash_attn, settings", [("both", {"off", "on"}), ("on", {"on"})])
def test_bench_measures_llama_cpp_beside_cascade_and_reports_the_ratios_to_it(tmp_path, tiny_dir, flash_attn, settings):
    home = linked_home(tmp_path / "home")  # with the built tools; the tiny checkpoint's GGUF goes here
    (home / "peers").mkdir()
    (home / "peers" / installed_build().root.name).symlink_to(installed_build().root)
    out = tmp_path / "bench.json"
    command = [
        sys.executable,
        "scripts/bench.py",
        "--impls",
        "autoregressive",
        "llama.cpp",
        "llama.cpp-speculative",
        *QUICK_RUN,
        "--dtype",
        "bfloat16",
        "--target",
        str(tiny_dir),
        "--draft",
        str(tiny_dir),
        "--llama-flash-attn",
        flash_attn,
        "--sampling",
        "greedy",
        "sample",
        "--out",
        str(out),
    ]
    run_script(command, env={**os.environ, "CASCADE_HOME": str(home)})
    report = json.loads(out.read_text())
    peer, peer_sampled = (run for run in report["runs"] if run["preset"] == "llama.cpp")
    assert peer_sampled["sampling"] == "sample" and peer_sampled["runs"] == peer["runs"]  # llama-bench samples nothing
    assert peer["decode_tokens_per_s"] > 0 and peer["prefill_tokens_per_s"] > 0 and peer["token_ids"] == []
    assert set(peer["flash_attn"]) == settings and peer["dtype"] == "bf16"  # each case runs the settings asked for
    assert peer["runs"][0]["build_commit"] == report["machine"]["llama_cpp"]["llama_cpp_commit"]
    row = next(row for row in report["ratios_to_llama_cpp"]["llama.cpp"] if row["preset"] == "autoregressive")
    assert row["same_prefix_tokens"] is None
    assert row["decode_tokens_per_s"] == pytest.approx(
        report["runs"][0]["decode_tokens_per_s"] / peer["decode_tokens_per_s"]
    )
    assert (home / "peers" / "gguf" / "llama-bf16.gguf").is_file()
    # both priced at the bytes of a bf16 step of the same checkpoint, read at the round's bandwidth
    ours = report["runs"][0]
    with safe_open(tiny_dir / "model.safetensors", "pt") as weights:  # tied: the embedding once, read whole
        weight_bytes = 2 * sum(math.prod(weights.get_slice(name).get_shape()) for name in weights.keys())
    kv_bytes = ours["runs"][0]["step_bytes"] - weight_bytes  # 2 layers x 2 heads x 16 dims, K and V, ~100 keys
    assert 2 * 2 * 16 * 2 * 2 * 96 <= kv_bytes <= 2 * 2 * 16 * 2 * 2 * 104
    assert peer["step_roofline_tokens_per_s"] == ours["step_roofline_tokens_per_s"] > 0
    assert peer["decode_over_step_roofline"] == pytest.approx(
        peer["decode_tokens_per_s"] / peer["step_roofline_tokens_per_s"]
    )
    speculative = next(run for run in report["runs"] if run["preset"] == "llama.cpp-speculative")
    assert speculative["decode_tokens_per_s"] > 0 and speculative["acceptance"]["draft"] == 1.0  # draft = target


@pytest.mark.parametrize(
    "option, value, least",
    [("--warmups", "-1", 0), ("--repeats", "0", 1), ("--new-tokens", "1", 2), ("--contexts", "0", 1)],
)
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
    command = [
        sys.executable,
        "scripts/bench.py",
        "--impls",
        "speculative",
        option,
        str(tmp_path / "absent"),
        "--out",
        str(out),
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"argument {option}: model directory {tmp_path / 'absent'} does not exist" in result.stderr
    assert not out.exists()


def load_bench_script():
    spec = importlib.util.spec_from_file_location("bench", "scripts/bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def measurement(round_: int, decode: float) -> dict:
    """A case's measurement as a case's process reports it, reduced to what the report reads."""
    run = {"decode_tokens_per_s": decode, "prefill_tokens_per_s": 100.0, "peak_rss_mb": 500.0}
    return {"run": run | {"round": round_, "bandwidth_bytes_per_s": 3e10}, "token_ids": [5, 6, 7]}


def test_bench_report_written_mid_round_keeps_the_cases_measured_and_pairs_ratios_by_round(tmp_path):
    bench = load_bench_script()
    out = tmp_path / "bench.json"
    args = bench.parse_args(["--impls", "autoregressive", "self-spec", "--contexts", "96", "--repeats", "2"])
    args.files, args.llama_cpp = run_files("bench", out, "bench.json"), None
    base, preset = ("autoregressive", 96, "greedy"), ("self-spec", 96, "greedy")
    # the second round runs in reverse: its preset was measured, its baseline not yet
    rounds = [{base: measurement(0, 10.0), preset: measurement(0, 15.0)}, {preset: measurement(1, 30.0)}]
    bench.write_report(args, [base, preset], rounds, final=False)
    report = json.loads(out.read_text())
    assert (report["rounds_done"], report["cases_measured"]) == (1, 3)
    runs = {run["preset"]: run for run in report["runs"]}
    assert [case["round"] for case in runs["self-spec"]["runs"]] == [0, 1]
    assert runs["self-spec"]["tokens_per_s"] == 22.5  # the median of both rounds
    [ratio] = report["ratios"]
    assert ratio["per_round"]["decode_tokens_per_s"] == [1.5]  # round 1's preset has no baseline beside it
    # cut off in the first case of the first round: that case alone, no ratio
    bench.write_report(args, [base, preset], [{preset: measurement(0, 15.0)}], final=False)
    report = json.loads(out.read_text())
    assert [run["preset"] for run in report["runs"]] == ["self-spec"] and report["ratios"] == []
    assert (report["rounds_done"], report["cases_measured"]) == (0, 1)


def test_bench_report_of_a_prefill_only_llama_cpp_case_compares_prefill_and_leaves_decode_untimed(tmp_path):
    bench = load_bench_script()
    out = tmp_path / "bench.json"
    argv = ["--impls", "autoregressive", "llama.cpp", "--contexts", "96", "--llama-prefill-only"]
    args = bench.parse_args(argv)
    args.files, args.llama_cpp = run_files("bench", out, "bench.json"), None
    ours, peer = ("autoregressive", 96, "greedy"), ("llama.cpp", 96, "greedy")
    prefill_only = measurement(0, None)
    prefill_only["run"]["prefill_tokens_per_s"], prefill_only["token_ids"] = 50.0, []
    _, ratio_rows, _ = bench.write_report(args, [ours, peer], [{ours: measurement(0, 10.0), peer: prefill_only}])
    report = json.loads(out.read_text())
    assert report["settings"]["llama_prefill_only"] and not report["settings"]["llama_decode_only"]
    peer_run = next(run for run in report["runs"] if run["preset"] == "llama.cpp")
    assert peer_run["tokens_per_s"] is None and peer_run["ms_per_token"] is None
    assert peer_run["decode_over_step_roofline"] is None
    [row] = report["ratios_to_llama_cpp"]["llama.cpp"]
    assert (row["decode_tokens_per_s"], row["prefill_tokens_per_s"]) == (None, 2.0)  # 100 / 50
    assert "| 96 | greedy | llama.cpp | not timed | 50.0 | 500 | not timed |" in bench.table(report["runs"], ratio_rows)


def test_bench_refuses_llama_cpp_cases_both_prefill_only_and_decode_only(tmp_path):
    out = tmp_path / "bench.json"
    flags = ["--llama-prefill-only", "--llama-decode-only"]
    command = [sys.executable, "scripts/bench.py", "--impls", "llama.cpp", *flags, "--out", str(out)]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "not allowed with argument --llama-prefill-only" in result.stderr
    assert not out.exists()


def predicting(round_: int, decode: float, predicted: float) -> dict:
    """A speculating preset's measurement: two stages, the cost model's prediction in its stats."""
    case = measurement(round_, decode)
    stages = [{"name": "target/retrieval", "acceptance_rate": 0.8}, {"name": "target/full", "acceptance_rate": 1.0}]
    case["run"]["stats"] = {"stages": stages, "predicted_speedup": predicted}
    return case


def test_bench_report_sets_each_presets_prediction_beside_its_measured_speedup_and_lists_those_far_off(tmp_path):
    bench = load_bench_script()
    out = tmp_path / "bench.json"
    impls = ["autoregressive", "self-spec", "triforce"]
    args = bench.parse_args(["--impls", *impls, "--contexts", "96", "--repeats", "2"])
    args.files, args.llama_cpp = run_files("bench", out, "bench.json"), None
    base, close, far = ((impl, 96, "greedy") for impl in impls)
    rounds = [  # self-spec: predicted 1.4 for 1.5 measured, then 2.0 for 1.2; triforce: 3.0 for 1.5 twice
        {base: measurement(index, 10.0), close: predicting(index, decode, predicted), far: predicting(index, 15.0, 3.0)}
        for index, (decode, predicted) in enumerate([(15.0, 1.4), (12.0, 2.0)])
    ]
    runs, ratio_rows, _ = bench.write_report(args, [base, close, far], rounds)
    report = json.loads(out.read_text())
    predicted = {run["preset"]: run["predicted_speedup"] for run in report["runs"]}
    assert predicted == {"autoregressive": None, "self-spec": pytest.approx(1.7), "triforce": 3.0}
    errors = {row["preset"]: row["predicted_over_measured"] for row in report["ratios"]}
    assert errors == {"self-spec": pytest.approx((1.4 / 1.5 + 2.0 / 1.2) / 2), "triforce": pytest.approx(2.0)}
    assert report["prediction_tolerance"] == 1.5
    assert report["predictions_off"] == [
        {"preset": "triforce", "context": 96, "sampling": "greedy", "predicted_over_measured": pytest.approx(2.0)}
    ]
    lines = bench.table(runs, ratio_rows).splitlines()
    cells = [[cell.strip() for cell in line.strip("|").split("|")] for line in lines]
    column = cells[0].index("predicted speed-up")
    predicted_cells = {row[2]: row[column] for row in cells[2:]}
    assert predicted_cells == {"autoregressive": "", "self-spec": "1.70x", "triforce": "3.00x"}
