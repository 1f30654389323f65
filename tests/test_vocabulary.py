"""A draft that keeps the most frequent tokens alone (``draft.frequent_tokens``): the ranking counts
the corpus and is kept per tokenizer; a model cut to some tokens gives those tokens the logits the
whole model gives them (eager, fused and int8 passes) and every other token -inf; speculation with
such a draft still decodes the target's greedy output, and its sampled output follows the target's
distribution (tests/test_pipeline_distribution.py); the target cannot be cut, nor a draft beyond its
vocabulary."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError
from transformers import AutoTokenizer

from cascade import vocabulary
from cascade.checkpoint import load_model
from cascade.errors import CascadeError
from cascade.graphs import MAX_GRAPH_TOKENS
from cascade.quantise import quantise
from configs.schema import PipelineConfig
from tests.conftest import make_checkpoint
from tests.test_fused import CPU, SHORT_PASSES, decode, needs_compiler
from tests.test_pipeline import PROMPT, generate, runtime_for

KEPT = 300


def test_ranking_puts_the_most_counted_first_and_equal_counts_by_id():
    counts = torch.tensor([3, 5, 5, 0, 1, 3])
    assert vocabulary.rank(counts).tolist() == [1, 2, 0, 5, 4, 3]


@pytest.fixture
def small_corpus(tmp_path, monkeypatch):
    """The standard library replaced by two files, and a fresh $CASCADE_HOME for the ranking."""
    monkeypatch.setenv("CASCADE_HOME", str(tmp_path / "home"))
    sources = [tmp_path / "a.py", tmp_path / "b.py"]
    sources[0].write_text("def f(x):\n    return x + x + x\n")
    sources[1].write_text("x = f(1) + f(2)\n")
    monkeypatch.setattr(vocabulary, "standard_library_sources", lambda: sources)
    return sources


def test_frequent_tokens_are_the_corpus_counts_special_tokens_first_and_counted_once(
    small_corpus, smollm2_dir, monkeypatch
):
    tokenizer = AutoTokenizer.from_pretrained(smollm2_dir)
    vocab_size = len(tokenizer)
    texts = [source.read_text() for source in small_corpus]
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for text in texts:
        for token in tokenizer(text, add_special_tokens=False)["input_ids"]:
            counts[token] += 1
    special = sorted(set(tokenizer.all_special_ids))
    kept = vocabulary.frequent_tokens(tokenizer, vocab_size, len(special) + 3)
    assert kept[: len(special)].tolist() == special
    assert kept[len(special) :].tolist() == [i for i in vocabulary.rank(counts).tolist() if i not in special][:3]
    monkeypatch.setattr(vocabulary, "standard_library_sources", lambda: pytest.fail("counted again"))
    assert torch.equal(vocabulary.frequent_tokens(tokenizer, vocab_size, len(special) + 3), kept)


def test_the_real_standard_library_is_found_without_tests_or_installed_packages():
    sources = vocabulary.standard_library_sources()
    assert any(source.name == "functools.py" for source in sources)
    assert not any(set(source.parts) & vocabulary.SKIPPED_DIRECTORIES for source in sources)
    assert sources == sorted(sources)


def kept_ids(vocab_size: int) -> torch.Tensor:
    return torch.randperm(vocab_size, generator=torch.Generator().manual_seed(3))[: vocab_size // 3]


def assert_cut_logits(cut: torch.Tensor, whole: torch.Tensor, ids: torch.Tensor) -> None:
    """``cut`` [N, V] holds ``whole``'s logits [N, V] at ``ids`` and -inf elsewhere."""
    assert torch.equal(cut[:, ids], whole[:, ids])
    others = torch.ones(cut.shape[-1], dtype=torch.bool)
    others[ids] = False
    assert torch.isneginf(cut[:, others]).all()


@pytest.mark.parametrize("int8", [False, True], ids=["bf16", "int8"])
@pytest.mark.parametrize(
    "fused_tokens", [0, pytest.param(MAX_GRAPH_TOKENS, marks=needs_compiler)], ids=["eager", "fused"]
)
def test_a_cut_model_gives_its_kept_tokens_the_whole_models_logits(fused_tokens, int8, tmp_path):
    checkpoint = make_checkpoint(tmp_path / "m", "qwen2-bias")
    whole, cut = (load_model(checkpoint, torch.bfloat16, CPU) for _ in range(2))
    ids = kept_ids(whole.spec.vocab_size)
    cut.keep_output_tokens(ids)
    if int8:
        whole, cut = quantise(whole, 8), quantise(cut, 8)
    expected = decode(whole, "full", fused_tokens, SHORT_PASSES)
    assert_cut_logits(decode(cut, "full", fused_tokens, SHORT_PASSES), expected, ids)
    assert cut.lm_head.weight.shape[0] < whole.lm_head.weight.shape[0]


def test_speculation_with_a_cut_draft_decodes_the_targets_greedy_output(tiny_dir, tiny_draft_dir, small_corpus):
    expected = generate(runtime_for("autoregressive", tiny_dir, tiny_draft_dir), PROMPT).token_ids
    for draft in (tiny_draft_dir, tiny_dir):
        overrides = [f"draft.frequent_tokens={KEPT}", "stages.0.schedule=fixed"]
        runtime = runtime_for("speculative", tiny_dir, draft, overrides)
        assert runtime.draft.model.output_ids is not None and runtime.target.model.output_ids is None
        result = generate(runtime, PROMPT)
        assert result.token_ids == expected
        assert result.stats.stages[0].rounds > 0


def test_the_target_cannot_be_cut_nor_a_draft_beyond_its_vocabulary(tiny_dir, tiny_draft_dir, small_corpus):
    stages = [{"model": "target", "cache": {"kind": "full"}}]
    with pytest.raises(ValidationError, match="target.frequent_tokens: 1000 would leave the target unable"):
        PipelineConfig.model_validate({"stages": stages, "target": {"frequent_tokens": 1000}})
    with pytest.raises(ValidationError, match="greater than or equal to 256"):
        PipelineConfig.model_validate({"stages": stages, "draft": {"frequent_tokens": 10}})
    with pytest.raises(CascadeError, match="draft.frequent_tokens: 100000 is more than the 49152 tokens"):
        runtime_for("speculative", tiny_dir, tiny_draft_dir, ["draft.frequent_tokens=100000"])
