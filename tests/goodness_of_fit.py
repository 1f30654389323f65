"""Pearson's goodness-of-fit test for the seeded Monte-Carlo tests of sampling and verification."""

from __future__ import annotations

import torch

P_FLOOR = 1e-6
"""Seeded runs: an exact sampler would fail one seed in a million."""
MIN_EXPECTED = 5.0
"""Pearson's statistic needs about this many expected counts per cell; rarer cells are pooled."""


def fit_p_value(observed: torch.Tensor, expected: torch.Tensor) -> float:
    """Pearson's test that counts observed [R, C] follow expected [R, C] (each row's expected counts
    summing to its observed total) -> p-value; 0.0 if a cell expected never to occur holds a count."""
    if observed[expected == 0].sum() > 0:
        return 0.0
    statistic, degrees_of_freedom = 0.0, 0
    for row_observed, row_expected in zip(observed.double(), expected.double(), strict=True):
        kept_observed, kept_expected = pool_rare_cells(row_observed, row_expected)
        if len(kept_expected) > 1:  # one cell holds the row's total: nothing to test
            statistic += float(((kept_observed - kept_expected) ** 2 / kept_expected).sum())
            degrees_of_freedom += len(kept_expected) - 1
    if degrees_of_freedom == 0:
        return 1.0
    return float(torch.special.gammaincc(torch.tensor(degrees_of_freedom / 2), torch.tensor(statistic / 2)))


def pool_rare_cells(observed: torch.Tensor, expected: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One row's counts [C] -> the same with the least likely cells pooled into the first, until the
    pool expects MIN_EXPECTED (or holds the whole row)."""
    order = expected.argsort()
    pooled = min(int((expected[order].cumsum(0) < MIN_EXPECTED).sum()) + 1, len(order))
    rare, common = order[:pooled], order[pooled:]
    return (
        torch.cat([observed[rare].sum()[None], observed[common]]),
        torch.cat([expected[rare].sum()[None], expected[common]]),
    )
