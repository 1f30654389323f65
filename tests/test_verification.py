"""Verification as pure functions: exact outcomes on peaked distributions, and convergence of one
speculate-verify step to the target distribution."""

from __future__ import annotations

import pytest
import torch

from cascade.verification import residual_probs, verify, verify_greedy
from tests.goodness_of_fit import P_FLOOR, fit_p_value


def dist(*probs: float) -> torch.Tensor:
    return torch.tensor(probs, dtype=torch.float32)


def rows(*distributions: torch.Tensor) -> torch.Tensor:
    return torch.stack(distributions)


def seeded(seed: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def test_certain_acceptance_then_bonus_from_the_next_distribution():
    draft_probs = rows(dist(0, 1, 0), dist(0, 0, 1))
    target_probs = rows(dist(0, 1, 0), dist(0, 0, 1), dist(1, 0, 0))
    verdict = verify(torch.tensor([1, 2]), draft_probs, target_probs, torch.tensor([0.99, 0.99]), seeded())
    assert (verdict.accepted, verdict.next_token) == (2, 0)


def test_certain_rejection_recovers_from_the_residual():
    # the target never emits token 1; the residual after the draft's mass is all on token 2
    draft_probs = rows(dist(0.5, 0.5, 0.0))
    target_probs = rows(dist(0.5, 0.0, 0.5), dist(1, 0, 0))
    verdict = verify(torch.tensor([1]), draft_probs, target_probs, torch.tensor([0.0]), seeded())
    assert (verdict.accepted, verdict.next_token) == (0, 2)


def test_acceptance_compares_the_uniform_with_target_over_draft():
    draft_probs = rows(dist(0.2, 0.8), dist(0.2, 0.8))
    target_probs = rows(dist(0.6, 0.4), dist(0.6, 0.4), dist(0.5, 0.5))  # ratio for token 1: 0.5
    tokens = torch.tensor([1, 1])
    assert verify(tokens, draft_probs, target_probs, torch.tensor([0.49, 0.49]), seeded()).accepted == 2
    assert verify(tokens, draft_probs, target_probs, torch.tensor([0.49, 0.5]), seeded()).accepted == 1
    rejected = verify(tokens, draft_probs, target_probs, torch.tensor([0.5, 0.0]), seeded())
    assert (rejected.accepted, rejected.next_token) == (0, 0)  # residual: all on token 0


def test_residual_is_the_normalised_excess_and_falls_back_to_the_target():
    assert torch.allclose(residual_probs(dist(0.5, 0.3, 0.2), dist(0.2, 0.6, 0.2)), dist(1.0, 0.0, 0.0))
    same = dist(0.25, 0.75)
    assert torch.equal(residual_probs(same, same), same)


@pytest.mark.parametrize(
    "draft,target,expected",
    [([3, 5, 7], [3, 5, 7, 9], (3, 9)), ([3, 5, 7], [3, 4, 7, 9], (1, 4)), ([3], [2, 9], (0, 2))],
)
def test_greedy_keeps_matches_then_emits_the_verifier_argmax(draft, target, expected):
    verdict = verify_greedy(torch.tensor(draft), torch.tensor(target))
    assert (verdict.accepted, verdict.next_token) == expected


def test_one_step_emits_the_target_distribution_even_from_a_bad_draft():
    """The first emitted token of a verify step is distributed as the target, whatever the draft."""
    target = dist(0.5, 0.3, 0.15, 0.05)
    draft = dist(0.05, 0.15, 0.3, 0.5)  # deliberately reversed
    generator, draws = seeded(1), 20_000
    counts = torch.zeros(4)
    for _ in range(draws):
        token = torch.multinomial(draft, 1, generator=generator)
        uniform = torch.rand(1, generator=generator)
        verdict = verify(token, draft[None], rows(target, target), uniform, generator)
        counts[int(token) if verdict.accepted else verdict.next_token] += 1
    assert fit_p_value(counts[None], draws * target[None]) > P_FLOOR
