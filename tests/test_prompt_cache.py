"""The prompt cache: a stored prefill is bitwise what prefilling computes, is found only for the same
prompt (or the whole passes of a shared prefix), model and settings, and a damaged file is
recomputed, never trusted."""

from __future__ import annotations

import torch

from cascade.runtime import build_runtime
from configs import load_config

PROMPT = [(7 * i) % 300 + 5 for i in range(40)]


def runtime_for(tiny_dir, tiny_draft_dir, cache_dir, **settings):
    """Sampled ``speculative`` with a fixed gamma: a seeded sample repeats token for token (under
    ``cost_model`` the gammas, so the text, follow measured times)."""
    settings = {
        "target.path": str(tiny_dir),
        "draft.path": str(tiny_draft_dir),
        "dtype": "float32",
        "prefill_chunk": 16,
        "sampling.temperature": 0.8,
        "stages.0.gamma": 3,
        "stages.0.schedule": "fixed",
        **settings,
    }
    if cache_dir is not None:
        settings["prompt_cache.dir"] = str(cache_dir)
    _, config = load_config("speculative", None, [], settings)
    return build_runtime(config)


def prefilled(runtime, prompt=PROMPT, stage=-1):
    """The pipeline's ``stage`` (the target's by default) after its prefill, and the logits it returned."""
    pipeline = runtime.pipeline_for(len(prompt), 8)
    prompt_ids = torch.tensor(prompt, device=runtime.target.model.device)
    logits = pipeline.stages[stage].prefill(prompt_ids, runtime.config.prefill_chunk)
    return pipeline.stages[stage], logits


def test_second_generation_loads_every_stage_holding_the_prompt_whole_and_generates_the_same(
    tmp_path, tiny_dir, tiny_draft_dir
):
    """The draft's streaming cache (the preset's) holds these 40 tokens before its first eviction."""
    runtime = runtime_for(tiny_dir, tiny_draft_dir, tmp_path)
    first = runtime.generate(PROMPT, 12, stop_at_eos=False)
    second = runtime.generate(PROMPT, 12, stop_at_eos=False)
    plain = runtime_for(tiny_dir, tiny_draft_dir, None).generate(PROMPT, 12, stop_at_eos=False)
    assert [stage.prefill_loaded for stage in first.stats.stages] == [False, False]
    assert [stage.prefill_loaded for stage in second.stats.stages] == [True, True]  # draft and target
    assert len(list(tmp_path.glob("*.safetensors"))) == 2 * 3  # per model, 40 tokens in passes of 16
    assert second.token_ids == first.token_ids == plain.token_ids


def test_loaded_prefill_is_bitwise_the_computed_one(tmp_path, tiny_dir, tiny_draft_dir):
    computed, computed_logits = prefilled(runtime_for(tiny_dir, tiny_draft_dir, tmp_path))
    loaded, loaded_logits = prefilled(runtime_for(tiny_dir, tiny_draft_dir, tmp_path))
    assert loaded.stats.prefill_loaded and not computed.stats.prefill_loaded
    assert (loaded.cache.length, loaded.cache.committed) == (len(PROMPT), len(PROMPT))
    assert torch.equal(loaded.cache.keys, computed.cache.keys)
    assert torch.equal(loaded.cache.values, computed.cache.values)
    assert torch.equal(loaded_logits, computed_logits)
    assert loaded.cache.last_queries_at == computed.cache.last_queries_at == len(PROMPT) - 1
    assert torch.equal(loaded.cache.last_queries, computed.cache.last_queries)  # a retrieval stage's first selection


def test_a_streaming_stage_loads_a_prompt_within_its_window_bitwise_and_prefills_a_longer_one(
    tmp_path, tiny_dir, tiny_draft_dir
):
    window = {"stages.0.cache.window": 36, "stages.0.cache.evict_every": 1}  # holds 4 + 36 tokens
    computed, computed_logits = prefilled(runtime_for(tiny_dir, tiny_draft_dir, tmp_path, **window), stage=0)
    loaded, loaded_logits = prefilled(runtime_for(tiny_dir, tiny_draft_dir, tmp_path, **window), stage=0)
    assert loaded.stats.prefill_loaded and not computed.stats.prefill_loaded
    assert torch.equal(loaded.cache.keys, computed.cache.keys) and torch.equal(loaded_logits, computed_logits)
    assert torch.equal(loaded.cache.values, computed.cache.values)
    stored = len(list(tmp_path.glob("*.safetensors")))
    narrower = {"stages.0.cache.window": 35, "stages.0.cache.evict_every": 1}  # the 40th token evicts one
    for _ in range(2):
        stage, _ = prefilled(runtime_for(tiny_dir, tiny_draft_dir, tmp_path, **narrower), stage=0)
        assert not stage.stats.prefill_loaded and stage.stats.prefill_reused == 0
    tail = {"stages.0.cache.prefill_tail": 30}  # within the window, but 6 tokens left unfed
    stage, _ = prefilled(runtime_for(tiny_dir, tiny_draft_dir, tmp_path, **tail), stage=0)
    assert not stage.stats.prefill_loaded and stage.stats.prefill_reused == 0
    assert len(list(tmp_path.glob("*.safetensors"))) == stored  # neither stored its prefill


def test_other_prompts_chunks_and_dtypes_are_not_served_from_the_store(tmp_path, tiny_dir, tiny_draft_dir):
    prefilled(runtime_for(tiny_dir, tiny_draft_dir, tmp_path))
    variants = [({}, PROMPT[:-1], 32), ({"prefill_chunk": 32}, PROMPT, 0), ({"dtype": "bfloat16"}, PROMPT, 0)]
    for settings, prompt, reused in variants:
        stage, _ = prefilled(runtime_for(tiny_dir, tiny_draft_dir, tmp_path, **settings), prompt)
        assert not stage.stats.prefill_loaded and stage.stats.prefill_reused == reused, settings
    assert len(list(tmp_path.glob("*.safetensors"))) == 3 + 1 + 2 + 3  # PROMPT[:-1] shares two passes


def test_a_draft_in_coarser_int4_groups_is_not_served_the_finer_ones_prefill(tmp_path, tiny_dir, tiny_draft_dir):
    int4 = {"draft.quantise": "int4"}
    prefilled(runtime_for(tiny_dir, tiny_draft_dir, tmp_path, **int4), stage=0)
    coarser, _ = prefilled(runtime_for(tiny_dir, tiny_draft_dir, tmp_path, **int4, **{"draft.int4_group": 64}), stage=0)
    again, _ = prefilled(runtime_for(tiny_dir, tiny_draft_dir, tmp_path, **int4), stage=0)
    assert not coarser.stats.prefill_loaded and again.stats.prefill_loaded


def test_damaged_or_foreign_files_are_reported_deleted_and_recomputed(tmp_path, tiny_dir, tiny_draft_dir, caplog):
    reference, reference_logits = prefilled(runtime_for(tiny_dir, tiny_draft_dir, None))
    runtime = runtime_for(tiny_dir, tiny_draft_dir, tmp_path)
    stored = runtime.prompt_caches["target"].path(torch.tensor(PROMPT), 16)
    other = runtime.prompt_caches["target"].path(torch.tensor(PROMPT[:-1]), 16)
    prefilled(runtime, PROMPT[:-1])
    damages = {
        "it holds other tokens": lambda: other.replace(stored),  # another prompt's last pass under this name
        "unusable": lambda: stored.write_bytes(stored.read_bytes()[:1000]),  # the recomputed file, cut short
    }
    for reason, damage in damages.items():
        damage()
        caplog.clear()
        stage, logits = prefilled(runtime_for(tiny_dir, tiny_draft_dir, tmp_path), PROMPT)
        assert not stage.stats.prefill_loaded
        assert [line for line in caplog.messages if stored.name in line and reason in line], caplog.messages
        assert torch.equal(stage.cache.keys, reference.cache.keys) and torch.equal(logits, reference_logits)
    assert prefilled(runtime_for(tiny_dir, tiny_draft_dir, tmp_path))[0].stats.prefill_loaded  # rewritten whole


def test_least_recently_used_prompts_are_deleted_beyond_max_gb_and_nothing_else(tmp_path, tiny_dir, tiny_draft_dir):
    """Eviction deletes only the files the cache names itself: a directory shared with other files
    (weights, notes) keeps them, however small ``max_gb``."""
    others = {"model.safetensors": b"weights", "notes.txt": b"notes", f"{'0' * 63}.safetensors": b"near miss"}
    for name, data in others.items():
        (tmp_path / name).write_bytes(data)
    runtime = runtime_for(tiny_dir, tiny_draft_dir, tmp_path, **{"prompt_cache.max_gb": 1e-9})
    for length in (30, 35, 40):
        prefilled(runtime, PROMPT[:length])
    newest = [path.name for path, _ in runtime.prompt_caches["target"].passes(torch.tensor(PROMPT), 16)]
    assert sorted(path.name for path in tmp_path.iterdir()) == sorted([*newest, *others])
    assert all((tmp_path / name).read_bytes() == data for name, data in others.items())


def test_a_directory_that_cannot_be_written_is_reported_and_the_prompt_computed(
    tmp_path, tiny_dir, tiny_draft_dir, caplog
):
    _, reference_logits = prefilled(runtime_for(tiny_dir, tiny_draft_dir, None))
    not_a_directory = tmp_path / "file"
    not_a_directory.write_text("a file where the cache directory should be")
    for directory in (not_a_directory, not_a_directory / "below"):
        caplog.clear()
        stage, logits = prefilled(runtime_for(tiny_dir, tiny_draft_dir, directory))
        assert not stage.stats.prefill_loaded and torch.equal(logits, reference_logits)
        messages = caplog.messages
        assert [line for line in messages if "could not store" in line and str(directory) in line], messages
    assert not_a_directory.read_text() == "a file where the cache directory should be"
