"""The speculative-decoding cost model's formulas, shared by the gamma schedules and the stats."""

from __future__ import annotations


def expected_tokens(acceptance: float, gamma: int) -> float:
    """Tokens one verification pass yields with i.i.d. acceptance: (1 - a^(g+1)) / (1 - a)."""
    if acceptance >= 1.0:
        return gamma + 1.0
    return (1 - acceptance ** (gamma + 1)) / (1 - acceptance)


def expected_speedup(acceptance: float, propose_s: float, verify_s: float, step_s: float, gamma: float) -> float:
    """Tokens per second speculating with ``gamma`` over tokens per second of plain steps."""
    if gamma == 0:
        return 1.0
    return expected_tokens(acceptance, gamma) * step_s / (propose_s * gamma + verify_s)
