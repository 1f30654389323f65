"""The goodness-of-fit test the Monte-Carlo tests rely on: calibrated under the null, sharp otherwise."""

from __future__ import annotations

import torch

from tests.goodness_of_fit import MIN_EXPECTED, fit_p_value, pool_rare_cells


def test_p_values_of_exact_samples_are_uniform():
    """2000 seeded samples of 400 draws, rare cells included: about 5% and 1% fall below 0.05 and 0.01."""
    generator, probs = torch.Generator().manual_seed(0), torch.tensor([0.5, 0.3, 0.15, 0.04, 0.01])
    p_values = torch.tensor(
        [
            fit_p_value(
                torch.bincount(torch.multinomial(probs, 400, True, generator=generator), minlength=5)[None].double(),
                400 * probs[None],
            )
            for _ in range(2000)
        ]
    )
    assert 0.04 < float((p_values < 0.05).double().mean()) < 0.06
    assert 0.005 < float((p_values < 0.01).double().mean()) < 0.015


def test_a_count_the_target_forbids_fails_at_once():
    assert fit_p_value(torch.tensor([[0.0, 99.0, 1.0]]), torch.tensor([[50.0, 50.0, 0.0]])) == 0.0


def test_rare_cells_are_pooled_until_the_pool_expects_enough():
    observed, expected = pool_rare_cells(torch.tensor([1.0, 0.0, 7.0, 92.0]), torch.tensor([2.0, 1.0, 4.0, 93.0]))
    assert expected.tolist() == [7.0, 93.0] and observed.tolist() == [8.0, 92.0]
    assert expected[0] >= MIN_EXPECTED
