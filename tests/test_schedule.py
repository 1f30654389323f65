"""Gamma schedules and the cost model, on hand-set measurements."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from cascade.costs import (
    acceptance_upper_bound,
    along_curve,
    binomial_tail,
    expected_speedup,
    expected_tokens,
    rising_curve,
)
from cascade.pipeline import Pipeline
from cascade.schedule import (
    MIN_GAIN,
    PLAIN_STEPS_TIMED,
    PROBE_EVERY,
    REFRESH_BELOW,
    REFRESH_EVERY,
    TRUSTED_SAMPLES,
    WARMUP_ROUNDS,
    CostModelSchedule,
    HeuristicSchedule,
    Schedule,
    best_gamma,
    hopeful_gamma,
    hopeful_speedups,
    repaying_rounds,
    warmup_gammas,
)
from cascade.stats import PLAIN_SAMPLES_KEPT, StageStats


def measured(
    acceptance_runs: list[tuple[int, int]], propose_s: float, verify_s: float | dict[int, float], step_s: float | None
) -> StageStats:
    """Stats of rounds (proposed, accepted), each proposal costing propose_s, each verification verify_s
    (or ``verify_s[proposed]``), after ``PLAIN_STEPS_TIMED`` plain steps of step_s (None: no plain step,
    a cold stage's warm-up)."""
    stats = StageStats("proposer")
    for _ in range(PLAIN_STEPS_TIMED if step_s is not None else 0):
        stats.record_plain_step(step_s)
    for proposed, accepted in acceptance_runs:
        record_round(
            stats, proposed, accepted, propose_s, verify_s[proposed] if isinstance(verify_s, dict) else verify_s
        )
    return stats


def record_round(stats: StageStats, proposed: int, accepted: int, propose_s: float, verify_s: float) -> None:
    """What the pipeline records of a clean, timed round: ``proposed`` tokens at ``propose_s`` each,
    ``accepted`` of them, verified in ``verify_s``."""
    stats.rounds += 1
    stats.timed_rounds += 1
    stats.proposed += proposed
    stats.accepted += accepted
    stats.rejections += accepted < proposed
    stats.record_proposals(proposed, propose_s * proposed)
    stats.verify_s += verify_s
    stats.record_verification(proposed, verify_s)


def test_expected_tokens_per_verification():
    assert expected_tokens(0.0, 4) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)


def test_with_verification_as_cheap_as_a_step_the_speedup_is_the_textbook_one():
    acceptance, cost_ratio, gamma = 0.8, 0.1, 4
    textbook = (1 - acceptance ** (gamma + 1)) / ((1 - acceptance) * (cost_ratio * gamma + 1))
    assert expected_speedup(acceptance, 0.01, 0.1, 0.1, gamma) == pytest.approx(textbook)
    assert expected_speedup(acceptance, 0.01, 0.2, 0.1, gamma) == pytest.approx(textbook / 2 * 1.4 / 1.2)


def test_rounds_the_verifier_decoded_alone_count_as_plain_steps_in_the_overall_speedup():
    """Every round proposes 4 and keeps all 4 at the cost of one step: 5 tokens a step; 3 rounds
    of 5 tokens and 2 plain rounds (a lookup that found nothing) of 1 token take 3 + 2 steps, and
    with 51 rounds bypassed the generation is predicted barely faster than decoding alone."""
    stats = measured([(4, 4)] * 3, propose_s=0.0, verify_s=0.1, step_s=0.1)
    assert stats.overall_speedup(4) == pytest.approx(stats.expected_speedup(4)) == pytest.approx(5.0)
    stats.plain_rounds = 2
    assert stats.overall_speedup(4) == pytest.approx((3 * 5 + 2) / (3 + 2))
    stats.plain_rounds = 51
    assert stats.overall_speedup(4) == pytest.approx((3 * 5 + 51) / (3 + 51))  # 1.22x


def test_fixed_and_heuristic_schedules():
    stats = StageStats("proposer")
    assert Schedule(5).next_gamma(stats, room=3) == 3
    heuristic = HeuristicSchedule(6)
    heuristic.current = 4
    heuristic.observe(stats, 4, 4)
    assert heuristic.current == 6
    heuristic.observe(stats, 6, 6)
    assert heuristic.current == 6  # at most the configured gamma
    for _ in range(10):
        heuristic.observe(stats, 6, 0)
    assert heuristic.current == 1  # at least 1


def test_a_cold_stage_warms_up_and_speculates_without_plain_steps_where_their_cost_cannot_change_the_choice():
    """The Qwen2.5 pair at 32K on the AMX Xeon: 2-9-token passes 150-185 ms, proposals 25 ms, nearly
    every proposal accepted. A plain step costs at most the cheapest pass: even at two thirds of it
    (``PASS_OVER_STEP``) gamma 8 pays, so no step is timed; its 3 first steps had cost 0.42 s of 5 s."""
    passes = {1: 0.150, 2: 0.155, 4: 0.165, 8: 0.185}
    schedule, rounds = CostModelSchedule(8), []
    for _ in range(WARMUP_ROUNDS):
        rounds.append(schedule.next_gamma(measured([(g, g) for g in rounds], 0.025, passes, step_s=None), room=100))
        stats = measured([(g, g) for g in rounds], 0.025, passes, step_s=None)
        schedule.observe(stats, rounds[-1], rounds[-1])
    assert rounds[:2] == warmup_gammas(8)[:2] and 0 not in rounds
    assert stats.step_range_s == pytest.approx((0.1, 0.15))
    assert stats.expected_speedup(8, least=True) >= MIN_GAIN
    assert schedule.next_gamma(stats, room=100) == 8 and stats.plain_steps == 0


def test_a_cold_stage_times_plain_steps_once_its_choice_hangs_on_them_then_picks_the_best_gamma():
    """A draft agreeing on a third of its tokens: gamma 2 pays if a step costs what the cheapest pass
    does, not if it costs two thirds of it, so ``PLAIN_STEPS_TIMED`` steps are timed before the next
    round, and the gamma is chosen again from their cost."""
    schedule = CostModelSchedule(8)
    mediocre = measured([(4, 0), (4, 1)] * (WARMUP_ROUNDS // 2), propose_s=0.005, verify_s=0.12, step_s=None)  # a = 1/3
    schedule.observe(mediocre, 4, 1)
    assert mediocre.expected_speedup(schedule.current, least=True) < MIN_GAIN <= mediocre.expected_speedup(2)
    for _ in range(PLAIN_STEPS_TIMED):
        assert schedule.next_gamma(mediocre, room=100) == 0
        mediocre.record_plain_step(0.1)
    # passes rising from the 0.1 s step to 0.12 s at 4 tokens: speed-ups 1.21, 1.20, 1.14 for gamma 1-3
    # (before the steps, 1.28-1.33 at the most a step may cost and 0.85-0.89 at the least)
    assert best_gamma(mediocre, 8) == 1
    assert schedule.next_gamma(mediocre, room=100) == 1
    assert schedule.next_gamma(mediocre, room=100) == 1 and mediocre.plain_steps == PLAIN_STEPS_TIMED
    good = measured([(8, 8)] * WARMUP_ROUNDS, propose_s=0.01, verify_s=0.12, step_s=0.1)
    schedule.observe(good, 8, 8)
    assert schedule.next_gamma(good, room=100) == 8


def test_a_cold_warm_up_times_plain_steps_as_soon_as_its_hopeful_gamma_hangs_on_them():
    """The Qwen2.5 0.5B drafting for 1.5B on prose at 8K: proposals 23 ms, 2- and 3-token passes 88 and
    100 ms, nothing accepted in the first two rounds. Read hopefully, gamma 1 pays against a step as
    dear as the cheapest pass and not against two thirds of it: the steps are timed before the third
    round (85 ms), and the gamma is chosen again from them."""
    schedule = CostModelSchedule(8)
    stats = measured([(1, 0), (2, 0)], propose_s=0.023, verify_s={1: 0.088, 2: 0.100}, step_s=None)
    schedule.observe(stats, 2, 0)
    assert (
        schedule.current == 1
        and hopeful_speedups(stats, [1], least=True)[1] < MIN_GAIN <= hopeful_speedups(stats, [1])[1]
    )
    for _ in range(PLAIN_STEPS_TIMED):
        assert schedule.next_gamma(stats, room=100) == 0
        stats.record_plain_step(0.085)
    assert schedule.next_gamma(stats, room=100) == hopeful_gamma(stats, warmup_gammas(8)[2]) == 1


def test_a_bypass_chosen_at_the_most_a_step_may_cost_takes_no_plain_steps_first():
    """A draft that agrees on nothing does not pay even against the dearest step: it is bypassed at
    once, and its bypassed rounds are the plain steps."""
    schedule = CostModelSchedule(6)
    useless = measured([(1, 0), (1, 0), (3, 0), (6, 0)], propose_s=0.05, verify_s=0.15, step_s=None)
    schedule.observe(useless, 6, 0)
    assert schedule.current == 0 and not schedule.steps_wanted(useless)


def test_cost_model_bypasses_a_stage_that_does_not_pay_and_probes_it_again():
    schedule = CostModelSchedule(6)
    useless = measured([(6, 0)] * WARMUP_ROUNDS, propose_s=0.05, verify_s=0.15, step_s=0.1)
    schedule.observe(useless, 6, 0)
    gammas = [schedule.next_gamma(useless, room=100) for _ in range(PROBE_EVERY + 1)]
    assert gammas == [0] * PROBE_EVERY + [1]


def test_probes_that_keep_failing_come_twice_as_late_each_time_and_a_paying_one_resets_the_interval():
    schedule = CostModelSchedule(6)
    useless = measured([(6, 0)] * WARMUP_ROUNDS, propose_s=0.05, verify_s=0.15, step_s=0.1)
    schedule.observe(useless, 6, 0)
    bypassed_before_probes = []
    for _ in range(3):
        gammas = [schedule.next_gamma(useless, room=100) for _ in range(8 * PROBE_EVERY)]
        bypassed_before_probes.append(gammas.index(1))
        schedule.observe(useless, 1, 0)  # the probe's round: still no use
        assert schedule.current == 0
    assert bypassed_before_probes == [PROBE_EVERY, 2 * PROBE_EVERY, 4 * PROBE_EVERY]
    paying = measured([(6, 6)] * WARMUP_ROUNDS, propose_s=0.001, verify_s=0.1, step_s=0.1)
    gammas = [schedule.next_gamma(paying, room=100) for _ in range(8 * PROBE_EVERY + 1)]
    assert gammas[-1] == 1
    schedule.observe(paying, 1, 1)
    assert schedule.current > 0 and schedule.probe_after == PROBE_EVERY


def test_a_dear_probe_comes_again_only_once_the_bypassed_rounds_repay_it():
    """The Qwen2.5 0.5B draft at 16K: a probe's proposal took 305 ms (catching up on what it skipped)
    against 30 ms for the others, with 113 ms plain steps: it cost 2.4 steps more than its round,
    so the next probe waits for 49 bypassed rounds (5% of them), not 32."""
    schedule = CostModelSchedule(8)
    useless = measured([(1, 0)] * WARMUP_ROUNDS, propose_s=0.030, verify_s=0.12, step_s=0.113)
    schedule.observe(useless, 1, 0)
    assert [schedule.next_gamma(useless, room=100) for _ in range(PROBE_EVERY + 1)][-1] == 1
    useless.record_proposals(1, 0.305, caught_up=True)  # the probe's round
    assert useless.proposal_s == 0.030 and useless.catch_up_s == 0.305
    schedule.observe(useless, 1, 0)
    assert schedule.current == 0 and schedule.probe_after == repaying_rounds(useless) == 49 > 2 * PROBE_EVERY


def test_a_probes_catch_up_does_not_price_the_proposals():
    """The Qwen2.5 0.5B draft at 16K on a 2-core Zen 3, cold: its first round followed the verifier's
    plain steps and two probes followed bypassed rounds, each first feeding the tokens it had skipped
    (0.063, 0.189 and 0.242 s a token against 0.03-0.04): among the proposal samples they priced a
    proposal at 0.12 s. Kept apart, they leave the clean rounds' median, and the latest is the probe's
    price (``repaying_rounds``)."""
    stats = measured([(1, 1), (2, 2)], propose_s=0.03, verify_s={1: 0.17, 2: 0.2}, step_s=0.13)
    for seconds in (0.063, 0.189, 0.242):
        stats.record_proposals(1, seconds, caught_up=True)
    assert stats.proposal_samples == [0.03, 0.03] and stats.proposal_s == 0.03 and stats.catch_up_s == 0.242
    assert stats.timed_proposed == 6 and stats.propose_s == pytest.approx(0.03 * 3 + 0.063 + 0.189 + 0.242)
    assert best_gamma(stats, 8) > 0
    only_caught_up = StageStats("proposer")
    only_caught_up.record_plain_step(0.13)
    only_caught_up.record_proposals(1, 0.063, caught_up=True)
    assert only_caught_up.expected_speedup(1) == 1.0  # no clean proposal: no estimate
    assumed = only_caught_up.expected_speedup(1, 0.9, proposal_s=0.063)  # a price given is used
    assert assumed == pytest.approx(expected_speedup(0.9, 0.063, 0.13, 0.13, 1))


def test_a_slow_first_plain_step_does_not_set_the_cost_speculation_is_measured_against():
    """A triforce run at 2K once predicted a 51.8x speed-up from one 3.1 s plain step (a warm-up)."""
    stats = measured([(6, 6)] * WARMUP_ROUNDS, propose_s=0.002, verify_s=0.03, step_s=0.025)
    stats.record_plain_step(3.1)
    assert stats.step_s == pytest.approx(0.025)  # the median of 0.025, 0.025, 0.025, 3.1
    assert stats.expected_speedup(6) < 7  # at most gamma + 1 tokens per round of ~a step
    assert stats.verify_over_step == pytest.approx(0.03 / 0.025)
    for _ in range(PLAIN_SAMPLES_KEPT):
        stats.record_plain_step(0.05)  # the context grew: the latest samples tell
    assert stats.step_s == 0.05 and len(stats.plain_samples) == PLAIN_SAMPLES_KEPT
    assert stats.plain_steps == PLAIN_STEPS_TIMED + 1 + PLAIN_SAMPLES_KEPT


def test_a_stage_speculating_for_a_small_gain_re_times_a_plain_step_now_and_then():
    """SmolLM2's `self-spec` at 64K: three first plain steps of 100 ms, 85 ms later; gamma 1 predicted
    1.21x on them. A plain step after 16 verified rounds (then 32, 64) replaces their time, and the
    stage, no longer paying, is bypassed."""
    schedule = CostModelSchedule(1)
    stats = measured([(1, 1), (1, 0)] * (WARMUP_ROUNDS // 2), propose_s=0.015, verify_s=0.113, step_s=0.100)
    schedule.observe(stats, 1, 0)
    assert schedule.current == 1 and REFRESH_BELOW > stats.expected_speedup(1) > MIN_GAIN
    gammas = []
    for _ in range(REFRESH_EVERY):
        gammas.append(schedule.next_gamma(stats, room=100))
        schedule.observe(stats, 1, 1)
    assert gammas == [1] * (REFRESH_EVERY - 1) + [0] and schedule.refresh_after == 2 * REFRESH_EVERY
    assert stats.plain_samples_stale and stats.step_s == 0.100  # until the plain step is timed
    stats.record_plain_step(0.085)
    assert stats.step_s == 0.085 and not stats.plain_samples_stale
    schedule.observe(stats, 1, 0)
    assert schedule.current == 0  # (1 + a) 85 ms / (15 + 113 ms) < MIN_GAIN at a = 0.5


def test_a_stage_speculating_for_a_large_gain_is_not_interrupted():
    schedule = CostModelSchedule(4)
    stats = measured([(4, 4)] * WARMUP_ROUNDS, propose_s=0.005, verify_s=0.11, step_s=0.1)
    schedule.observe(stats, 4, 4)
    assert stats.expected_speedup(schedule.current) >= REFRESH_BELOW
    gammas = []
    for _ in range(4 * REFRESH_EVERY):
        gammas.append(schedule.next_gamma(stats, room=100))
        schedule.observe(stats, 4, 4)
    assert 0 not in gammas


def test_cost_model_stops_warming_up_on_a_stage_whose_costs_alone_rule_it_out():
    """SmolLM2 self-spec at 8K on the EPYC VM: every proposal accepted, but a retrieval proposal cost
    28 ms against a 27 ms plain step and a 2-token pass 40 ms: no gamma pays, so after two rounds
    (the first may include the retrieval stage's selection) it is bypassed rather than warmed up on."""
    schedule = CostModelSchedule(6)
    costly = measured([(1, 1)], propose_s=0.028, verify_s=0.04, step_s=0.027)
    schedule.observe(costly, 1, 1)
    assert schedule.current == warmup_gammas(6)[1]  # one round does not decide
    costly = measured([(1, 1), (1, 1)], propose_s=0.028, verify_s=0.04, step_s=0.027)
    schedule.observe(costly, 1, 1)
    assert schedule.current == 0 and schedule.next_gamma(costly, room=100) == 0
    cheap = measured([(1, 1), (1, 0)], propose_s=0.005, verify_s=0.03, step_s=0.027)  # could pay: go on
    schedule = CostModelSchedule(6)
    schedule.observe(cheap, 1, 0)
    assert schedule.current == warmup_gammas(6)[2] == 3


def test_the_warm_up_times_passes_at_growing_widths_up_to_the_configured_gamma():
    assert warmup_gammas(8) == [1, 2, 4, 8][-WARMUP_ROUNDS:]
    assert warmup_gammas(6) == [1, 1, 3, 6][-WARMUP_ROUNDS:]
    schedule, rounds = CostModelSchedule(8), []
    stats = measured([], propose_s=0.01, verify_s=0.1, step_s=0.1)
    for _ in range(WARMUP_ROUNDS):
        gamma = schedule.next_gamma(stats, room=100)
        rounds.append(gamma)
        stats = measured([(g, g) for g in rounds], propose_s=0.01, verify_s=0.1, step_s=0.1)
        schedule.observe(stats, gamma, gamma)
    assert rounds == warmup_gammas(8)


def test_the_warm_up_does_not_read_a_slope_from_two_narrow_passes():
    """The Qwen2.5 pair at 32K on the AMX Xeon: steps 145-200 ms, a proposal 24 ms, 2-token passes
    timed slow (the VM's speed swinging) beside 1-token ones; continued along that rise, wider passes
    looked ruinous and the warm-up, every proposal accepted, went on at gamma 1 instead of timing 4."""
    passes = {1: 0.155, 2: 0.23}
    stats = measured([(1, 1), (2, 2)], propose_s=0.024, verify_s=passes, step_s=0.165)
    assert stats.verification_s(4) > 0.36 and stats.verification_s(4, hopeful=True) == 0.23
    schedule = CostModelSchedule(8)
    schedule.observe(stats, 2, 2)
    assert schedule.current == warmup_gammas(8)[2] == 4


def test_a_draft_that_agrees_on_little_is_warmed_up_on_at_short_gammas():
    """Qwen2.5 0.5B drafting for 1.5B on prose at 8K (EPYC VM): a proposal 23 ms, a plain step 85 ms,
    passes of 2, 3, 5 and 9 tokens 88, 100, 110 and 153 ms; the draft agreed on 2 of 17 tokens.
    Warmed up at 8, 4, 2, 1 it spent ~4 steps more than decoding alone would; read hopefully, its
    first rejections allow no more than gamma 1, and the measured acceptance then bypasses it."""
    passes = {1: 0.088, 2: 0.100, 4: 0.110, 8: 0.153}
    schedule, rounds = CostModelSchedule(8), []
    for _ in range(WARMUP_ROUNDS):
        rounds.append(schedule.next_gamma(measured([], 0.023, passes, 0.085), room=100))
        stats = measured([(gamma, 0) for gamma in rounds], propose_s=0.023, verify_s=passes, step_s=0.085)
        schedule.observe(stats, rounds[-1], 0)
    assert rounds == [1, 2, 1, 1] and schedule.current == 0
    dear = {gamma: 1.3 * seconds for gamma, seconds in passes.items()}  # passes 1.3x dearer: dropped sooner
    schedule = CostModelSchedule(8)
    schedule.observe(measured([(1, 0), (2, 0)], propose_s=0.023, verify_s=dear, step_s=0.085), 2, 0)
    assert schedule.current == 0


def test_the_hopeful_acceptance_is_an_upper_quantile_of_its_posterior():
    for rejections in range(5):  # Beta(1, r + 1): 1 - (1 - q)^(1 / (r + 1))
        assert acceptance_upper_bound(0, rejections, 0.9) == pytest.approx(1 - 0.1 ** (1 / (rejections + 1)))
    for accepted in range(5):  # Beta(k + 1, 1): q^(1 / (k + 1))
        assert acceptance_upper_bound(accepted, 0, 0.9) == pytest.approx(0.9 ** (1 / (accepted + 1)))
    assert acceptance_upper_bound(30, 10, 0.9) > 30 / 40 > acceptance_upper_bound(30, 10, 0.1)
    assert binomial_tail(4, 0, 0.3) == pytest.approx(1.0) and binomial_tail(2, 2, 0.5) == pytest.approx(0.25)


def test_the_verification_curve_fits_weighted_means_and_never_falls():
    assert rising_curve([(0, 1.0, 1), (2, 2.0, 1)]) == [(0, 1.0), (2, 2.0)]
    assert rising_curve([(0, 1.0, 3), (1, 2.0, 1), (1, 4.0, 1)]) == [(0, 1.0), (1, 3.0)]  # mean per width
    assert rising_curve([(6, 2.0, 4)]) == [(6, 2.0)]
    assert rising_curve([(0, 3.0, 1), (6, 1.0, 1)]) == [(0, 2.0), (6, 2.0)]  # falling: pooled, flat
    pooled = rising_curve([(0, 1.0, 3), (2, 0.9, 1), (4, 1.2, 1), (8, 2.0, 1)])  # a fast 3-token pass:
    assert [x for x, _ in pooled] == [0, 2, 4, 8]  # pooled with the plain steps
    assert [y for _, y in pooled] == pytest.approx([0.975, 0.975, 1.2, 2.0])
    knots = [(0, 1.0), (4, 1.2), (8, 2.0)]
    assert [along_curve(knots, x) for x in (0, 2, 4, 6, 8, 10)] == pytest.approx([1.0, 1.1, 1.2, 1.6, 2.0, 2.4])
    assert along_curve([(6, 2.0)], 1) == along_curve([(6, 2.0)], 9) == 2.0


def test_verification_cost_is_interpolated_between_a_plain_step_and_the_measured_passes():
    stats = measured([(6, 1)] * WARMUP_ROUNDS, propose_s=0.047, verify_s=0.215, step_s=0.13)
    assert stats.verification_s(0) == pytest.approx(0.13)
    assert stats.verification_s(6) == pytest.approx(0.215)
    assert stats.verification_s(1) == pytest.approx(0.13 + 0.085 / 6)
    unstepped = measured([(6, 1)], propose_s=0.047, verify_s=0.215, step_s=None)
    assert unstepped.verification_s(1) == pytest.approx(0.215)  # nothing to interpolate from yet
    unstepped.verification_samples = {}
    assert unstepped.verification_s(1) == pytest.approx(0.215)  # only passes that caught up: their mean
    assert StageStats("fresh").verification_s(1) == 0.0


def test_cost_model_finds_the_short_gamma_that_pays_when_passes_grow_with_their_width():
    """32K on this CPU: a = 0.5, a retrieval proposal 47 ms, a plain step 130 ms, a 7-token pass
    215 ms. Gamma 6 loses (0.52x), and so does gamma 1 if its 2-token pass cost as much as a
    7-token one (0.74x); at its fitted 144 ms it would gain 2%, less than ``MIN_GAIN``: bypassed.
    With 30 ms proposals gamma 1 gains 12% and is chosen."""
    stats = measured([(6, 1)] * WARMUP_ROUNDS, propose_s=0.047, verify_s=0.215, step_s=0.13)
    assert stats.expected_speedup(6) == pytest.approx(0.52, abs=0.01)
    assert stats.expected_speedup(1) == pytest.approx(1.02, abs=0.01) and stats.expected_speedup(1) < MIN_GAIN
    schedule = CostModelSchedule(6)
    schedule.observe(stats, 6, 1)
    assert schedule.next_gamma(stats, room=100) == 0
    cheaper = measured([(6, 1)] * WARMUP_ROUNDS, propose_s=0.03, verify_s=0.215, step_s=0.13)
    assert cheaper.expected_speedup(1) == pytest.approx(1.12, abs=0.01)
    cheaper.verification_samples[2] = [cheaper.verification_s(2)] * TRUSTED_SAMPLES  # timed as the curve says
    schedule.observe(cheaper, 6, 1)
    assert schedule.next_gamma(cheaper, room=100) == 1


def test_cost_model_picks_the_widest_pass_still_bound_by_the_weights():
    """Qwen2.5 0.5B (int8) drafting for 1.5B at 1K on the 2-core EPYC: a proposal 23 ms, a plain step
    104 ms, passes of 2-3 tokens about a step, of 5 tokens 131 ms, of 9 tokens 225 ms; per-token
    acceptance 0.96. A line from the plain step to the 9-token pass would put gamma 8 first (1.97x
    against 1.88x at gamma 4); on the measured curve gamma 4 wins (2.16x against 1.97x)."""
    passes = {8: 0.225, 4: 0.131, 2: 0.112, 1: 0.105}
    rounds = [(8, 8), (4, 4), (2, 2), (1, 1)] * 3 + [(8, 3)] * 2  # 51 accepted, 2 rejections: a = 0.96
    stats = measured(rounds, propose_s=0.023, verify_s=passes, step_s=0.104)
    assert stats.verification_s(3) == pytest.approx((0.112 + 0.131) / 2)
    assert stats.expected_speedup(4) == pytest.approx(2.16, abs=0.01)
    assert stats.expected_speedup(8) == pytest.approx(1.97, abs=0.01)
    assert best_gamma(stats, 8) == 4


def test_a_width_timed_dear_once_is_timed_again_before_it_rules_out_wider_gammas():
    """The Qwen pair at 1K on the Zen 3: a 5-token pass timed once at 227 ms (~150 ms in other
    rounds) held a generation at gamma 2 for 21 rounds. After the warm-up every other round proposes
    one more than the best gamma while that width has fewer than ``TRUSTED_SAMPLES`` passes; their
    median then sets its cost, and the wider gamma, paying better, is kept."""
    passes = {1: 0.107, 2: 0.128, 4: 0.227}
    stats = measured([(1, 1), (2, 2), (4, 3), (2, 2)], propose_s=0.025, verify_s=passes, step_s=0.1)
    schedule = CostModelSchedule(8)
    schedule.observe(stats, 2, 2)
    assert best_gamma(stats, 8) == 2 and schedule.current == 3  # the 4-token pass is untimed
    record_round(stats, 3, 3, 0.025, 0.135)
    schedule.observe(stats, 3, 3)
    assert schedule.current == best_gamma(stats, 8) == 3  # not two rounds in a row
    for _ in range(TRUSTED_SAMPLES - 1):
        schedule.observe(stats, 3, 3)
        assert schedule.current == 4  # a 5-token pass, again
        record_round(stats, 4, 4, 0.025, 0.150)
        schedule.observe(stats, 4, 4)
    assert stats.verification_s(4) == 0.150 and best_gamma(stats, 8) >= 4
    assert schedule.next_gamma(stats, room=100) == schedule.current >= 4


def test_one_dear_first_round_does_not_set_a_proposals_cost():
    """A retrieval stage's first round also selects its chunks (a pass costing three proposals):
    the median over rounds prices proposals at what the later rounds paid."""
    stats = measured([(6, 6)] * WARMUP_ROUNDS, propose_s=0.0155, verify_s={6: 0.0325, 1: 0.021}, step_s=0.0195)
    stats.proposal_samples[0] = (5 * 0.0155 + 0.046) / 6  # the first round's selecting pass
    assert stats.proposal_s == pytest.approx(0.0155)
    assert best_gamma(stats, 6) > 0


def test_only_the_cost_model_takes_a_free_proposal_and_only_where_it_pays_for_its_verification():
    """Qwen2.5 0.5B drafting for 1.5B at 8K, batch 4, on a 2-core Xeon with AMX: a = 0.74 at gamma
    2, a batch's proposal 35 ms, passes of 1-3 proposals 230 ms and of 4-8 240 ms (tiles), a plain
    step 209 ms. A round of 2 costs 300 ms for 2.30 tokens, 131 ms a token: a third proposal (a^3 =
    0.41 tokens, 54 ms) pays for the 0 ms it adds to the pass, a fourth (0.30, 40 ms) for its 10 ms,
    an eighth (0.09 tokens, 12 ms) not where each token past 4 adds 15 ms, and none past the
    configured gamma or during the warm-up. Bypassed, a token is worth a plain step: a first
    proposal (0.74 tokens, 155 ms) pays for the 21 ms a 1-token pass costs over a step, one the
    draft never gets right does not."""
    passes = {1: 0.23, 2: 0.23, 3: 0.23, 4: 0.24, 8: 0.24}
    rounds = [(1, 1), (2, 2), (4, 2), (8, 3)] + [(2, 1), (2, 2), (3, 2), (4, 2), (8, 4)] * 4  # a = 0.74
    stats = measured(rounds, propose_s=0.035, verify_s=passes, step_s=0.209)
    assert stats.acceptance_mle == pytest.approx(0.74, abs=0.01)
    schedule = CostModelSchedule(8)
    schedule.current = 2
    assert [schedule.extends(stats, drawn) for drawn in range(2, 9)] == [True] * 6 + [False]
    dearer = measured(rounds, propose_s=0.035, verify_s=passes | {8: 0.30}, step_s=0.209)
    assert dearer.verification_s(8) - dearer.verification_s(7) == pytest.approx(0.015)
    assert schedule.extends(dearer, 3) and not schedule.extends(dearer, 7)
    assert not schedule.extends(stats, 1)  # short of this round's gamma: the round goes on anyway
    schedule.current = 0
    assert schedule.extends(stats, 0) and not schedule.extends(stats, 8)
    assert not schedule.extends(measured([(2, 0)] * 8, propose_s=0.035, verify_s=passes, step_s=0.209), 0)
    warming = measured(rounds[: WARMUP_ROUNDS - 1], propose_s=0.035, verify_s=passes, step_s=0.209)
    schedule.current = 2
    assert not schedule.extends(warming, 2)
    assert not Schedule(2).extends(stats, 2) and not HeuristicSchedule(2).extends(stats, 2)


def test_a_batch_that_shrinks_drops_the_verifications_timed_in_it_and_probes_a_bypassed_stage():
    """A stage bypassed on passes timed at batch 4 is probed at its next round once the batch is
    smaller; its verifications' times are gone and the next plain step's replaces the plain steps'."""
    stats = measured([(2, 0)] * WARMUP_ROUNDS, propose_s=0.035, verify_s=0.28, step_s=0.2)
    schedule = CostModelSchedule(8)
    schedule.observe(stats, 2, 0)
    assert schedule.next_gamma(stats, room=100) == 0
    stats.forget_pass_costs()
    schedule.costs_forgotten()
    assert stats.verification_samples == {} and stats.proposal_samples
    assert schedule.next_gamma(stats, room=100) == 1 and schedule.probing
    stats.record_plain_step(0.17)
    assert stats.plain_samples == [0.17]
    speculating = CostModelSchedule(8)
    speculating.current = 4
    speculating.costs_forgotten()
    assert speculating.next_gamma(stats, room=100) == 4


def test_plain_steps_slower_than_wider_verification_passes_are_timed_again_once():
    """SmolLM2's `triforce` at 8K: its first full-cache steps took 19-26 ms, its 2-token verifications
    17-20 ms, and its prediction (1.66x) rested on the slow steps; it ran at 1.07x."""
    schedule = CostModelSchedule(6)
    stats = measured([(1, 1), (1, 1)], propose_s=0.011, verify_s=0.018, step_s=0.025)
    assert stats.step_outpaced()
    assert schedule.next_gamma(stats, room=100) == 0 and stats.plain_samples_stale
    stats.record_plain_step(0.016)
    assert stats.step_s == 0.016 and not stats.step_outpaced()
    stats.record_plain_step(0.030)  # noise after the re-timing: the steps are not taken again
    assert stats.step_outpaced() and schedule.next_gamma(stats, room=100) > 0


def test_plain_steps_within_noise_of_the_verification_passes_stand():
    stats = measured([(2, 2), (2, 2)], propose_s=0.011, verify_s=0.0175, step_s=0.019)
    assert not stats.step_outpaced()  # 19 ms against 17.5: within OUTPACED
    assert not measured([(2, 2)], propose_s=0.011, verify_s=0.010, step_s=0.019).step_outpaced()  # one pass


def test_a_middle_stage_whose_draft_is_bypassed_is_priced_at_its_own_plain_steps():
    """`triforce` on SmolLM2 at 8K: the retrieval stage's warm-up rounds, a draft proposal and its
    verification each, priced a proposal at 15 ms; once the draft is bypassed it proposes by its own
    11.5 ms steps (its probes begin by catching up and price nothing), beside 16 ms full steps."""
    middle = measured([(4, 4)] * WARMUP_ROUNDS, propose_s=0.015, verify_s=0.0175, step_s=0.016)
    assert best_gamma(middle, 6) == 0  # priced by the draft's rounds: never pays
    draft = StageStats("draft")
    for seconds in (0.0115, 0.0112, 0.0119):  # the middle stage's plain steps, taken for the bypassed draft
        draft.record_plain_step(seconds)
    stage = SimpleNamespace
    bypassed = stage(schedule=SimpleNamespace(current=0), stats=draft)
    Pipeline._price_alone_proposals(stage(stats=middle), bypassed)
    assert middle.alone_proposal_s == middle.proposal_s == draft.step_s == 0.0115
    assert best_gamma(middle, 6) > 0 and middle.expected_speedup(best_gamma(middle, 6)) > MIN_GAIN
    assert hopeful_gamma(middle, 6) > 0
    Pipeline._price_alone_proposals(stage(stats=middle), stage(schedule=SimpleNamespace(current=2), stats=draft))
    assert middle.alone_proposal_s == 0.0 and middle.proposal_s == 0.015  # the draft proposes again
    Pipeline._price_alone_proposals(
        stage(stats=middle), stage(schedule=SimpleNamespace(current=0), stats=StageStats("d"))
    )
    assert middle.alone_proposal_s == 0.0  # bypassed before any of the middle stage's steps was timed


def test_a_stage_is_proven_once_its_warm_up_chose_to_speculate_and_not_while_bypassed_or_probing():
    """The stage below a middle stage is held back until the middle stage's own speculation is proven."""
    schedule = CostModelSchedule(6)
    good = measured([(1, 1), (1, 1), (3, 3)], propose_s=0.005, verify_s=0.1, step_s=0.1)
    schedule.observe(good, 3, 3)
    assert schedule.current > 0 and not schedule.proven(good)  # three rounds of the warm-up
    record_round(good, 6, 6, propose_s=0.005, verify_s=0.1)
    schedule.observe(good, 6, 6)
    assert schedule.proven(good)
    useless = measured([(6, 0)] * WARMUP_ROUNDS, propose_s=0.05, verify_s=0.15, step_s=0.1)
    schedule.observe(useless, 6, 0)
    assert schedule.current == 0 and not schedule.proven(useless)  # bypassed
    while schedule.next_gamma(useless, room=100) == 0:
        pass
    assert schedule.probing and not schedule.proven(useless)  # its probe
    assert Schedule(2).proven(StageStats("fixed")) and HeuristicSchedule(2).proven(StageStats("heuristic"))


def test_a_held_back_draft_prices_its_middle_stage_at_that_stage_s_own_plain_steps():
    middle = measured([(1, 1)], propose_s=0.015, verify_s=0.0175, step_s=0.016)
    draft = StageStats("draft")
    draft.record_plain_step(0.0115)  # the middle stage's plain step, taken while the draft was held
    warming_up = SimpleNamespace(schedule=SimpleNamespace(current=1), stats=draft)
    Pipeline._price_alone_proposals(SimpleNamespace(stats=middle), warming_up, held=True)
    assert middle.alone_proposal_s == middle.proposal_s == 0.0115
