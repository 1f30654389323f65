"""The roofline script on random-weight shapes (the GPU session's cost-only figures), run small on CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from cascade import kernels
from tests.scripts import linked_home, run_script


def load_roofline_script():
    spec = importlib.util.spec_from_file_location("roofline", "scripts/roofline.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_roofline_times_every_pass_of_a_random_shape(tmp_path):
    out, rooflines = tmp_path / "roofline.json", tmp_path / "gpu.json"
    rooflines.write_text(json.dumps({"hardware": "a GPU", "bandwidth_bytes_per_s": 2e12, "matmul_flops_per_s": 5e14}))
    command = [
        sys.executable,
        "scripts/roofline.py",
        "--shape",
        "llama-68m",
        "--draft-shape",
        "llama-68m",
        "--contexts",
        "300",
        "--budget",
        "64",
        "--gamma",
        "3",
        "--draft-window",
        "28",
        "--repeats",
        "1",
        "--device",
        "cpu",
        "--kernels",
        "eager",
        "--acceptance",
        "0.8",
        "--draft-acceptance",
        "0.6",
        "--speculative-acceptance",
        "0.75",
        "--reselect",
        "mean_key",
        "attention",
        "sparq",
        "--every-pass-acceptance",
        "0.7",
        "0.9",
        "0.85",
        "--every-round-acceptance",
        "0.6",
        "0.7",
        "0.65",
        "--tree",
        "6",
        "--tree-accepted",
        "1.5",
        "2",
        "1.8",
        "--roofline-of",
        str(rooflines),
        "--out",
        str(out),
    ]
    printed = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    report = json.loads(out.read_text())
    assert report["model"] == "llama-68m" and not report["graphs"] and report["contexts"][0]["fused_tokens"] == 0
    passes = report["contexts"][0]["passes"]
    assert list(passes) == [
        "full, 1 token (autoregressive step)",
        "retrieval 64, 1 token (proposal)",
        "retrieval 64, 4 tokens (verifying the draft)",
        "full, 4 tokens (verification)",
        "retrieval 64, a tree level of 3 tokens",
        "full, a tree of 6 tokens after one (verification)",
        "retrieval 64, 1 token re-selecting (mean_key)",
        "retrieval 64, 1 token re-selecting (attention)",
        "retrieval 64, 1 token re-selecting (sparq)",
        "draft llama-68m, streaming 32, 1 token",
    ]
    full_step, proposal = passes["full, 1 token (autoregressive step)"], passes["retrieval 64, 1 token (proposal)"]
    assert proposal["bytes_read"] < full_step["bytes_read"]  # 64 prompt tokens of KV instead of 300
    token_bytes, copied = 2 * 2 * 12 * 64 * 2, 60  # K and V, 2 layers, 12 KV heads of 64, bf16; 60 kept tokens
    selections = {
        scoring: passes[f"retrieval 64, 1 token re-selecting ({scoring})"]["bytes_read"] - proposal["bytes_read"]
        for scoring in ("mean_key", "attention", "sparq")
    }
    assert selections["mean_key"] == 2 * 12 * 37 * 64 * 4 + copied * token_bytes  # float32 means of 37 chunks
    assert selections["attention"] == 296 * token_bytes // 2 + copied * token_bytes  # the keys of 37 chunks
    assert selections["sparq"] == 296 * token_bytes // 2 // 4 + copied * token_bytes  # 16 of their 64 dimensions
    assert all(row["ms"] > 0 and row["roofline_ms"] > 0 for row in passes.values())
    assert "| 300 | draft llama-68m, streaming 32, 1 token |" in printed
    ceiling = report["contexts"][0]["self_spec_ceiling"]
    assert ceiling["acceptance"] == 0.8 and 1 <= ceiling["roofline"]["gamma"] <= 3
    assert "self-spec ceiling at 300 (acceptance 0.80)" in printed
    every_pass = report["contexts"][0]["every_pass_ceilings"]
    assert list(every_pass) == ["mean_key", "attention", "sparq"] and every_pass["sparq"]["acceptance"] == 0.85
    assert (
        every_pass["attention"]["roofline"]
        == load_roofline_script().self_spec_ceiling(
            full_step,
            passes["retrieval 64, 1 token re-selecting (attention)"],
            passes["full, 4 tokens (verification)"],
            0.9,
        )["roofline"]
    )
    assert "self-spec ceiling at 300, re-selecting every pass (sparq) (acceptance 0.85)" in printed
    roofline = load_roofline_script()
    every_round = report["contexts"][0]["every_round_ceilings"]["attention"]
    selecting = passes["retrieval 64, 1 token re-selecting (attention)"]
    assert every_round["acceptance"] == 0.7 and every_round["roofline"]["speedup"] == pytest.approx(
        max(
            roofline.expected_speedup(
                0.7,
                proposal["roofline_ms"],
                max(full_step["memory_ms"], full_step["compute_ms"] * (gamma + 1))
                + selecting["roofline_ms"]
                - proposal["roofline_ms"],
                full_step["roofline_ms"],
                gamma,
            )
            for gamma in (1, 2, 3)
        )
    )
    assert "re-selecting every round (mean_key) (acceptance 0.60)" in printed
    assert report["bandwidth_bytes_per_s"] == 2e12 and report["rooflines_of"] == str(rooflines)
    assert report["contexts"][0]["bandwidth_bytes_per_s"] == 2e12  # taken as given, not measured again
    assert full_step["memory_ms"] == pytest.approx(full_step["bytes_read"] / 2e12 * 1000)
    assert printed.startswith("CPU, ") and "rooflines of a GPU" in printed.splitlines()[0]
    tree_verification = passes["full, a tree of 6 tokens after one (verification)"]
    verification = passes["full, 4 tokens (verification)"]
    assert tree_verification["bytes_read"] == verification["bytes_read"]  # the same keys, for 7 queries
    assert tree_verification["flops"] == verification["flops"] // 4 * 7
    trees = report["contexts"][0]["tree_ceilings"]
    assert trees["sparq"]["accepted_run"] == 1.8 and trees["sparq"]["nodes"] == 6 and trees["sparq"]["depth"] == 3
    assert "with trees of 6 nodes (depth 3), re-selecting every round (attention, 2.00 accepted per round)" in printed
    triforce = report["contexts"][0]["triforce_ceiling"]
    assert triforce["draft_acceptance"] == 0.6 and 0 <= triforce["measured"]["draft_gamma"] <= 3
    assert "triforce ceiling at 300 (acceptance 0.60 / 0.80)" in printed
    speculative = report["contexts"][0]["speculative_ceiling"]
    assert speculative["acceptance"] == 0.75 and 1 <= speculative["measured"]["gamma"] <= 3
    assert "speculative ceiling at 300 (acceptance 0.75)" in printed
    layers = 2 * (4 * 768 * 768 + 3 * 768 * 3072 + 2 * 768)  # attention, MLP and norms of 2 layers
    weight_bytes = 2 * (layers + 768 + 32000 * 768 + 768)  # the final norm, the output projection, one embedding row
    assert (full_step["bytes_read"] - weight_bytes) % token_bytes == 0  # the weights a pass reads, then whole tokens
    assert 300 * token_bytes <= full_step["bytes_read"] - weight_bytes <= 301 * token_bytes


def test_each_contexts_rooflines_take_the_bandwidth_measured_right_before_its_passes(tmp_path, monkeypatch):
    roofline = load_roofline_script()
    probes = iter([1e9, 2e9, 3e9])  # the start's, then one per context
    monkeypatch.setattr(roofline, "memory_bandwidth", lambda repeats, device: next(probes))
    monkeypatch.setattr(roofline, "matmul_peak", lambda dtype, repeats, device: 1e12)
    out = tmp_path / "roofline.json"
    arguments = ["--shape", "llama-68m", "--contexts", "200", "300", "--budget", "64", "--gamma", "3"]
    roofline.main([*arguments, "--repeats", "1", "--device", "cpu", "--kernels", "eager", "--out", str(out)])
    report = json.loads(out.read_text())
    assert report["bandwidth_bytes_per_s"] == 1e9
    for figures, bandwidth in zip(report["contexts"], (2e9, 3e9), strict=True):
        assert figures["bandwidth_bytes_per_s"] == bandwidth
        for row in figures["passes"].values():
            assert row["memory_ms"] == pytest.approx(row["bytes_read"] / bandwidth * 1000)


def test_the_self_spec_ceiling_is_the_best_gamma_of_the_cost_model():
    # acceptance 0.8: expected tokens per verification 1.8, 2.44, 2.952, 3.3616 at gamma 1-4
    step = {"ms": 100.0, "memory_ms": 30.0, "compute_ms": 5.0, "roofline_ms": 30.0}
    proposal = {"ms": 30.0, "roofline_ms": 10.0}
    verification = {"tokens": 7, "ms": 160.0}  # measured g + 1 tokens: 100 + 10 g ms
    ceiling = load_roofline_script().self_spec_ceiling(step, proposal, verification, 0.8)
    assert ceiling["measured"]["gamma"] == 2  # 2.44 * 100 / (2 * 30 + 120)
    assert ceiling["measured"]["speedup"] == pytest.approx(244 / 180)
    assert ceiling["roofline"]["gamma"] == 3  # 2.952 * 30 / (3 * 10 + 30): still memory-bound at 4 tokens
    assert ceiling["roofline"]["speedup"] == pytest.approx(2.952 * 30 / 60)


def test_the_speculative_ceiling_is_the_best_gamma_of_the_draft_against_the_full_cache():
    draft = {"ms": 10.0, "roofline_ms": 5.0}
    step = {"ms": 100.0, "memory_ms": 30.0, "compute_ms": 5.0, "roofline_ms": 30.0}
    verification = {"tokens": 4, "ms": 130.0}  # measured g + 1 tokens: 100 + 10 g ms
    ceiling = load_roofline_script().self_spec_ceiling(step, draft, verification, 0.8)
    assert ceiling["measured"]["gamma"] == 3  # 2.952 * 100 / (3 * 10 + 130) beats 2.44 * 100 / 140
    assert ceiling["measured"]["speedup"] == pytest.approx(295.2 / 160)
    assert ceiling["roofline"]["gamma"] == 3 and ceiling["roofline"]["speedup"] == pytest.approx(2.952 * 30 / 45)


def test_the_tree_ceiling_costs_a_selecting_root_a_pass_per_level_but_the_last_and_one_verification():
    from cascade.tree import ROOT, TokenTree

    tree = TokenTree(parents=(ROOT, ROOT, 0, 0, 2), ranks=(0, 1, 0, 1, 0))  # levels of 2, 2 and 1 nodes
    step = {"ms": 100.0, "memory_ms": 30.0, "compute_ms": 5.0, "roofline_ms": 30.0}
    proposal = {"ms": 30.0, "memory_ms": 10.0, "compute_ms": 1.0, "roofline_ms": 10.0}
    selecting = {"ms": 50.0, "roofline_ms": 20.0}
    level = {"tokens": 2, "ms": 34.0}  # measured W tokens: 30 + 4 (W - 1) ms
    verification = {"tokens": 6, "ms": 150.0}
    ceiling = load_roofline_script().tree_ceiling(step, proposal, selecting, level, verification, tree, 2.0)
    assert ceiling["measured"]["round_ms"] == 50 + 2 * 34 + 150
    assert ceiling["measured"]["speedup"] == pytest.approx(3 * 100 / 268)
    assert ceiling["roofline"]["round_ms"] == 20 + 2 * 10 + 30  # every pass memory-bound
    assert ceiling["roofline"]["speedup"] == pytest.approx(3 * 30 / 70)


def test_the_triforce_ceiling_chains_the_cost_model_through_both_tiers():
    draft = {"ms": 1.0, "roofline_ms": 0.1}
    proposal = {"ms": 30.0, "memory_ms": 10.0, "compute_ms": 1.0, "roofline_ms": 10.0}
    retrieval_verification = {"tokens": 4, "ms": 36.0}  # measured g + 1 tokens: 30 + 2 g ms
    step = {"ms": 100.0, "memory_ms": 30.0, "compute_ms": 5.0, "roofline_ms": 30.0}
    verification = {"tokens": 4, "ms": 130.0}  # 100 + 10 g ms
    ceiling = load_roofline_script().triforce_ceiling(
        draft, proposal, retrieval_verification, step, verification, 0.5, 0.8
    )
    # draft acceptance 0.5: 1.5, 1.75, 1.875 middle tokens per round at gamma 1-3; (30 + 3 g) ms a round
    middle_ms = 36 / 1.75
    assert ceiling["measured"]["draft_gamma"] == 2 and ceiling["measured"]["gamma"] == 3
    assert ceiling["measured"]["speedup"] == pytest.approx(2.952 * 100 / (3 * middle_ms + 130))
    # rooflines: (0.1 g + 10) ms a middle round (still memory-bound), the top tier's pass 30 ms at any width
    assert ceiling["roofline"]["draft_gamma"] == 3 and ceiling["roofline"]["gamma"] == 3
    assert ceiling["roofline"]["speedup"] == pytest.approx(2.952 * 30 / (3 * 10.3 / 1.875 + 30))


def test_a_useless_draft_is_bypassed_in_the_triforce_ceiling():
    draft = {"ms": 50.0, "roofline_ms": 50.0}
    proposal = {"ms": 30.0, "memory_ms": 10.0, "compute_ms": 1.0, "roofline_ms": 10.0}
    step = {"ms": 100.0, "memory_ms": 30.0, "compute_ms": 5.0, "roofline_ms": 30.0}
    ceiling = load_roofline_script().triforce_ceiling(
        draft, proposal, {"tokens": 4, "ms": 36.0}, step, {"tokens": 4, "ms": 130.0}, 0.1, 0.8
    )
    selfspec = load_roofline_script().self_spec_ceiling(step, proposal, {"tokens": 4, "ms": 130.0}, 0.8)
    assert ceiling["measured"]["draft_gamma"] == 0
    assert ceiling["measured"]["speedup"] == pytest.approx(selfspec["measured"]["speedup"])


def test_acceptances_must_match_the_contexts_and_scorings():
    command = [sys.executable, "scripts/roofline.py", "--contexts", "100", "200", "--acceptance", "0.5", "0.6", "0.7"]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 2
    assert "--acceptance takes one value or one per context (2), not 3" in result.stderr
    command = [
        sys.executable,
        "scripts/roofline.py",
        "--contexts",
        "100",
        "--acceptance",
        "0.8",
        "--draft-acceptance",
        "0.5",
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 2
    assert "--draft-acceptance needs --draft-shape" in result.stderr
    command = [
        sys.executable,
        "scripts/roofline.py",
        "--contexts",
        "100",
        "--reselect",
        "sparq",
        "--every-round-acceptance",
        "0.8",
        "0.9",
    ]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 2
    assert "--every-round-acceptance takes one value per --reselect scoring (1), got 2" in result.stderr
    command = [sys.executable, "scripts/roofline.py", "--contexts", "100", "--reselect", "sparq", "--tree", "16"]
    result = subprocess.run(command, capture_output=True, text=True)
    assert result.returncode == 2 and "--tree and --tree-accepted go together" in result.stderr


@pytest.mark.parametrize("static", [False, True], ids=["eager-views", "static-views"])
def test_attention_bench_times_every_runnable_kernel_on_each_pass_and_checks_it(static, tmp_path):
    out = tmp_path / "attention.json"
    command = [
        sys.executable,
        "scripts/attention_bench.py",
        "--keys",
        "300",
        "--queries",
        "1",
        "7",
        "--nodes",
        "20",
        "--repeats",
        "1",
        "--out",
        str(out),
        *(["--static"] if static else []),
    ]
    printed = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    report = json.loads(out.read_text())
    assert report["static"] is static
    assert [(row["pass"], row["queries"]) for row in report["rows"]] == [
        ("1 causal", 1),
        ("7 causal", 7),
        ("tree 20", 21),
    ]
    ours = {"kernel"} if kernels.attention_kernel_available() else set()  # cascade's kernel, where it builds
    runs_here = {"cpu", "sdpa", "flex", "grouped_sdpa"} | ours
    for row in report["rows"]:
        assert set(row["ms"]) == set(row["max_error"]) == runs_here  # what runs on CPU
        assert all(ms > 0 for ms in row["ms"].values()) and max(row["max_error"].values()) < 2e-2  # bf16 vs float64
    assert printed.count("\n| 300 |") == 3
    refused = subprocess.run([*command[:2], "--keys", "20", "--nodes", "31"], capture_output=True, text=True)
    assert refused.returncode == 2 and "--keys must exceed the widest pass (32 tokens)" in refused.stderr
    nothing = subprocess.run([*command[:2], "--nodes"], capture_output=True, text=True)
    assert nothing.returncode == 2 and "name at least one pass" in nothing.stderr


def test_attention_bench_takes_the_heads_of_the_shape_it_is_given(tmp_path):
    """Qwen2.5-Coder 1.5B's heads (12 sharing 2 KV heads of 128): on a CPU with AMX, the shape whose
    passes cascade's kernel takes from tiles."""
    out = tmp_path / "attention.json"
    command = [sys.executable, "scripts/attention_bench.py", "--shape", "qwen2.5-1.5b", "--keys", "300"]
    subprocess.run([*command, "--queries", "1", "9", "--nodes", "--repeats", "1", "--out", str(out)], check=True)
    report = json.loads(out.read_text())
    assert report["shape"] == {"heads": 12, "kv_heads": 2, "head_dim": 128}
    assert [row["kv_bytes"] for row in report["rows"]] == [2 * 2 * 300 * 128 * 2] * 2
    for row in report["rows"]:
        assert max(row["max_error"].values()) < 2e-2  # bf16 vs float64
    refused = subprocess.run([*command, "--shape", "llama", "--queries", "1"], capture_output=True, text=True)
    assert refused.returncode == 2 and "invalid choice: 'llama'" in refused.stderr


def test_attention_bench_times_the_kernels_asked_for_over_each_layers_keys(tmp_path):
    """--layers N: each pass reads N layers' K/V in turn (from memory, as a model's step does), its
    time reported per layer; --kernels narrows what is timed and refuses what cannot run here."""
    out = tmp_path / "attention.json"
    command = [sys.executable, "scripts/attention_bench.py", "--keys", "300", "--queries", "1", "--nodes"]
    timed = [*command, "--layers", "3", "--kernels", "cpu", "sdpa", "--repeats", "1", "--out", str(out)]
    subprocess.run(timed, check=True, capture_output=True)
    report = json.loads(out.read_text())
    assert report["layers"] == 3
    [row] = report["rows"]
    assert set(row["ms"]) == {"cpu", "sdpa"} and max(row["max_error"].values()) < 2e-2
    refused = subprocess.run([*command, "--kernels", "cpu", "warp"], capture_output=True, text=True)
    assert refused.returncode != 0 and "--kernels: warp cannot run here; these can: cpu, sdpa" in refused.stderr
    no_layers = subprocess.run([*command, "--layers", "0"], capture_output=True, text=True)
    assert no_layers.returncode == 2 and "--layers must be at least 1, got 0" in no_layers.stderr


def test_attention_bench_without_out_writes_a_run_directory_with_its_manifest(tmp_path):
    command = [
        sys.executable,
        "scripts/attention_bench.py",
        "--keys",
        "100",
        "--queries",
        "1",
        "--nodes",
        "--repeats",
        "1",
    ]
    home = linked_home(tmp_path / "home")  # the built kernels: a fresh home would build them again
    run_script(command, env={**os.environ, "CASCADE_HOME": str(home)})
    [run_dir] = (home / "runs" / "attention_bench").iterdir()
    assert [row["queries"] for row in json.loads((run_dir / "attention.json").read_text())["rows"]] == [1]
    manifest = json.loads((run_dir / "manifest.json").read_text())
    assert manifest["settings"]["keys"] == [100] and manifest["machine"]["threads"] >= 1


@pytest.mark.skipif(not kernels.weight_kernel_available(), reason="cascade's weight kernel does not run here")
def test_product_chain_bench_times_a_chain_of_layer_products_beside_one_product_of_its_bytes(tmp_path):
    """Two layers of SmolLM2's products (qkv [960, 576], o [576, 576], gate/up [3072, 576], down
    [576, 1536]) in turn, and one product of as many bytes (whole panels of 16 outputs)."""
    out = tmp_path / "chain.json"
    command = [sys.executable, "scripts/product_chain_bench.py", "--layers", "2"]
    subprocess.run([*command, "--rows", "1", "3", "--repeats", "1", "--out", str(out)], check=True)
    report = json.loads(out.read_text())
    layer_bytes = 2 * (960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536)
    assert report["products"] == 8 and report["chain_bytes"] == 2 * layer_bytes
    assert 0 <= report["one_bytes"] - report["chain_bytes"] < 2 * 16 * 576
    assert [row["rows"] for row in report["rows"]] == [1, 3]
    assert all(row["chain_ms"] > 0 and row["one_ms"] > 0 for row in report["rows"])
    assert json.loads(out.with_name("chain.manifest.json").read_text())["settings"]["layers"] == 2
    if kernels.quantised_kernels_available():  # the int8 products of a quantised draft, their scales counted
        subprocess.run([*command, "--weights", "int8", "--repeats", "1", "--out", str(out)], check=True)
        report = json.loads(out.read_text())
        assert report["weights"] == "int8" and not report["panels"]
        scales = 2 * 4 * (960 + 576 + 3072 + 576)  # float32, one an output row, 2 layers
        assert report["chain_bytes"] == layer_bytes + scales  # 2 layers of 1-byte weights: layer_bytes
    for bad, message in (("--rows 17", "the kernel takes 1 to 16 rows"), ("--layers 0", "--layers must be at least 1")):
        refused = subprocess.run([*command, *bad.split()], capture_output=True, text=True)
        assert refused.returncode == 2 and message in refused.stderr
