"""The speculative-decoding cost model's formulas, shared by the gamma schedules and the stats."""

from __future__ import annotations


def expected_tokens(acceptance: float, gamma: int) -> float:
    """Tokens one verification pass yields with i.i.d. acceptance: (1 - a^(g+1)) / (1 - a)."""
    if acceptance >= 1.0:
        return gamma + 1.0
    return (1 - acceptance ** (gamma + 1)) / (1 - acceptance)


def rising_line(points: list[tuple[float, float, float]]) -> tuple[float, float]:
    """Weighted least-squares line through (x, y, weight) points -> (intercept, slope), flat at the
    weighted mean of y where the slope would be negative or every point has the same x."""
    total = sum(weight for _, _, weight in points)
    mean_x = sum(x * weight for x, _, weight in points) / total
    mean_y = sum(y * weight for _, y, weight in points) / total
    spread = sum(weight * (x - mean_x) ** 2 for x, _, weight in points)
    covariance = sum(weight * (x - mean_x) * (y - mean_y) for x, y, weight in points)
    slope = max(covariance / spread, 0.0) if spread else 0.0
    return mean_y - slope * mean_x, slope


def expected_speedup(acceptance: float, propose_s: float, verify_s: float, step_s: float, gamma: float) -> float:
    """Tokens per second speculating with ``gamma`` over tokens per second of plain steps."""
    if gamma == 0:
        return 1.0
    return expected_tokens(acceptance, gamma) * step_s / (propose_s * gamma + verify_s)
