"""How many tokens a stage proposes per round (its gamma), round by round.

- ``fixed``: always the configured gamma.
- ``heuristic``: transformers' assisted-generation rule: +2 after a round where every proposal was
  accepted, -1 otherwise (at least 1, at most the configured gamma).
- ``cost_model``: from the stage's measured per-token acceptance ``a``, the time ``p`` of one
  proposed token, the time ``v(g)`` of a verification pass of g proposals and the time ``s`` of one
  plain step of the verifier (the median of the latest plain steps, timed where a choice hangs on
  them, ``PLAIN_STEPS_TIMED``; until then bounded by the cheapest verification pass), pick the
  gamma with the most tokens per second, (1 - a^(g+1)) / ((1 - a)(p g + v(g))), against 1 / s for
  gamma 0 (after ``WARMUP_ROUNDS`` verified rounds). With ``v(g) = s`` this is the
  textbook speed-up (1 - a^(g+1)) / ((1 - a)(c g + 1)),
  c = p / s. On a CPU a pass costs about a step while it is bound by reading the weights and more
  the more tokens it holds once its products are compute-bound (Qwen2.5 1.5B at 1K on a 2-core
  EPYC: 1.06 steps for 4 tokens, 1.10 for 8, 1.7 for 16), so ``v(g)`` is the rising piecewise-linear curve through
  the median passes and the plain step (``StageStats.verification_s``), and the warm-up rounds
  measure it at widths growing from the shortest (``warmup_gammas``: 8 -> 1, 2, 4, 8): a short gamma
  can pay where the configured one does not. From the third warm-up round on, each runs the gamma
  that would pay best if the stage were as good as its rounds so far allow (``hopeful_gamma``), and
  none once even that falls short: a draft that agrees on few tokens is dropped after a few cheap
  rounds (Qwen2.5 0.5B drafting for 1.5B on prose at 8K agreed on 0.12 of its tokens; warming up
  at 8, 4, 2, 1 cost about 4 of the 64 steps). Gamma 0 bypasses the stage (the verifier
  decodes by itself) when no gamma pays; the stage is probed again after ``PROBE_EVERY`` bypassed
  rounds, and after twice as many each time a probe finds it still does not pay (or more, so that
  what the probe cost beyond its round stays ``PROBE_SHARE`` of the time bypassed): a probe costs
  more than its round (a full-cache draft catches up on what it skipped), and SmolLM2's `self-spec`
  at 8K ran at 0.90x autoregressive with a probe every 16 tokens. While a stage speculates for a small
  gain, the verifier takes a plain step now and then (``REFRESH_EVERY``) to re-time the cost that
  gain is measured against, and once (whatever the gain) when verification passes of more tokens ran
  faster than the plain steps timed first (``StageStats.step_outpaced``). After the warm-up, a wider
  pass timed fewer than ``TRUSTED_SAMPLES`` times is tried every other round (``explore_past``). A
  request that starts from the pass costs of the runtime's previous one (``cascade.pass_costs``)
  runs ``hopeful_gamma`` over the configured gamma from its first round: only the acceptance is left
  to measure.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

from cascade.costs import acceptance_upper_bound, expected_tokens
from cascade.stats import StageStats

PROBE_EVERY = 16
"""Bypassed rounds after which the cost model first lets a stage propose again to re-measure it
(doubled after each probe that leaves it bypassed)."""
PROBE_SHARE = 0.05
"""The most of the time decoding alone that probing a bypassed stage may cost: a probe that took
2 plain steps more than its round's proposal (the Qwen2.5 0.5B draft at 16K catching up on 16-32
skipped tokens: 156-305 ms against 113 ms steps) comes again after at least 40 bypassed rounds."""
PLAIN_STEPS_TIMED = 3
"""Plain steps of the verifier timed, when a choice hangs on their cost, before the cost model goes on:
their median is the cost every speed-up is measured against, so one slow first pass cannot make
speculation look like a 50x win. A cold stage warms up without them, its passes bounding what a step
costs (``StageStats.step_range_s``), and times them only where the gamma it then picks would fall short
of ``MIN_GAIN`` at the least a step may cost (``CostModelSchedule.steps_wanted``): the Qwen2.5 pair at
32K on the AMX Xeon spent 0.42 s of a 5.0 s decode on 3 steps first, for tokens speculation makes at
~80 ms each against ~140."""
REFRESH_EVERY = 16
"""Verified rounds after which a stage that speculates for a gain below ``REFRESH_BELOW`` lets the
verifier take one plain step whose time replaces the earlier plain steps' (``StageStats.retime_plain_step``),
the interval doubling each time. The steps timed before the first round may be a process's slow first
ones: SmolLM2's `self-spec` at 64K on the 2-core EPYC timed them at 100 ms against 85 ms a step later,
predicted 1.21x for gamma 1 and ran at 0.99x of the same process's autoregressive decode."""
REFRESH_BELOW = 1.5
"""The predicted speed-up below which an error of a sixth in a plain step's cost can turn a gain into a
loss, so the step is re-timed; above it a re-timing costs more than it could save."""
WARMUP_ROUNDS = 4
"""Verified rounds (at ``warmup_gammas``) before the cost model trusts its measurements."""
TRUSTED_SAMPLES = 3
"""Clean verification passes of a width after which their median time is trusted. Until then, every
other round after the warm-up proposes one token more than the best gamma where that wider pass is
short of them: one slow pass (a 5-token pass of the Qwen2.5 1.5B at 1K on a 2-core Zen 3 took
227-234 ms once in a generation, ~150 ms in other generations) would otherwise rule out every wider
gamma for the rest of the generation, and such runs stayed at gamma 2 for 18-21 rounds of 23."""
HOPE = 0.9
"""How optimistically a warm-up reads its few rounds: the acceptance ``hopeful_gamma`` assumes is the
one that this share of its posterior lies below (after 0 of 1, 2, 3 proposals accepted: 0.68, 0.54,
0.44)."""
MIN_GAIN = 1.05
"""The least expected speed-up the cost model speculates for; below it the stage is bypassed. Its
predictions err by several percent (SmolLM2's `self-spec` at 32K on the 2-core EPYC predicted
0.98-1.10x and ran at 0.91-0.98x of autoregressive decoding), and a stage run at a loss slows the
generation down where one bypassed at a small gain only forgoes that gain."""


class Schedule:
    """``fixed``; subclasses adapt ``current`` from the stage's stats after each verified round."""

    name = "fixed"

    def __init__(self, gamma: int) -> None:
        self.gamma = gamma
        """The configured (largest) gamma."""
        self.current = gamma

    def next_gamma(self, stats: StageStats, room: int) -> int:
        """Gamma for the next round, never more than the ``room`` tokens still wanted."""
        return min(self.current, room)

    def observe(self, stats: StageStats, proposed: int, accepted: int) -> None:
        """A round of ``proposed`` tokens was verified and ``accepted`` kept; ``stats`` is cumulative."""

    def costs_forgotten(self) -> None:
        """The stage's pass costs were dropped (``StageStats.forget_pass_costs``)."""

    def extends(self, stats: StageStats, drawn: int) -> bool:
        """Whether a proposal of ``drawn`` tokens, at or past this round's gamma, may take one more
        whose draft pass costs no time (a batch runs it for other sequences anyway): never, for a
        schedule whose gammas are the user's."""
        return False

    def proven(self, stats: StageStats) -> bool:
        """Whether this stage's speculation has shown it pays, so that a stage below it may propose to
        it (see ``CostModelSchedule.proven``): always, for a schedule whose gammas are the user's."""
        return True


class HeuristicSchedule(Schedule):
    name = "heuristic"

    def observe(self, stats: StageStats, proposed: int, accepted: int) -> None:
        step = 2 if accepted == proposed else -1
        self.current = max(1, min(self.gamma, self.current + step))


class CostModelSchedule(Schedule):
    name = "cost_model"

    def __init__(self, gamma: int) -> None:
        super().__init__(gamma)
        self.current = warmup_gammas(gamma)[0]
        self.bypassed = 0
        self.probe_after = PROBE_EVERY
        """Bypassed rounds before the next probe."""
        self.probing = False
        self.unrefreshed = 0
        """Verified rounds since the verifier last took a plain step."""
        self.refresh_after = REFRESH_EVERY
        self.opened = False
        """The first round's gamma is set (from carried costs, where there are)."""
        self.explored = False
        """The last round proposed one more than the best gamma, to time that wider pass."""
        self.outpaced_retimed = False
        """A plain step was taken because verification passes ran faster than the steps timed first."""
        self.stepping = False
        """Plain steps are being timed because the gamma chosen hung on their cost (``steps_wanted``)."""

    def next_gamma(self, stats: StageStats, room: int) -> int:
        if not self.opened:
            self.opened = True
            if starts_warm(stats):
                self.current = hopeful_gamma(stats, self.gamma)
        if self.steps_wanted(stats):
            self.stepping = True
            return 0  # time plain steps of the verifier: the choice hangs on their cost
        if self.stepping:  # the plain steps it waited for are timed: choose again with their cost
            self.stepping = False
            self.current = self.chosen(stats)
        if self.current == 0:
            self.bypassed, self.unrefreshed = self.bypassed + 1, 0
            if self.bypassed > self.probe_after:
                self.current, self.bypassed, self.probing = 1, 0, True
        elif self.unrefreshed >= self.refresh_after and stats.expected_speedup(self.current) < REFRESH_BELOW:
            self.unrefreshed, self.refresh_after = 0, 2 * self.refresh_after
            stats.retime_plain_step()
            return 0
        elif not self.outpaced_retimed and stats.step_outpaced():
            self.outpaced_retimed = True
            stats.retime_plain_step()
            return 0
        return super().next_gamma(stats, room)

    def steps_wanted(self, stats: StageStats) -> bool:
        """Whether the verifier times a plain step before the next round: fewer than
        ``PLAIN_STEPS_TIMED`` timed, and the gamma chosen (read hopefully during the warm-up, as it was
        chosen) short of ``MIN_GAIN`` at the least a step may cost. Where it reaches it there, no step's
        cost can change the choice; a bypass chosen at the most a step may cost stands whatever it
        costs, and its rounds are plain steps; a cold warm-up's first two gammas are fixed."""
        if stats.plain_steps >= PLAIN_STEPS_TIMED or (stats.plain_samples and starts_warm(stats)):
            return False
        if self.stepping:
            return True
        if self.current == 0 or self.probing:
            return False
        rounds = stats.timed_rounds
        if rounds >= WARMUP_ROUNDS:
            return stats.expected_speedup(self.current, least=True) < MIN_GAIN
        if starts_warm(stats) or rounds > 1:
            return hopeful_speedups(stats, [self.current], least=True)[self.current] < MIN_GAIN
        return False

    def observe(self, stats: StageStats, proposed: int, accepted: int) -> None:
        self.unrefreshed += 1
        self.current = self.chosen(stats)
        if self.probing and stats.timed_rounds >= WARMUP_ROUNDS:  # back off while probes find it does not pay
            self.probe_after = PROBE_EVERY if self.current else max(2 * self.probe_after, repaying_rounds(stats))
            self.probing = False

    def chosen(self, stats: StageStats) -> int:
        """The next round's gamma from the rounds so far: the warm-up's, then the best one."""
        rounds = stats.timed_rounds
        if rounds >= WARMUP_ROUNDS:
            return self.explore_past(stats, best_gamma(stats, self.gamma))
        if starts_warm(stats):
            return hopeful_gamma(stats, self.gamma)
        if rounds <= 1:  # one round's proposals may include a retrieval stage's selection: go on
            return warmup_gammas(self.gamma)[rounds]
        return hopeful_gamma(stats, warmup_gammas(self.gamma)[rounds])

    def costs_forgotten(self) -> None:
        """A bypassed stage is probed at its next round: what ruled it out was timed in another batch."""
        if self.current == 0:
            self.bypassed = self.probe_after

    def extends(self, stats: StageStats, drawn: int) -> bool:
        """After the warm-up and short of the configured gamma: where the token it adds is worth more
        than what it adds to the verification pass (or, bypassed, to a plain step). It is the
        (``drawn`` + 1)-th proposal, emitted beyond the round's tokens only if every proposal is
        accepted (a^(drawn + 1)), and a token is worth what one costs at this round's gamma (a plain
        step, bypassed); the pass's cost grows along ``verification_s``."""
        if stats.timed_rounds < WARMUP_ROUNDS or not self.current <= drawn < self.gamma:
            return False
        acceptance = stats.acceptance_mle
        round_s = stats.proposal_s * self.current + stats.verification_s(self.current)
        token_s = round_s / expected_tokens(acceptance, self.current)
        added_s = stats.verification_s(drawn + 1) - stats.verification_s(drawn)
        return acceptance ** (drawn + 1) * token_s > added_s

    def proven(self, stats: StageStats) -> bool:
        """Its warm-up is over and it speculates (not bypassed, not probing, not timing plain steps):
        until then the stage below it is held back and this stage proposes by its own plain steps. A
        draft warming up under a stage that is then bypassed is lost time: in `triforce` on SmolLM2 at
        8K (`lcet10`, where the retrieval stage does not pay) the draft's own warm-up rounds cost 0.06 s
        of a 0.85 s decode, 0.94x autoregressive against 0.99x for `self-spec`, the same stage alone;
        and its rounds price the stage's proposals at what a draft still warming up costs."""
        warmed = stats.timed_rounds >= WARMUP_ROUNDS
        return warmed and self.current > 0 and not (self.probing or self.stepping)

    def explore_past(self, stats: StageStats, best: int) -> int:
        """``best``, or one more where that width has fewer than ``TRUSTED_SAMPLES`` clean passes
        (not two rounds in a row, and never past the configured gamma or out of a bypass)."""
        wider = best + 1
        under_timed = len(stats.verification_samples.get(wider, [])) < TRUSTED_SAMPLES
        self.explored = not self.explored and 0 < best < self.gamma and under_timed
        return wider if self.explored else best


def starts_warm(stats: StageStats) -> bool:
    """The generation began with carried pass costs enough to choose a gamma from: a proposal's and a
    verification's (which bound a plain step's, where the request they come from timed none)."""
    return stats.costs_carried and bool(stats.proposal_samples and stats.verification_samples)


def repaying_rounds(stats: StageStats) -> int:
    """Bypassed rounds over which the last probe's extra time (its proposal beyond a proposal's
    median: the stage catching up on what it skipped, ``catch_up_s``) is ``PROBE_SHARE`` of decoding alone."""
    extra = stats.catch_up_s - stats.proposal_s if stats.catch_up_s else 0.0
    return math.ceil(max(extra, 0.0) / (PROBE_SHARE * stats.step_s)) if stats.step_s else 0


def warmup_gammas(largest: int) -> list[int]:
    """Gammas of the warm-up rounds, the widest last: the configured one halved round by round, in
    growing order (8: 1, 2, 4, 8), so the verification passes are timed at several widths and a
    draft that agrees on little costs little while it is measured."""
    return [max(1, largest >> halvings) for halvings in reversed(range(WARMUP_ROUNDS))]


def hopeful_gamma(stats: StageStats, widest: int) -> int:
    """The gamma in [1, ``widest``] that would pay best if the stage were as good as its rounds so far
    allow (acceptance at its ``HOPE`` upper bound, a proposal at its cheapest round, a pass wider than
    any timed no dearer than the widest), or 0 if even that falls short of ``MIN_GAIN``: a warm-up
    round that cannot pay is not run. The passes' slope is not read from two narrow widths: the
    Qwen2.5 1.5B at 32K on the AMX Xeon timed 2-token passes at 150-230 ms (the VM's speed swinging)
    beside 145-200 ms steps, the curve continued that rise to 0.6 s for 9 tokens, and the draft,
    agreeing on 0.88, stayed at gamma 1 for 27 rounds of 34 (1.55x where wider rounds ran 1.92x)."""
    speedups = hopeful_speedups(stats, range(1, widest + 1))
    gamma = max(speedups, key=lambda g: (speedups[g], -g))
    return gamma if speedups[gamma] >= MIN_GAIN else 0


def hopeful_speedups(stats: StageStats, gammas: Iterable[int], least: bool = False) -> dict[int, float]:
    """The speed-up at each of ``gammas`` read as ``hopeful_gamma`` reads it (``least``: against the
    least a plain step may cost, ``StageStats.step_range_s``)."""
    acceptance = acceptance_upper_bound(stats.accepted, stats.rejections, HOPE)  # a bisection: once
    # its plain steps' while the stage below is bypassed or held; none clean yet: the catch-up's
    proposal_s = stats.alone_proposal_s or min(stats.proposal_samples or [stats.catch_up_s])
    return {gamma: stats.expected_speedup(gamma, acceptance, proposal_s, hopeful=True, least=least) for gamma in gammas}


def best_gamma(stats: StageStats, largest: int) -> int:
    """The gamma in [1, largest] with the highest expected speed-up if that reaches ``MIN_GAIN``, else 0
    (speculation does not pay enough)."""
    gamma = max(range(1, largest + 1), key=lambda g: (stats.expected_speedup(g), -g))
    return gamma if stats.expected_speedup(gamma) >= MIN_GAIN else 0


SCHEDULES: dict[str, type[Schedule]] = {
    schedule.name: schedule for schedule in (Schedule, HeuristicSchedule, CostModelSchedule)
}
