"""Real-model checks on SmolLM2 (slow): the CLI's greedy output equals transformers' generate()."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from cascade.data import document_text

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("document,prompt_tokens", [("alice29", 2500), ("lcet10", 4000)])
def test_cli_greedy_equals_transformers_generate(smollm2_dir, tmp_path, document, prompt_tokens):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    prompt_ids = tokenizer.encode(document_text(document))[:prompt_tokens]
    prompt_file = tmp_path / "prompt.txt"
    prompt_file.write_text(tokenizer.decode(prompt_ids))
    out = tmp_path / "out.json"
    result = subprocess.run(
        [sys.executable, "-m", "cascade.generate", "--preset", "autoregressive", "--dtype", "float32",
         "--prompt-file", str(prompt_file), "--max-new-tokens", "48", "--json", str(out), "--quiet"],
        capture_output=True, text=True, timeout=900,
    )
    assert result.returncode == 0, result.stderr
    ours = json.loads(out.read_text())
    assert len(ours["prompt_token_ids"]) > 2000

    model = AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32)
    expected = model.generate(torch.tensor([ours["prompt_token_ids"]]), max_new_tokens=48, do_sample=False)
    assert ours["token_ids"] == expected[0, len(ours["prompt_token_ids"]):].tolist()
