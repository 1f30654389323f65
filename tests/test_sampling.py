"""Sampling transforms equal transformers' logits warpers; greedy is a one-hot at the argmax."""

from __future__ import annotations

import pytest
import torch
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from cascade.sampling import NUCLEUS_CANDIDATES, draw, sample, token_probs
from configs import SamplingConfig
from tests.goodness_of_fit import P_FLOOR, fit_p_value


@pytest.mark.parametrize("temperature,top_k,top_p", [(1.0, 0, 1.0), (0.6, 0, 0.9), (1.3, 20, 1.0), (0.8, 5, 0.5)])
def test_probs_match_transformers_warpers(temperature, top_k, top_p):
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(0)) * 3
    expected = TemperatureLogitsWarper(temperature)(None, logits.clone())
    if top_k:
        expected = TopKLogitsWarper(top_k)(None, expected)
    if top_p < 1:
        expected = TopPLogitsWarper(top_p)(None, expected)
    probs = token_probs(logits, SamplingConfig(temperature=temperature, top_k=top_k, top_p=top_p))
    torch.testing.assert_close(probs, expected.softmax(-1), atol=1e-6, rtol=0)
    if top_k:
        assert ((probs > 0).sum(-1) <= top_k).all()


def test_greedy_is_one_hot_at_argmax():
    logits = torch.tensor([[0.1, 2.0, -1.0], [5.0, 4.0, 4.5]])
    probs = token_probs(logits, SamplingConfig(temperature=0))
    assert probs.tolist() == [[0, 1, 0], [1, 0, 0]]
    token, probs = draw(logits, SamplingConfig(), None)
    assert token.tolist() == [1, 0] and probs is None


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    probs = token_probs(logits, SamplingConfig(temperature=1.0, top_p=0.75))
    torch.testing.assert_close(probs, torch.tensor([0.625, 0.375, 0.0, 0.0]))


def test_sampling_is_reproducible_and_follows_the_distribution():
    sampling = SamplingConfig(temperature=1.0)
    logits = torch.log(torch.tensor([0.7, 0.2, 0.1]))
    draws = [int(draw(logits, sampling, torch.Generator().manual_seed(seed))[0]) for seed in range(3000)]
    again = [int(draw(logits, sampling, torch.Generator().manual_seed(seed))[0]) for seed in range(3000)]
    assert draws == again
    counts = torch.bincount(torch.tensor(draws), minlength=3).double()
    assert fit_p_value(counts[None], len(draws) * torch.tensor([[0.7, 0.2, 0.1]])) > P_FLOOR


@pytest.mark.parametrize("spread", [0.5, 8.0], ids=["nucleus-past-the-candidates", "nucleus-among-them"])
def test_top_p_over_a_large_vocabulary_matches_transformers(spread):
    """Past NUCLEUS_CANDIDATES tokens top-p looks among the most likely first, and sorts them all
    when the kept tokens do not fit: both must keep what transformers keeps."""
    vocabulary = 4 * NUCLEUS_CANDIDATES
    logits = torch.randn(3, vocabulary, generator=torch.Generator().manual_seed(1)) * spread
    expected = TopPLogitsWarper(0.9)(None, TemperatureLogitsWarper(0.7)(None, logits.clone())).softmax(-1)
    probs = token_probs(logits, SamplingConfig(temperature=0.7, top_p=0.9))
    torch.testing.assert_close(probs, expected, atol=1e-6, rtol=0)
    kept = (probs > 0).sum(-1)
    assert ((kept > NUCLEUS_CANDIDATES) if spread < 1 else (kept < NUCLEUS_CANDIDATES)).all(), kept


def test_a_draw_never_picks_a_token_of_probability_zero():
    probs = torch.zeros(2, 5000)
    probs[0, [7, 4000]] = torch.tensor([0.25, 0.75])
    probs[1, 4999] = 1.0
    draws = torch.stack([sample(probs, torch.Generator().manual_seed(seed)) for seed in range(400)])  # [400, 2]
    assert set(draws[:, 0].tolist()) == {7, 4000} and set(draws[:, 1].tolist()) == {4999}
    counts = torch.bincount(draws[:, 0], minlength=5000)[[7, 4000]].double()
    assert fit_p_value(counts[None], 400 * torch.tensor([[0.25, 0.75]])) > P_FLOOR
