"""Autoregressive generation: stop rules, and token-for-token equality with transformers' generate()."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import AutoModelForCausalLM

from cascade.pipeline import StopRule
from cascade.runtime import build_runtime
from configs import load_config
from tests.conftest import runtime_messages


def runtime_for(path, preset: str | None = None, **settings):
    _, config = load_config(preset, settings={"target.path": str(path), "dtype": "float32", **settings})
    return build_runtime(config)


def generate(runtime, prompt_ids: list[int], max_new_tokens: int, eos=None, seed: int = 0):
    pipeline = runtime.pipeline_for(len(prompt_ids), max_new_tokens)
    stop = runtime.stop_rule(max_new_tokens) if eos is None else StopRule(frozenset(eos), max_new_tokens)
    device = runtime.target.model.device
    generator = torch.Generator(device=device).manual_seed(seed)
    return pipeline.generate(torch.tensor(prompt_ids, device=device), stop, generator)


def transformers_greedy(path, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    output = model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens, do_sample=False)
    return output[0, len(prompt_ids) :].tolist()


@pytest.mark.parametrize(
    "emitted,new,expected",
    [
        ([], [5, 6, 7], ([5, 6, 7], None)),
        ([], [5, 2, 7], ([5, 2], "eos")),
        ([1] * 8, [5, 6, 7], ([5, 6], "max_new_tokens")),
        ([1] * 8, [5, 2], ([5, 2], "eos")),
        ([1] * 9, [2], ([2], "eos")),
        ([1] * 7, [5, 6, 2], ([5, 6, 2], "eos")),
    ],
)
def test_stop_rule_cuts_where_autoregressive_decoding_stops(emitted, new, expected):
    assert StopRule(frozenset({2}), max_new_tokens=10).cut(emitted, new) == expected


def test_greedy_equals_transformers_generate(tiny_dir):
    prompt_ids = list(range(100, 400))
    result = generate(runtime_for(tiny_dir, prefill_chunk=64), prompt_ids, 40)
    assert result.token_ids == transformers_greedy(tiny_dir, prompt_ids, 40)
    assert result.stats.new_tokens == len(result.token_ids)
    assert result.stats.stages[0].forward_calls == len(result.token_ids) - 1  # prefill counted apart


def test_eos_stops_generation_and_is_emitted(tiny_dir):
    runtime = runtime_for(tiny_dir)
    free_run = generate(runtime, [10, 11, 12], 12, eos=[])
    stop_token = free_run.token_ids[4]
    stopped = generate(runtime, [10, 11, 12], 12, eos=[stop_token])
    first = free_run.token_ids.index(stop_token)
    assert stopped.token_ids == free_run.token_ids[: first + 1]
    assert stopped.stats.stop_reason == "eos"
    assert free_run.stats.stop_reason == "max_new_tokens" and len(free_run.token_ids) == 12


def test_sampling_is_seeded(tiny_dir):
    runtime = runtime_for(tiny_dir, **{"sampling.temperature": 1.0, "sampling.top_p": 0.9})
    first, again = (generate(runtime, [10, 11, 12], 20, eos=[], seed=7).token_ids for _ in range(2))
    other = generate(runtime, [10, 11, 12], 20, eos=[], seed=8).token_ids
    assert first == again
    assert first != other


@pytest.mark.parametrize(
    "draft_cache,fix",
    [
        ({"kind": "full"}, "positions within its cache (--set stages.0.cache.kind=streaming)"),
        ({"kind": "streaming", "window": 200}, "a window within it (--set stages.0.cache.window=118)"),
        ({"kind": "streaming", "window": 96}, None),  # 4 sinks + 96 + 5 awaiting eviction: within the draft's
    ],
)
def test_a_draft_reading_past_its_own_context_is_named_with_the_fixes(tiny_dir, tmp_path, caplog, draft_cache, fix):
    draft = shutil.copytree(tiny_dir, tmp_path / "draft")
    config = json.loads((draft / "config.json").read_text())
    (draft / "config.json").write_text(json.dumps({**config, "max_position_embeddings": 128}))
    runtime = runtime_for(tiny_dir, "speculative", **{"draft.path": str(draft), "stages.0.cache": draft_cache})
    caplog.set_level("WARNING", logger="cascade.runtime")
    runtime.check_request(100, 28)  # within the draft's 128 positions
    assert runtime_messages(caplog) == []
    runtime.check_request(200, 40)
    window = draft_cache.get("window", 240)
    kind, positions = draft_cache["kind"], min(240, 4 + window + window // 16 - 1)
    expected = (
        f"cascade: stage 0 (draft/{kind}) reads at least {positions} positions, past the draft's 128-token "
        f"context, where it seldom agrees with the target (the output is the target's either way); give it "
        f"{fix}, or stretch the draft (--set draft.rope_scaling.kind=yarn --set draft.rope_scaling.factor=2)"
    )
    assert runtime_messages(caplog) == ([expected] if fix else [])
