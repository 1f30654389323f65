"""Real-model checks on SmolLM2 (slow): the CLI's greedy output equals transformers' generate(), and
every preset's greedy output equals autoregressive decoding on a 3000-token prompt (float32)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cascade.data import document_text
from cascade.generate import DEFAULT_PROMPT
from cascade.pipeline import StopRule
from cascade.runtime import build_runtime
from configs import load_config

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("document,prompt_tokens", [("alice29", 2500), ("lcet10", 4000)])
def test_cli_greedy_equals_transformers_generate(smollm2_dir, tmp_path, document, prompt_tokens):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt_ids = tokenizer.encode(document_text(document))[:prompt_tokens]
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(tokenizer.decode(prompt_ids))
    out = tmp_path / "out.json"
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "cascade.generate",
            "--preset",
            "autoregressive",
            "--dtype",
            "float32",
            "--prompt-file",
            str(prompt_file),
            "--max-new-tokens",
            "48",
            "--json",
            str(out),
            "--quiet",
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert result.returncode == 0, result.stderr
    ours = json.loads(out.read_text())
    assert len(ours["prompt_token_ids"]) > 2000

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    expected = model.generate(torch.tensor([ours["prompt_token_ids"]]), max_new_tokens=48, do_sample=False)
    assert ours["token_ids"] == expected[0, len(ours["prompt_token_ids"]) :].tolist()


@pytest.fixture(scope="module")
def long_prompt(smollm2_dir) -> list[int]:
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    return tokenizer.encode(document_text("lcet10"))[:3000]


def smollm2_generate(smollm2_dir, preset: str, overrides: list[str], prompt: list[int]) -> list[int]:
    settings = {"dtype": "float32", "target.path": str(smollm2_dir), "draft.path": str(smollm2_dir)}
    _, config = load_config(preset, None, overrides, settings)
    runtime = build_runtime(config)
    stop = StopRule(frozenset(), 48)
    prompt_ids = torch.tensor(prompt, device=runtime.target.model.device)
    return runtime.pipeline_for(len(prompt), 48).generate(prompt_ids, stop).token_ids


@pytest.mark.parametrize(
    "preset,overrides",
    [
        ("self-spec", ["stages.0.cache.budget=512"]),
        ("triforce", ["stages.1.cache.budget=512"]),  # draft = target, reading a 256-token streaming cache
    ],
)
def test_presets_greedy_equal_autoregressive(smollm2_dir, long_prompt, preset, overrides):
    expected = smollm2_generate(smollm2_dir, "autoregressive", [], long_prompt)
    assert smollm2_generate(smollm2_dir, preset, overrides, long_prompt) == expected


def test_the_default_prompt_is_longer_than_the_default_presets_retrieval_budget(smollm2_dir):
    """So a first ``python -m cascade.generate`` speculates instead of skipping its retrieval stage."""
    _, config = load_config(None, None, [], {})
    budget = config.stages[0].cache.budget
    assert len(AutoTokenizer.from_pretrained(smollm2_dir).encode(DEFAULT_PROMPT.read_text())) > budget + 1000
