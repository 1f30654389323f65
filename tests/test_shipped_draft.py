"""The shipped draft: it installs, its weights match its card, and it reproduces the card's agreement."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoConfig

from cascade.checkpoint import load_model
from cascade.data import document_text
from cascade.draft.agreement import greedy_agreement
from cascade.models import DEFAULTS, fetch, installed_models

pytestmark = pytest.mark.slow

AGREEMENT_TOLERANCE = 0.03
"""About 8 of the sample's 256 positions: float32 on another CPU may flip near-ties."""


@pytest.fixture(scope="module")
def draft_dir(smollm2_dir):
    return fetch(DEFAULTS["draft"])


@pytest.fixture(scope="module")
def card(draft_dir):
    return json.loads((draft_dir / "card.json").read_text())


def test_the_draft_is_listed_with_role_draft(draft_dir):
    record = next(model for model in installed_models() if model["name"] == DEFAULTS["draft"].name)
    assert record["role"] == "draft" and record["path"] == str(draft_dir)


def test_weights_and_config_match_the_card(draft_dir, card, smollm2_dir):
    shape = card["architecture"]
    config = AutoConfig.from_pretrained(draft_dir)
    assert (
        config.hidden_size,
        config.num_hidden_layers,
        config.num_attention_heads,
        config.num_key_value_heads,
        config.intermediate_size,
    ) == (
        shape["hidden_size"],
        shape["num_layers"],
        shape["num_heads"],
        shape["num_kv_heads"],
        shape["intermediate_size"],
    )
    model = load_model(draft_dir, torch.bfloat16, torch.device("cpu"))
    assert model.embed_tokens.weight.shape == (AutoConfig.from_pretrained(smollm2_dir).vocab_size, shape["hidden_size"])
    assert model.lm_head.weight is model.embed_tokens.weight  # tied
    assert shape["cost_ratio"] <= 0.10


def test_the_draft_reproduces_its_cards_sample_agreement(draft_dir, card, smollm2_dir):
    from transformers import AutoTokenizer

    sample = card["measured"]["sample"]
    dtype = getattr(torch, sample["dtype"])
    ids = AutoTokenizer.from_pretrained(smollm2_dir)(
        document_text(sample["document"]), add_special_tokens=False, verbose=False
    )["input_ids"][: sample["tokens"]]
    cpu = torch.device("cpu")
    measured = greedy_agreement(
        load_model(smollm2_dir, dtype, cpu), load_model(draft_dir, dtype, cpu), torch.tensor(ids), sample["evaluated"]
    )
    assert abs(measured - sample["agreement"]) <= AGREEMENT_TOLERANCE
    assert measured > 0.05  # chance is 1 in 49152: the draft has learnt the target
