"""Prompt lookup decoding (``cascade.lookup``): the n-gram index, its rollback, the stage's config;
on tiny models, its presets' greedy output equals autoregressive decoding's token for token."""

from __future__ import annotations

import random

import pytest
import torch
from pydantic import ValidationError

from cascade.lookup import LookupStage, NgramIndex
from configs.schema import LookupConfig, PipelineConfig
from tests.test_pipeline import PROMPT, generate, runtime_for


def test_the_longest_suffix_that_occurred_before_gives_what_followed_its_latest_occurrence():
    index = NgramIndex(range(2, 5))
    index.extend([1, 2, 3, 9, 1, 2, 3, 7, 8, 5, 2, 3])
    # [2, 3] ended at 3 and 7 before the end; [5, 2, 3] never occurred before: the latest [2, 3] wins
    assert index.continuation(3) == [7, 8, 5]
    index.extend([7])  # [2, 3, 7] occurred once before (at 8): it outranks the bigram [3, 7]
    assert index.continuation(10) == [8, 5, 2, 3, 7]  # up to the sequence's end
    index.extend([4])
    assert index.continuation(3) == []  # [7, 4] never occurred before


def test_a_single_token_suffix_matches_only_where_the_sizes_allow_it():
    pairs_and_up, any_token = NgramIndex(range(2, 4)), NgramIndex(range(1, 4))
    for index in (pairs_and_up, any_token):
        index.extend([5, 6, 1, 5])
    assert pairs_and_up.continuation(2) == []  # [1, 5] never occurred before
    assert any_token.continuation(2) == [6, 1]


def test_rolling_back_leaves_the_index_of_the_kept_tokens():
    rng = random.Random(0)
    for _ in range(50):
        kept = [rng.randrange(4) for _ in range(rng.randrange(0, 30))]
        dropped = [rng.randrange(4) for _ in range(rng.randrange(0, 30))]
        index = NgramIndex(range(1, 4))
        index.extend(kept + dropped)
        index.truncate(len(kept))
        fresh = NgramIndex(range(1, 4))
        fresh.extend(kept)
        assert (index.tokens, index.ends) == (fresh.tokens, fresh.ends)
        assert index.continuation(5) == fresh.continuation(5)


def test_the_stage_indexes_the_context_it_is_given_and_forgets_rolled_back_tokens():
    stage = LookupStage("0:lookup", range(2, 4), torch.device("cpu"), None)
    stage.prefill(torch.tensor([1, 2, 3, 4]), chunk=16)
    assert stage.proposal([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    assert stage.length == 6
    stage.truncate(4)
    assert stage.length == 4 and stage.proposal([1, 2, 3, 4, 9, 9], 3) == []


@pytest.mark.parametrize(
    "stages,message",
    [
        ([{"model": "target"}, {"model": "lookup"}, {"model": "target"}], "first stage"),
        ([{"model": "lookup"}], "the last stage must be the target"),
        ([{"model": "lookup", "tree": {}}, {"model": "target"}], "first stage of two or more"),
        ([{"model": "lookup", "cache": {"kind": "full"}}, {"model": "target"}], "keeps no KV cache"),
        ([{"model": "target", "lookup": {"max_ngram": 3}}, {"model": "target"}], "lookup settings"),
        ([{"model": "lookup", "lookup": {"min_ngram": 5, "max_ngram": 3}}, {"model": "target"}], "must not exceed"),
    ],
    ids=["not-lowest", "alone", "tree", "cache", "settings-on-a-model", "sizes"],
)
def test_misplaced_lookup_stages_are_refused_with_what_to_change(stages, message):
    with pytest.raises(ValidationError, match=message):
        PipelineConfig(stages=stages)


def test_the_lookup_settings_give_the_sizes_matched():
    assert LookupConfig(min_ngram=1, max_ngram=3).sizes == range(1, 4)


NEW_TOKENS = 160
"""Long enough for the tiny model's output to repeat a token now and then, where a lookup of single
tokens proposes (a random model's text hardly repeats longer runs)."""


@pytest.fixture(scope="module")
def long_autoregressive(tiny_dir, tiny_draft_dir):
    return generate(runtime_for("autoregressive", tiny_dir, tiny_draft_dir), PROMPT, NEW_TOKENS).token_ids


@pytest.mark.parametrize("schedule", ["cost_model", "fixed"])
@pytest.mark.parametrize("preset", ["lookup", "lookup-speculative"])
def test_lookup_presets_greedy_equal_autoregressive(preset, schedule, tiny_dir, tiny_draft_dir, long_autoregressive):
    proposers = 2 if preset == "lookup-speculative" else 1
    overrides = ["stages.0.lookup.min_ngram=1", *(f"stages.{i}.schedule={schedule}" for i in range(proposers))]
    result = generate(runtime_for(preset, tiny_dir, tiny_draft_dir, overrides), PROMPT, NEW_TOKENS)
    assert result.token_ids == long_autoregressive
    lookup = result.stats.stages[0]
    assert lookup.name == "0:lookup" and lookup.forward_calls == 0 and lookup.accepted <= lookup.proposed
    assert lookup.held_rounds == 0  # its proposals cost no pass: never held back under an unproven draft
    if schedule == "fixed":
        assert lookup.rounds > 0
