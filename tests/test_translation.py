"""Drafting across tokenizers (``draft.cross_tokenizer``): the shared tokens, spelling the target's
tokens in the draft's, greedy output equal to the target's own, and the errors for pairs that
cannot work. The sampled distribution is checked in test_pipeline_distribution."""

from __future__ import annotations

import random
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoTokenizer, PreTrainedTokenizerFast

import cascade.translation as translation_module
from cascade.errors import CascadeError
from cascade.translation import Translation, token_keys
from tests.conftest import make_checkpoint
from tests.test_pipeline import generate, runtime_for

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
"""Added tokens the other tokenizer shares with SmolLM2's by their text."""
TEXT = (
    "It was the best of times, it was the worst of times; 价格 12.50 € — naïve café 🙂\n"
    "def forward(self, x):\n    return self.norm(x) + residual  # shape [T, C]\n\n"
)


@pytest.fixture(scope="module")
def other_tokenizer_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A byte-level BPE of 1,500 tokens trained on part of the Python standard library: another
    vocabulary, other merges, the same byte alphabet as SmolLM2's."""
    library = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))[:60]
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=1500, special_tokens=SPECIAL, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    bpe.train_from_iterator((path.read_text(errors="replace") for path in library), trainer)
    directory = tmp_path_factory.mktemp("other-tokenizer")
    PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<|im_end|>").save_pretrained(directory)
    shutil.copy(smollm2_dir / "chat_template.jinja", directory)
    return directory


@pytest.fixture(scope="module")
def tokenizers(other_tokenizer_dir, smollm2_dir):
    return AutoTokenizer.from_pretrained(other_tokenizer_dir), AutoTokenizer.from_pretrained(smollm2_dir)


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory, other_tokenizer_dir, tokenizers) -> Path:
    """A tiny Llama with the other tokenizer: a draft from another family."""
    vocab_size = len(tokenizers[0])
    path = tmp_path_factory.mktemp("other-draft") / "llama"
    return make_checkpoint(path, "llama-gqa-tied", vocab_size, tokenizer_dir=other_tokenizer_dir, seed=2)


def test_shared_tokens_stand_for_the_same_bytes_in_both(tokenizers):
    draft, target = tokenizers
    translation = Translation.between(draft, target, 49152)
    draft_keys, target_keys = token_keys(draft, "draft"), token_keys(target, "target")
    pairs = list(zip(translation.draft_ids.tolist(), translation.target_ids.tolist(), strict=True))
    assert all(draft_keys[d] == target_keys[t] for d, t in pairs)
    assert len(pairs) >= translation_module.MIN_SHARED_SHARE * len(draft_keys)
    assert {draft.convert_ids_to_tokens(d) for d, t in pairs} >= set(SPECIAL)  # added tokens, by their text
    assert translation.target_to_draft[translation.target_ids].tolist() == translation.draft_ids.tolist()
    assert (translation.target_to_draft >= 0).sum() == len(pairs)


def random_text(generator: random.Random) -> str:
    pieces = [*TEXT.split(" "), " ", "  ", "\n\n", "\t", "日本語", "ü", "👍🏽", "<|im_end|>", "0x1F", "_", "'s"]
    return "".join(generator.choice(pieces) + generator.choice(["", " "]) for _ in range(generator.randint(1, 40)))


def test_the_draft_reads_every_byte_of_the_targets_tokens(tokenizers):
    """Property: for 300 random texts (CJK, emoji, accents, whitespace runs, added tokens), every
    target token spelled in draft tokens gives back its bytes, the text as a whole included."""
    draft, target = tokenizers
    translation = Translation.between(draft, target, 49152)
    draft_keys, target_keys = token_keys(draft, "draft"), token_keys(target, "target")

    def as_bytes(key) -> bytes:
        return key.encode() if isinstance(key, str) else key

    generator = random.Random(0)
    for _ in range(300):
        text = random_text(generator)
        target_ids = target.encode(text, add_special_tokens=False)
        for token in target_ids:
            spelled = b"".join(as_bytes(draft_keys[d]) for d in translation.draft_tokens(token))
            assert spelled == as_bytes(target_keys[token]), (text, token)
        spelled_text = b"".join(as_bytes(draft_keys[d]) for t in target_ids for d in translation.draft_tokens(t))
        assert spelled_text == text.encode()


def test_to_target_keeps_the_shared_logits_alone(tokenizers):
    translation = Translation.between(*tokenizers, 49152)
    logits = torch.randn(2, len(tokenizers[0]))  # [N, V_draft]
    mapped = translation.to_target(logits)  # [N, V_target]
    assert mapped.shape == (2, 49152)
    torch.testing.assert_close(mapped[:, translation.target_ids], logits[:, translation.draft_ids])
    assert torch.isinf(mapped).sum() == 2 * (49152 - len(translation.target_ids))


def text_prompt(tokenizer, tokens: int = 300) -> list[int]:
    ids = tokenizer.encode(TEXT * 20, add_special_tokens=False)
    return ids[:tokens]


@pytest.mark.parametrize("preset", ["speculative", "triforce"])
def test_a_draft_with_another_tokenizer_leaves_greedy_output_unchanged(preset, tiny_dir, other_draft_dir, tokenizers):
    prompt = text_prompt(tokenizers[1])
    small = ["stages.0.cache.window=40", "stages.1.cache.budget=64"] if preset == "triforce" else []
    fixed = [f"stages.{index}.schedule=fixed" for index in range(2 if preset == "triforce" else 1)]
    overrides = [*small, "draft.cross_tokenizer=true", *fixed]  # the draft proposes every round
    runtime = runtime_for(preset, tiny_dir, other_draft_dir, overrides)
    pipeline = runtime.pipeline_for(len(prompt), 40)
    result = generate(runtime, prompt, pipeline=pipeline)
    expected = generate(runtime_for("autoregressive", tiny_dir, tiny_dir), prompt).token_ids
    assert result.token_ids == expected
    draft = result.stats.stages[0]
    assert draft.rounds > 0 and draft.proposed > 0
    spelled = pipeline.stages[0].translation.spelled  # target tokens the draft read in several of its own
    assert any(token in spelled and len(spelled[token]) > 1 for token in expected)


def test_a_translated_draft_with_the_targets_own_tokenizer_and_weights_is_always_accepted(tiny_dir):
    """Every token shared, each spelled as itself: the draft proposes what the target says."""
    prompt = text_prompt(AutoTokenizer.from_pretrained(tiny_dir))
    overrides = ["draft.cross_tokenizer=true", "stages.0.schedule=fixed"]
    result = generate(runtime_for("speculative", tiny_dir, tiny_dir, overrides), prompt)
    expected = generate(runtime_for("autoregressive", tiny_dir, tiny_dir), prompt).token_ids
    assert result.token_ids == expected
    assert result.stats.stages[0].acceptance_rate == 1.0


def test_a_draft_with_another_tokenizer_is_refused_unless_asked_for(tiny_dir, other_draft_dir):
    with pytest.raises(CascadeError, match="draft.cross_tokenizer: true"):
        runtime_for("speculative", tiny_dir, other_draft_dir)


def test_drafting_across_tokenizers_refuses_what_it_cannot_do(tiny_dir, other_draft_dir, tokenizers, monkeypatch):
    with pytest.raises(ValueError, match="drafts as the first stage"):
        runtime_for("speculative", tiny_dir, other_draft_dir, ["draft.cross_tokenizer=true", "stages.0.tree.nodes=8"])
    with pytest.raises(ValueError, match="target.cross_tokenizer"):
        runtime_for("speculative", tiny_dir, other_draft_dir, ["target.cross_tokenizer=true"])
    monkeypatch.setattr(translation_module, "MIN_SHARED_SHARE", 0.99)
    with pytest.raises(CascadeError, match=r"shares \d+ of its \d+ tokens with the target's"):
        Translation.between(*tokenizers, 49152)
    words = Tokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]"))
    with pytest.raises(CascadeError, match="takes byte-level BPE tokenizers"):
        Translation.between(PreTrainedTokenizerFast(tokenizer_object=words), tokenizers[1], 49152)


def test_a_cross_tokenizer_drafts_output_projection_keeps_the_shared_tokens_alone(tiny_dir, other_draft_dir):
    """Its other rows could never be proposed; with ``frequent_tokens`` too, the tokens in both."""
    runtime = runtime_for("speculative", tiny_dir, other_draft_dir, ["draft.cross_tokenizer=true"])
    assert runtime.draft.model.output_ids.tolist() == sorted(runtime.translation.draft_ids.tolist())
    both = runtime_for(
        "speculative", tiny_dir, other_draft_dir, ["draft.cross_tokenizer=true", "draft.frequent_tokens=400"]
    )
    kept = set(both.draft.model.output_ids.tolist())
    assert kept < set(runtime.translation.draft_ids.tolist()) and 0 < len(kept) <= 400
