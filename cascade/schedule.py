"""How many tokens a stage proposes per round (its gamma), round by round.

- ``fixed``: always the configured gamma.
- ``heuristic``: transformers' assisted-generation rule: +2 after a round where every proposal was
  accepted, -1 otherwise (at least 1, at most the configured gamma).
- ``cost_model``: from the stage's measured per-token acceptance ``a`` and cost ratio ``c`` (one
  proposed token over one verification pass), pick the gamma maximising the expected speed-up
  (1 - a^(g+1)) / ((1 - a)(c g + 1)); gamma 0 bypasses the stage (the verifier then decodes by
  itself) when no gamma pays, and the stage is probed again every ``PROBE_EVERY`` rounds.
"""

from __future__ import annotations

from cascade.stats import StageStats

PROBE_EVERY = 16
"""Bypassed rounds after which the cost model lets a stage propose again to re-measure it."""
WARMUP_ROUNDS = 4
"""Verified rounds at the configured gamma before the cost model trusts its measurements."""


def expected_tokens(acceptance: float, gamma: int) -> float:
    """Tokens one verification pass yields with i.i.d. acceptance: (1 - a^(g+1)) / (1 - a)."""
    if acceptance >= 1.0:
        return gamma + 1.0
    return (1 - acceptance ** (gamma + 1)) / (1 - acceptance)


def expected_speedup(acceptance: float, cost_ratio: float, gamma: float) -> float:
    """Tokens per verification over the time of gamma proposals plus one verification pass."""
    return expected_tokens(acceptance, gamma) / (cost_ratio * gamma + 1)


class Schedule:
    """``fixed``; subclasses adapt ``current`` from the stage's stats after each verified round."""

    name = "fixed"

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma
        """The configured (largest) gamma."""
        self.current = gamma

    def next_gamma(self, room: int) -> int:
        """Gamma for the next round, never more than the ``room`` tokens still wanted."""
        return min(self.current, room)

    def observe(self, stats: StageStats, proposed: int, accepted: int) -> None:
        """A round of ``proposed`` tokens was verified and ``accepted`` kept; ``stats`` is cumulative."""


class HeuristicSchedule(Schedule):
    name = "heuristic"

    def observe(self, stats: StageStats, proposed: int, accepted: int) -> None:
        step = 2 if accepted == proposed else -1
        self.current = max(1, min(self.gamma, self.current + step))


class CostModelSchedule(Schedule):
    name = "cost_model"

    def __init__(self, gamma: int) -> None:
        super().__init__(gamma)
        self.bypassed = 0

    def next_gamma(self, room: int) -> int:
        if self.current == 0:
            self.bypassed += 1
            if self.bypassed > PROBE_EVERY:
                self.current, self.bypassed = 1, 0
        return super().next_gamma(room)

    def observe(self, stats: StageStats, proposed: int, accepted: int) -> None:
        if stats.rounds >= WARMUP_ROUNDS:
            self.current = best_gamma(stats.acceptance_mle, stats.cost_ratio, self.gamma)


def best_gamma(acceptance: float, cost_ratio: float, largest: int) -> int:
    """The gamma in [0, largest] with the highest expected speed-up (0: speculation does not pay)."""
    return max(range(largest + 1), key=lambda g: (expected_speedup(acceptance, cost_ratio, g), -g))


SCHEDULES: dict[str, type[Schedule]] = {
    schedule.name: schedule for schedule in (Schedule, HeuristicSchedule, CostModelSchedule)
}
