"""Batched autoregressive decoding: each sequence of a batch gets what it would alone, bit for bit."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import torch

from cache.full import FullCache
from cascade import batch, fused, kernels
from cascade.checkpoint import load_model
from cascade.errors import CascadeError
from cascade.llm import LLM
from cascade.model import PassOptions, SequencePass
from tests.conftest import make_checkpoint
from tests.scripts import linked_home, run_script
from tests.test_fused import layer_op_calls

REPO = Path(__file__).resolve().parents[1]
CPU = torch.device("cpu")
PROMPTS = (
    "It was the best of times, it was the worst of times, it was the age of wisdom,",
    "Call me Ishmael.",
    "In the beginning God created the heaven and the earth. And the earth was without form, and void;"
    " and darkness was upon the face of the deep.",
)
NEW = 12
needs_layer_kernels = pytest.mark.skipif(
    not kernels.attention_kernel_available(), reason="cascade's CPU layer and attention ops do not run here"
)


def prefilled(model, lengths: list[int]) -> list[FullCache]:
    """A full cache per length, holding that many tokens of its own random prompt."""
    caches = []
    for seed, length in enumerate(lengths):
        cache = FullCache(model.cache_layout(length + 8))
        prompt = torch.randint(0, model.spec.vocab_size, (1, length), generator=torch.Generator().manual_seed(seed))
        model(prompt, cache)
        cache.commit(length)
        caches.append(cache)
    return caches


def on_layer_kernels(tmp_path: Path):
    """A small bf16 Qwen2-shaped model whose short passes run through ``decoder_layers``."""
    model = load_model(make_checkpoint(tmp_path / "m", "qwen2-bias"), torch.bfloat16, CPU)
    fused.use_cpu_kernels()
    model.options = PassOptions(kernels.MAX_KERNEL_ROWS)
    return model


@needs_layer_kernels
@pytest.mark.parametrize("widths", [(1, 1, 1), (1, 3, 2)], ids=["steps", "mixed-widths"])
def test_a_batched_pass_gives_each_sequence_the_bits_of_its_own_pass(tmp_path, widths, torch_threads):
    """One ``decoder_layers`` call for the whole batch; each sequence's logits equal its own pass's."""
    model = on_layer_kernels(tmp_path)
    lengths = [23, 7, 40]
    fed = [torch.randint(0, model.spec.vocab_size, (width,)) for width in widths]
    alone = [model(ids[None], cache, 1)[0, -1] for ids, cache in zip(fed, prefilled(model, lengths), strict=True)]
    together_caches = prefilled(model, lengths)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        together = model.forward_batch([SequencePass(ids, cache) for ids, cache in zip(fed, together_caches)])
    assert layer_op_calls(profile)["decoder_layers"] == 1
    assert torch.equal(torch.cat(together), torch.stack(alone))
    assert [cache.length for cache in together_caches] == [n + w for n, w in zip(lengths, widths, strict=True)]


@needs_layer_kernels
def test_threads_that_take_one_anothers_key_blocks_compute_what_one_thread_does(tmp_path):
    """A batch over caches of several 256-key blocks each: on 3 threads (more than the cores, so their
    shares end apart and the first done takes the others' last blocks) the logits are one thread's."""
    model = on_layer_kernels(tmp_path)
    lengths, widths = [700, 300, 1100], (1, 3, 2)
    fed = [torch.randint(0, model.spec.vocab_size, (width,)) for width in widths]
    threads = torch.get_num_threads()
    logits = []
    try:
        for count in (1, 3, 3):
            torch.set_num_threads(count)
            caches = prefilled(model, lengths)
            logits.append(torch.cat(model.forward_batch([SequencePass(ids, c) for ids, c in zip(fed, caches)])))
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(logits[1], logits[0]) and torch.equal(logits[2], logits[0])


def test_a_pass_the_kernels_do_not_take_runs_each_sequence_alone_with_the_same_logits(tmp_path):
    model = load_model(make_checkpoint(tmp_path / "m", "llama-gqa-tied"), torch.float32, CPU)
    fed = [torch.tensor([5]), torch.tensor([9, 2])]
    alone = [model(ids[None], cache, 1)[0, -1] for ids, cache in zip(fed, prefilled(model, [6, 11]), strict=True)]
    passes = [SequencePass(ids, cache) for ids, cache in zip(fed, prefilled(model, [6, 11]), strict=True)]
    assert torch.equal(torch.cat(model.forward_batch(passes)), torch.stack(alone))


@pytest.fixture(scope="module", params=["float32", pytest.param("bfloat16", marks=needs_layer_kernels)])
def llm(request, tiny_dir):
    return LLM("autoregressive", target=tiny_dir, dtype=request.param, reuse_prompts=False)


@pytest.mark.parametrize("sampling", [{}, {"temperature": 0.8, "top_p": 0.9}], ids=["greedy", "sampled"])
def test_each_prompt_of_a_batch_gets_the_tokens_it_gets_alone(llm, sampling):
    alone = [llm.generate(prompt, max_new_tokens=NEW, seed=3, **sampling) for prompt in PROMPTS]
    together = llm.generate(list(PROMPTS), max_new_tokens=NEW, seed=3, **sampling)
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]
    assert [c.text for c in together] == [c.text for c in alone]
    assert all(c.stats["new_tokens"] == len(c.token_ids) and c.stats["decode_s"] > 0 for c in together)
    in_pairs = llm.generate(list(PROMPTS), max_new_tokens=NEW, seed=3, batch_size=2, **sampling)
    assert [c.token_ids for c in in_pairs] == [c.token_ids for c in alone]


def test_rows_stop_by_their_own_rules_and_the_others_go_on(llm):
    """Different lengths, seeds and stop strings in one batch: the finished leave, the rest decode on."""
    reference = llm.generate(PROMPTS[0], max_new_tokens=NEW)
    stop = reference.text[len(reference.text) // 2 :][:3]
    requests = [
        llm.prepare(PROMPTS[0], max_new_tokens=NEW, stop=stop),
        llm.prepare(PROMPTS[1], max_new_tokens=3),
        llm.prepare(PROMPTS[2], max_new_tokens=NEW, temperature=0.8, seed=11),
    ]
    together = llm.run_batch(requests)
    alone = [llm.run(request) for request in requests]
    assert [(c.token_ids, c.text, c.finish_reason) for c in together] == [
        (c.token_ids, c.text, c.finish_reason) for c in alone
    ]
    assert together[0].finish_reason == "stop" and stop not in together[0].text
    assert len(together[1].token_ids) == 3 and together[1].finish_reason == "length"
    assert len(together[2].token_ids) == NEW


def test_a_prompt_of_a_list_that_cannot_run_fails_alone_and_the_others_complete(llm):
    too_long = "word " * 5000  # past the tiny model's context with the new tokens
    together = llm.generate([PROMPTS[0], "   ", too_long, PROMPTS[1]], max_new_tokens=NEW)
    assert [c.finish_reason for c in together] == ["length", "error", "error", "length"]
    assert together[1].error == "the prompt is empty: give some text" and together[1].token_ids == []
    assert "exceeds the context limit" in together[2].error
    alone = [llm.generate(prompt, max_new_tokens=NEW) for prompt in PROMPTS[:2]]
    assert [together[0].token_ids, together[3].token_ids] == [c.token_ids for c in alone]
    assert all(c.error is None for c in alone)
    with pytest.raises(CascadeError, match="temperature"):  # a setting every prompt shares
        llm.generate(list(PROMPTS), max_new_tokens=NEW, temperature=-1)


def test_a_batch_whose_caches_do_not_fit_in_memory_is_refused_before_it_starts(llm, monkeypatch):
    monkeypatch.setattr(batch, "available_memory", lambda device: 1000)
    with pytest.raises(CascadeError, match=r"a batch of 3 sequences needs .* GiB of KV cache, and 0.00 GiB"):
        llm.generate(list(PROMPTS), max_new_tokens=NEW)


@pytest.mark.parametrize("batch_size", [0, -2, 1.5])
def test_a_batch_size_that_is_not_a_positive_whole_number_is_refused(llm, batch_size):
    with pytest.raises(CascadeError, match=f"batch_size: must be a whole number of at least 1; got {batch_size}"):
        llm.generate(list(PROMPTS), max_new_tokens=NEW, batch_size=batch_size)


def test_a_speculative_preset_decodes_a_list_one_prompt_after_another(tiny_dir, tiny_draft_dir):
    llm = LLM("speculative", target=tiny_dir, draft=tiny_draft_dir, dtype="float32", reuse_prompts=False)
    together = llm.generate(list(PROMPTS[:2]), max_new_tokens=NEW)
    assert [c.token_ids for c in together] == [llm.generate(p, max_new_tokens=NEW).token_ids for p in PROMPTS[:2]]
    assert all(len(c.stats["stages"]) == 2 for c in together)


def test_the_batch_benchmark_reports_every_size_and_a_summarization_job(tiny_dir, tmp_path):
    """Run outside the tree (its run directory in a fresh home), on the tiny model: every batch size's
    rate and ratios for autoregressive decoding and a speculating preset beside it, rows that are
    autoregressive batch 1's, and the job's wall times with the same summaries."""
    documents = tmp_path / "documents"
    documents.mkdir()
    for index, prompt in enumerate(PROMPTS):
        (documents / f"{index}.txt").write_text(prompt)
    home = linked_home(tmp_path / "home")
    flags = ["--target", str(tiny_dir), "--contexts", "40", "--batch-sizes", "1", "2", "--new-tokens", "4"]
    flags += ["--repeats", "2", "--dtype", "float32", "--documents", str(documents), "--summary-tokens", "4"]
    flags += ["--preset", "self-spec", "--set", "stages.0.cache.budget=16", "--set", "stages.0.schedule=fixed"]
    run_script(
        [sys.executable, str(REPO / "scripts" / "batch_bench.py"), *flags],
        cwd=tmp_path,
        env={**os.environ, "CASCADE_HOME": str(home)},
    )
    [run_dir] = (home / "runs" / "batch_bench").iterdir()
    report = json.loads((run_dir / "batch_bench.json").read_text())
    [context] = report["contexts"]
    assert context["context"] == 40
    for name, rows in (("autoregressive", context["batches"]), ("self-spec", context["preset"])):
        assert [(row["preset"], row["batch_size"]) for row in rows] == [(name, 1), (name, 2)]
        assert all(row["first_row_as_batch_1"] and row["tokens_per_s"] > 0 for row in rows)
        assert rows[0]["over_batch_1"] == 1.0 and len(rows[1]["runs"]) == 2
    assert all(row["over_autoregressive"] == 1.0 for row in context["batches"])
    assert all(run["proposed"]["0:target/retrieval"] > 0 for row in context["preset"] for run in row["runs"])
    jobs = report["summaries"]["batches"]
    assert all(row["summaries_as_batch_1"] and row["wall_s"] > 0 for row in jobs)
    assert len(jobs[1]["runs"][0]["summaries"]) == len(PROMPTS) and jobs[0]["speedup_over_batch_1"] == 1.0
    assert json.loads((run_dir / "manifest.json").read_text())["command"][1].endswith("batch_bench.py")
