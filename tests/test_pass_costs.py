"""Pass costs carried from a runtime's request to its next: which requests carry them, what the new
stats start from, and how the cost model starts from them (hand-set measurements; tiny models for
the runtime's wiring)."""

from __future__ import annotations

from cascade.pass_costs import CARRY_WITHIN, carries, fresh_stats
from cascade.schedule import PROBE_EVERY, CostModelSchedule, warmup_gammas
from tests.test_pipeline import PROMPT, generate, runtime_for
from tests.test_schedule import measured, record_round

QWEN_1K_PASSES = {1: 0.113, 2: 0.113, 3: 0.123, 4: 0.134, 5: 0.140, 8: 0.239}
"""Verification passes of Qwen2.5-Coder-1.5B at 1K on the 2-core Zen 3, by gamma (93aab82); a plain
step took 0.107 s and a proposal of the int8 0.5B draft 0.021 s."""


def test_costs_carry_between_prompts_of_about_the_same_length():
    assert not carries(None, 1000)
    assert carries(1000, 1000) and carries(1000, 1200) and carries(1200, 1000)
    assert carries(1000, int(1000 * CARRY_WITHIN)) and not carries(1000, int(1000 * CARRY_WITHIN) + 1)
    assert not carries(5000, 8192)


def test_fresh_stats_start_from_the_last_requests_costs_and_nothing_else():
    last = measured([(4, 4), (2, 1)], propose_s=0.01, verify_s={4: 0.12, 2: 0.11}, step_s=0.1)
    schedule = CostModelSchedule(8)
    fresh = fresh_stats("0:draft/full", schedule, last)
    assert fresh.costs_carried and fresh.schedule == "cost_model" and fresh.name == "0:draft/full"
    assert fresh.verification_samples == {4: [0.12], 2: [0.11]} and fresh.plain_samples == last.plain_samples
    assert fresh.proposal_samples == last.proposal_samples
    assert (fresh.rounds, fresh.proposed, fresh.accepted, fresh.plain_steps, fresh.timed_rounds) == (0, 0, 0, 0, 0)
    assert not fresh.clean_verifications and fresh.verification_s(4) == 0.12 and fresh.step_s == 0.1
    record_round(fresh, 4, 4, 0.01, 0.14)  # its own passes join the carried ones
    assert fresh.verification_samples[4] == [0.12, 0.14] and last.verification_samples[4] == [0.12]
    cold = fresh_stats("0:draft/full", schedule)
    assert not cold.costs_carried and not cold.plain_samples and not cold.verification_samples


def test_with_carried_costs_the_cost_model_proposes_its_best_hopeful_gamma_at_once():
    """The Qwen pair at 1K: a cold start proposes 1, then 2; a warm one proposes 5 in its first round
    (at the hopeful acceptance 0.9 with no round seen: a pass of 6 tokens is the widest that stays
    near a step; 9 tokens cost 2.2 steps)."""
    last = measured([(gamma, gamma) for gamma in QWEN_1K_PASSES], 0.021, QWEN_1K_PASSES, 0.107)
    cold, cold_stats = CostModelSchedule(8), fresh_stats("proposer", None)
    assert cold.next_gamma(cold_stats, room=100) == warmup_gammas(8)[0] == 1
    warm, warm_stats = CostModelSchedule(8), fresh_stats("proposer", None, last)
    assert warm.next_gamma(warm_stats, room=100) == 5
    assert warm.next_gamma(warm_stats, room=3) == 3  # never past what is still wanted


def test_warm_rounds_read_their_acceptance_hopefully_over_the_whole_configured_gamma():
    last = measured([(gamma, gamma) for gamma in QWEN_1K_PASSES], 0.021, QWEN_1K_PASSES, 0.107)
    schedule, stats = CostModelSchedule(8), fresh_stats("proposer", None, last)
    first = schedule.next_gamma(stats, room=100)
    record_round(stats, first, 0, 0.021, QWEN_1K_PASSES[first])  # rejected at once: hope falls to ~0.68
    schedule.observe(stats, first, 0)
    assert 1 <= schedule.current < first
    agreeing = fresh_stats("proposer", None, last)
    record_round(agreeing, 5, 5, 0.021, QWEN_1K_PASSES[5])
    schedule = CostModelSchedule(8)
    schedule.next_gamma(agreeing, room=100)
    schedule.observe(agreeing, 5, 5)
    assert schedule.current == 5 > warmup_gammas(8)[1]  # a cold warm-up's second round proposes 2


def test_carried_costs_that_rule_a_stage_out_bypass_it_from_the_first_round():
    """SmolLM2's self-spec at 8K: a retrieval proposal cost about a plain step, so no gamma pays even
    if every proposal is accepted; warm, it is bypassed without a round and probed later."""
    last = measured([(1, 1), (1, 1)], propose_s=0.028, verify_s=0.04, step_s=0.027)
    schedule, stats = CostModelSchedule(6), fresh_stats("proposer", None, last)
    assert [schedule.next_gamma(stats, room=100) for _ in range(PROBE_EVERY + 1)] == [0] * PROBE_EVERY + [1]


def test_a_runtime_carries_costs_to_its_next_request_of_about_the_same_length(tiny_dir, tiny_draft_dir):
    """The second request starts from the first's costs, and its greedy output is the first's; a
    prompt of another length, or ``carry_pass_costs: false``, starts from nothing."""
    runtime = runtime_for("speculative", tiny_dir, tiny_draft_dir)
    first = generate(runtime, PROMPT, 30)
    again = generate(runtime, PROMPT, 30)
    shorter = generate(runtime, PROMPT[:100], 30)
    first_stats, again_stats = first.stats.stages[0], again.stats.stages[0]
    assert again.token_ids == first.token_ids
    assert not first_stats.costs_carried
    assert again_stats.costs_carried
    assert first_stats.verification_samples  # its warm-up rounds were timed
    assert again_stats.verification_samples.keys() >= first_stats.verification_samples.keys()
    assert not shorter.stats.stages[0].costs_carried
    fresh_each_time = runtime_for("speculative", tiny_dir, tiny_draft_dir, ["carry_pass_costs=false"])
    generate(fresh_each_time, PROMPT, 30)
    assert not generate(fresh_each_time, PROMPT, 30).stats.stages[0].costs_carried
