"""Prefix reuse: a prompt that begins as a stored one loads the whole passes they share and
prefills the rest, and everything after is bitwise what a cold run computes."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from cascade import LLM
from tests.test_prompt_cache import PROMPT, prefilled, runtime_for

CHUNK = 16
OTHER = [(11 * i) % 250 + 40 for i in range(13)]
"""Tokens no prompt of these tests begins with: a question after a shared document."""

PRESETS = {  # each preset at the tiny models' scale: caches smaller than the prompts
    "autoregressive": {},
    "speculative": {},
    "self-spec": {"stages.0.cache.budget": 16, "stages.0.cache.chunk_size": 4},
    "triforce": {
        "stages.0.cache.sinks": 2,
        "stages.0.cache.window": 12,
        "stages.1.cache.budget": 16,
        "stages.1.cache.chunk_size": 4,
    },
}


def sharing(length: int) -> list[int]:
    """A prompt that shares PROMPT's first ``length`` tokens, then goes its own way."""
    return PROMPT[:length] + OTHER


def expected_reuse(prompt: list[int]) -> int:
    """The whole passes of the tokens ``prompt`` shares with PROMPT, before its last pass (which
    gives the logits)."""
    shared = next((i for i, (a, b) in enumerate(zip(prompt, PROMPT)) if a != b), min(len(prompt), len(PROMPT)))
    return min(shared // CHUNK, (len(prompt) - 1) // CHUNK) * CHUNK


@pytest.mark.parametrize("prompt", [sharing(n) for n in (1, 15, 16, 17, 31, 32, 33, 40)] + [PROMPT[:33], PROMPT[:32]])
def test_the_shared_passes_are_loaded_and_the_rest_computed_bitwise_as_a_cold_prefill(
    tmp_path, tiny_dir, tiny_draft_dir, prompt
):
    prefilled(runtime_for(tiny_dir, tiny_draft_dir, tmp_path))  # stores PROMPT
    reusing, logits = prefilled(runtime_for(tiny_dir, tiny_draft_dir, tmp_path), prompt)
    cold, cold_logits = prefilled(runtime_for(tiny_dir, tiny_draft_dir, None), prompt)
    assert reusing.stats.prefill_reused == expected_reuse(prompt)
    assert not reusing.stats.prefill_loaded
    assert reusing.cache.length == reusing.cache.committed == len(prompt)
    held = slice(0, len(prompt))
    assert torch.equal(reusing.cache.keys[..., held, :], cold.cache.keys[..., held, :])
    assert torch.equal(reusing.cache.values[..., held, :], cold.cache.values[..., held, :])
    assert torch.equal(logits, cold_logits)
    again, again_logits = prefilled(runtime_for(tiny_dir, tiny_draft_dir, tmp_path), prompt)
    assert again.stats.prefill_loaded and torch.equal(again_logits, cold_logits)  # stored whole now


@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_generates_after_a_reused_prefix_what_it_generates_cold(
    tmp_path, tiny_dir, tiny_draft_dir, preset
):
    settings = dict(target=tiny_dir, draft=tiny_draft_dir, dtype="float32", prefill_chunk=CHUNK, **PRESETS[preset])
    questions = [sharing(20), sharing(33), PROMPT[:39] + OTHER[:2]]
    reusing = LLM(preset, prompt_cache__dir=str(tmp_path), **settings)
    cold = LLM(preset, reuse_prompts=False, **settings)
    reusing.generate(PROMPT, max_new_tokens=4)  # the document, stored
    for question in questions:
        reused = reusing.generate(question, max_new_tokens=12, ignore_eos=True)
        assert reused.token_ids == cold.generate(question, max_new_tokens=12, ignore_eos=True).token_ids
        assert reused.stats["stages"][-1]["prefill_reused"] == expected_reuse(question) > 0


REUSER = """
import json, sys
from cascade import LLM
target, draft, store, prompts = sys.argv[1:5]
llm = LLM("speculative", target=target, draft=draft, dtype="float32", prefill_chunk=16, prompt_cache__dir=store)
outputs = [llm.generate(prompt, max_new_tokens=6, ignore_eos=True).token_ids for prompt in json.loads(prompts) * 3]
print(json.dumps(outputs))
"""


def test_two_processes_sharing_the_store_at_once_both_get_cold_results(tmp_path, tiny_dir, tiny_draft_dir):
    prompts = [PROMPT, sharing(17), sharing(33), PROMPT[:35]]
    command = [sys.executable, "-c", REUSER, str(tiny_dir), str(tiny_draft_dir), str(tmp_path), json.dumps(prompts)]
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in "ab"]
    results = [process.communicate(timeout=600) for process in processes]
    for process, (_, stderr) in zip(processes, results):
        assert process.returncode == 0, stderr
        assert "unusable" not in stderr and "could not store" not in stderr, stderr
    cold = LLM(
        "speculative", target=tiny_dir, draft=tiny_draft_dir, dtype="float32", prefill_chunk=16, reuse_prompts=False
    )
    expected = [cold.generate(prompt, max_new_tokens=6, ignore_eos=True).token_ids for prompt in prompts] * 3
    assert [json.loads(stdout.strip().splitlines()[-1]) for stdout, _ in results] == [expected, expected]
    assert not [path for path in tmp_path.iterdir() if ".partial-" in path.name]
    stored = LLM(
        "speculative",
        target=tiny_dir,
        draft=tiny_draft_dir,
        dtype="float32",
        prefill_chunk=16,
        prompt_cache__dir=str(tmp_path),
    )
    assert all(stored.generate(prompt, max_new_tokens=2).stats["prefill_loaded"] for prompt in prompts)
