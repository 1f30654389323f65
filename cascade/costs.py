"""The speculative-decoding cost model's formulas, shared by the gamma schedules and the stats."""

from __future__ import annotations

import math


def expected_tokens(acceptance: float, gamma: int) -> float:
    """Tokens one verification pass yields with i.i.d. acceptance: (1 - a^(g+1)) / (1 - a)."""
    if acceptance >= 1.0:
        return gamma + 1.0
    return (1 - acceptance ** (gamma + 1)) / (1 - acceptance)


def rising_curve(points: list[tuple[float, float, float]]) -> list[tuple[float, float]]:
    """(x, y, weight) points -> knots (x, y), one per distinct x in increasing order, of the closest
    non-decreasing curve through them (weighted least squares, by pooling adjacent means that fall):
    a pass of more tokens costs no less, though noise may say otherwise."""
    by_x: dict[float, tuple[float, float]] = {}  # x -> (weighted sum of y, weight)
    for x, y, weight in points:
        total, count = by_x.get(x, (0.0, 0.0))
        by_x[x] = (total + y * weight, count + weight)
    pools: list[tuple[list[float], float, float]] = []  # (xs, weighted sum of y, weight), means rising
    for x in sorted(by_x):
        pools.append(([x], *by_x[x]))
        while len(pools) > 1 and pools[-2][1] * pools[-1][2] > pools[-1][1] * pools[-2][2]:
            xs, total, weight = pools.pop()
            earlier_xs, earlier_total, earlier_weight = pools.pop()
            pools.append((earlier_xs + xs, earlier_total + total, earlier_weight + weight))
    return [(x, total / weight) for xs, total, weight in pools for x in xs]


def along_curve(knots: list[tuple[float, float]], x: float, extend: bool = True) -> float:
    """The piecewise-linear curve through ``knots`` (from ``rising_curve``) at x: flat before the
    first knot, continued along the last segment past the last one (flat there too unless ``extend``)."""
    if len(knots) == 1 or x <= knots[0][0]:
        return knots[0][1]
    if not extend and x >= knots[-1][0]:
        return knots[-1][1]
    index = next((i for i in range(1, len(knots)) if x <= knots[i][0]), len(knots) - 1)
    (x0, y0), (x1, y1) = knots[index - 1], knots[index]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def expected_speedup(acceptance: float, propose_s: float, verify_s: float, step_s: float, gamma: float) -> float:
    """Tokens per second speculating with ``gamma`` over tokens per second of plain steps."""
    if gamma == 0:
        return 1.0
    return expected_tokens(acceptance, gamma) * step_s / (propose_s * gamma + verify_s)


def acceptance_upper_bound(accepted: int, rejections: int, confidence: float) -> float:
    """The per-token acceptance below which ``confidence`` of its posterior lies, from ``accepted``
    proposals and ``rejections`` (a uniform prior: Beta(accepted + 1, rejections + 1)): an optimistic
    reading of a few rounds. Found by bisection on the Beta CDF, which for whole parameters is the
    binomial tail P(Binomial(accepted + rejections + 1, a) >= accepted + 1)."""
    low, high = 0.0, 1.0
    for _ in range(40):
        middle = (low + high) / 2
        if binomial_tail(accepted + rejections + 1, accepted + 1, middle) < confidence:
            low = middle
        else:
            high = middle
    return (low + high) / 2


def binomial_tail(trials: int, least: int, probability: float) -> float:
    """P(Binomial(trials, probability) >= least), for 0 < probability < 1."""
    log_p, log_q = math.log(probability), math.log1p(-probability)
    return sum(
        math.exp(
            math.lgamma(trials + 1)
            - math.lgamma(k + 1)
            - math.lgamma(trials - k + 1)
            + k * log_p
            + (trials - k) * log_q
        )
        for k in range(least, trials + 1)
    )
