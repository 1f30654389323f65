"""The cascade on tiny random models: every preset's greedy output equals autoregressive greedy
token for token (float32), with a useless draft and with draft = target; stop rules cut exactly."""

from __future__ import annotations

import pytest
import torch
import yaml

from cascade.pipeline import StopRule
from cascade.runtime import PREFILL_CHUNKS, build_runtime
from cascade.schedule import WARMUP_ROUNDS
from configs import load_config

PROMPT = torch.randint(0, 49152, (300,), generator=torch.Generator().manual_seed(0)).tolist()
SMALL_CACHES = {  # budgets below the 300-token prompt, so every policy really drops tokens
    "triforce": ["stages.0.cache.window=40", "stages.1.cache.budget=64"],
    "self-spec": ["stages.0.cache.budget=64"],
    "speculative": [],
    "autoregressive": [],
}


def runtime_for(preset, target, draft, overrides=(), config_file=None, **settings):
    settings = {"target.path": str(target), "draft.path": str(draft), "dtype": "float32", **settings}
    _, config = load_config(None if config_file else preset, config_file, list(overrides), settings)
    return build_runtime(config)


def generate(runtime, prompt_ids, max_new_tokens=40, eos=(), seed=0, pipeline=None):
    """``pipeline``: one already built from ``runtime`` (to inspect its stages afterwards)."""
    pipeline = pipeline or runtime.pipeline_for(len(prompt_ids), max_new_tokens)
    stop = StopRule(frozenset(eos), max_new_tokens)
    device = runtime.target.model.device
    generator = torch.Generator(device=device).manual_seed(seed)
    return pipeline.generate(torch.tensor(prompt_ids, device=device), stop, generator)


@pytest.fixture(scope="module")
def autoregressive_tokens(tiny_dir, tiny_draft_dir):
    return generate(runtime_for("autoregressive", tiny_dir, tiny_draft_dir), PROMPT).token_ids


@pytest.mark.parametrize("schedule", ["cost_model", "fixed"])
@pytest.mark.parametrize("draft_is_target", [False, True], ids=["random-draft", "draft=target"])
@pytest.mark.parametrize("preset", ["speculative", "self-spec", "triforce"])
def test_preset_greedy_equals_autoregressive(
    preset, draft_is_target, schedule, tiny_dir, tiny_draft_dir, autoregressive_tokens
):
    """With the presets' cost model (which bypasses and probes tiers that do not pay: the skipped
    tokens are caught up on) and with fixed gammas (every stage proposes every round)."""
    draft = tiny_dir if draft_is_target else tiny_draft_dir
    stages = 2 if preset == "triforce" else 1
    schedules = [f"stages.{index}.schedule={schedule}" for index in range(stages)]
    result = generate(runtime_for(preset, tiny_dir, draft, [*SMALL_CACHES[preset], *schedules]), PROMPT)
    assert result.token_ids == autoregressive_tokens
    proposers = result.stats.stages[:-1]
    assert all(stage.schedule == schedule and stage.accepted <= stage.proposed for stage in proposers)
    ran = proposers if schedule == "fixed" else proposers[-1:]  # a costly tier may be dropped at once
    assert all(stage.rounds > 0 for stage in ran)
    if preset == "speculative":
        assert proposers[0].acceptance_rate == (1.0 if draft_is_target else pytest.approx(0.0, abs=0.1))


@pytest.mark.parametrize(
    "cache",
    [
        {"kind": "topk_oracle", "budget": 64},
        {"kind": "retrieval", "budget": 64, "scoring": "attention", "refresh": {"every": 1}},
        {"kind": "retrieval", "budget": 64, "scoring": "bound", "refresh": {"every": 1}},
        {"kind": "retrieval", "budget": 64, "scoring": "sparq", "query_dims": 8, "refresh": "every_pass"},
    ],
    ids=["topk_oracle", "retrieval-attention-each-round", "retrieval-bound-each-round", "retrieval-sparq-each-pass"],
)
def test_self_spec_selecting_keys_afresh_stays_exact(cache, tiny_dir, tiny_draft_dir, autoregressive_tokens):
    overrides = [f"stages.0.cache={cache}", "stages.0.schedule=fixed"]
    result = generate(runtime_for("self-spec", tiny_dir, tiny_draft_dir, overrides), PROMPT)
    assert result.token_ids == autoregressive_tokens
    assert result.stats.stages[0].name == f"0:target/{cache['kind']}" and result.stats.stages[0].rounds > 0


def test_triforce_selecting_before_every_pass_of_its_middle_stage_stays_exact(
    tiny_dir, tiny_draft_dir, autoregressive_tokens
):
    """The middle stage verifies the draft's proposals: each pass selects by its first query only."""
    overrides = [
        *SMALL_CACHES["triforce"],
        "stages.1.cache.scoring=sparq",
        "stages.1.cache.query_dims=8",
        "stages.1.cache.refresh=every_pass",
        "stages.0.schedule=fixed",
        "stages.1.schedule=fixed",
    ]
    runtime = runtime_for("triforce", tiny_dir, tiny_draft_dir, overrides)
    pipeline = runtime.pipeline_for(len(PROMPT), 40)
    result = generate(runtime, PROMPT, pipeline=pipeline)
    assert result.token_ids == autoregressive_tokens
    draft, middle = result.stats.stages[:2]
    assert draft.rounds > 0 and middle.rounds > 0
    assert pipeline.stages[1].cache.selections == middle.forward_calls


@pytest.mark.parametrize("draft_is_target", [False, True], ids=["random-draft", "draft=target"])
def test_a_draft_ending_its_rounds_in_doubt_stays_exact(
    draft_is_target, tiny_dir, tiny_draft_dir, autoregressive_tokens
):
    """A random model's most likely token has far less than 0.99 of its probability, so each round
    ends at its first proposal; far more than 1e-9, so each round runs as without ``stop_below``."""
    draft = tiny_dir if draft_is_target else tiny_draft_dir

    def first_stage(*overrides):
        fixed = ["stages.0.schedule=fixed", "stages.0.gamma=4", *overrides]
        result = generate(runtime_for("speculative", tiny_dir, draft, fixed), PROMPT)
        assert result.token_ids == autoregressive_tokens
        stats = result.stats.stages[0]
        return stats.rounds, stats.proposed, stats.accepted

    rounds, proposed, _ = first_stage("stages.0.stop_below=0.99")
    assert rounds > 1 and proposed == rounds
    assert first_stage("stages.0.stop_below=1e-9") == first_stage("stages.0.stop_below=null")


@pytest.mark.parametrize("schedule", ["fixed", "heuristic", "cost_model"])
def test_adaptive_schedules_stay_exact(schedule, tiny_dir, tiny_draft_dir, autoregressive_tokens):
    overrides = SMALL_CACHES["triforce"] + [f"stages.{i}.schedule={schedule}" for i in (0, 1)]
    result = generate(runtime_for("triforce", tiny_dir, tiny_draft_dir, overrides), PROMPT)
    assert result.token_ids == autoregressive_tokens
    assert result.stats.stages[0].schedule == schedule
    for stage in result.stats.stages[:-1]:  # what the cost model fits its verification line to
        assert set(stage.clean_verifications) <= {gamma for gamma in stage.gamma_choices if gamma}
        assert sum(stage.clean_verifications.values()) <= stage.rounds
        assert sum(stage.clean_verification_s.values()) <= stage.verify_s * (1 + 1e-12)  # summed in other orders
    proposers = result.stats.stages[:-1]
    fitted = proposers[-1:] if schedule == "cost_model" else proposers  # it may drop a tier at once
    assert all(sum(stage.clean_verifications.values()) > 0 for stage in fitted)


def test_a_draft_sits_out_its_middle_stage_s_warm_up(tiny_dir, autoregressive_tokens):
    """`triforce` with the cost model on both proposers (the target drafting for itself): the middle
    stage warms up by its own plain steps, each a round the draft sits out and a step of its verifier
    it times; the draft proposes nothing while the middle stage is unproven."""
    overrides = [*SMALL_CACHES["triforce"], "stages.0.schedule=cost_model", "stages.1.schedule=cost_model"]
    runtime = runtime_for("triforce", tiny_dir, tiny_dir, overrides)
    pipeline = runtime.pipeline_for(len(PROMPT), 40)
    draft_stats, middle_schedule = pipeline.stages[0].stats, pipeline.stages[1].schedule
    draft_rounds_while_unproven = []  # at each of the middle stage's rounds verified while unproven

    def observe(stats, proposed, accepted, observed=middle_schedule.observe):
        if not middle_schedule.proven(stats):
            draft_rounds_while_unproven.append(draft_stats.rounds)
        observed(stats, proposed, accepted)

    middle_schedule.observe = observe
    result = generate(runtime, PROMPT, pipeline=pipeline)
    assert result.token_ids == autoregressive_tokens
    draft, middle = result.stats.stages[:2]
    assert middle.timed_rounds >= WARMUP_ROUNDS and len(draft_rounds_while_unproven) >= WARMUP_ROUNDS
    assert set(draft_rounds_while_unproven) == {0}
    assert draft.held_rounds >= 2  # the middle stage's warm-up's first two gammas are 1
    assert 0 < draft.plain_steps <= draft.held_rounds  # those that caught up on no token timed


def test_rounds_whose_proposals_all_pass_price_the_next_proposals(tiny_dir):
    """A round whose proposals are all accepted leaves the draft two tokens behind (its last proposal
    and the verifier's next token were never fed to it): its next proposal is an ordinary one, priced
    among the proposal samples, not as a catch-up on skipped tokens (which left a draft that agreed on
    everything unpriced, so the cost model bypassed it)."""
    overrides = ["stages.0.schedule=fixed", "stages.0.gamma=4"]
    result = generate(runtime_for("speculative", tiny_dir, tiny_dir, overrides), PROMPT)
    draft = result.stats.stages[0]
    assert draft.rounds > 1 and draft.accepted == draft.proposed  # the target drafts for itself
    assert draft.catch_up_s == 0.0 and len(draft.proposal_samples) == draft.timed_rounds


def test_a_stage_bypassed_for_long_catches_up_within_its_room(tiny_dir, tiny_draft_dir):
    """The cost model bypasses the useless draft; its streaming cache then lags the context by more
    than a prefill chunk and must be fed the missed tokens in chunks, not overflow."""
    overrides = [
        "stages.0.cache.kind=streaming",
        "stages.0.cache.window=40",
        "stages.0.schedule=cost_model",
        "prefill_chunk=16",
    ]
    result = generate(runtime_for("speculative", tiny_dir, tiny_draft_dir, overrides), PROMPT, 120)
    draft = result.stats.stages[0]
    assert draft.gamma_choices.get(0, 0) > 16  # bypassed for longer than a probe interval
    assert draft.plain_rounds == draft.gamma_choices[0]  # each a plain step of the target
    # the prediction is the generation's: its bypassed rounds pull it from the speculating rounds' towards 1
    speculating = draft.expected_speedup(draft.mean_gamma)
    assert speculating != 1.0 and abs(result.stats.predicted_speedup - 1) < abs(speculating - 1)
    expected = generate(runtime_for("autoregressive", tiny_dir, tiny_draft_dir), PROMPT, 120).token_ids
    assert result.token_ids == expected


@pytest.mark.parametrize("overrides, widths", [((), [400]), (("prefill_chunk=128",), [128, 128, 128, 16])])
def test_prefill_passes_are_the_configured_width_or_the_devices(overrides, widths, tiny_dir, tiny_draft_dir):
    """A null ``prefill_chunk`` (the default) becomes this device's (1024 on CPU: the 400-token
    prompt in one pass); a set one splits the prompt into passes of that many tokens."""
    runtime = runtime_for("autoregressive", tiny_dir, tiny_draft_dir, overrides)
    assert runtime.config.prefill_chunk == (PREFILL_CHUNKS["cpu"] if not overrides else 128)
    model, seen = runtime.target.model, []
    forward = model.forward
    model.forward = lambda ids, *args, **kwargs: seen.append(ids.shape[1]) or forward(ids, *args, **kwargs)
    generate(runtime, list(range(3, 403)), max_new_tokens=1)
    assert seen[: len(widths)] == widths


def test_a_draft_prefilling_only_its_streaming_tail_stays_exact(
    monkeypatch, tiny_dir, tiny_draft_dir, autoregressive_tokens
):
    """The draft skips the prompt between its sinks and its last 240 tokens: what it proposes may
    change, the output may not."""
    overrides = ["stages.0.cache.kind=streaming", "stages.0.cache.window=200", "stages.0.cache.prefill_tail=240"]
    runtime = runtime_for("speculative", tiny_dir, tiny_draft_dir, overrides)
    pipeline = runtime.pipeline_for(len(PROMPT), 40)
    draft_cache, skipped = pipeline.stages[0].cache, []
    skip = draft_cache.skip
    monkeypatch.setattr(draft_cache, "skip", lambda count: (skipped.append(count), skip(count)))
    result = generate(runtime, PROMPT, pipeline=pipeline)
    assert result.token_ids == autoregressive_tokens
    assert skipped == [len(PROMPT) - 240 - 4] and result.stats.stages[0].proposed > 0


def test_four_stages_from_a_yaml_file(tmp_path, tiny_dir, tiny_draft_dir, autoregressive_tokens):
    config = tmp_path / "four.yaml"
    config.write_text(
        yaml.safe_dump(
            {
                "stages": [
                    {"model": "draft", "cache": {"kind": "streaming", "sinks": 4, "window": 28}, "gamma": 3},
                    {"model": "target", "cache": {"kind": "h2o", "budget": 96, "recent": 32}, "gamma": 4},
                    {"model": "target", "cache": {"kind": "retrieval", "budget": 128, "chunk_size": 8}, "gamma": 5},
                    {"model": "target", "cache": {"kind": "full"}},
                ]
            }
        )
    )
    result = generate(runtime_for(None, tiny_dir, tiny_draft_dir, config_file=config), PROMPT)
    assert result.token_ids == autoregressive_tokens
    assert [stage.name for stage in result.stats.stages] == [
        "0:draft/streaming",
        "1:target/h2o",
        "2:target/retrieval",
        "3:target/full",
    ]


def test_a_prompt_within_the_retrieval_budget_skips_that_optional_stage(tiny_dir, tiny_draft_dir, caplog):
    caplog.set_level("INFO", logger="cascade.runtime")
    runtime = runtime_for("triforce", tiny_dir, tiny_draft_dir)
    prompt = PROMPT[:100]
    result = generate(runtime, prompt, 20)
    assert [stage.name for stage in result.stats.stages] == ["0:draft/streaming", "1:target/full"]
    [skipped] = [record.getMessage() for record in caplog.records if record.name == "cascade.runtime"]
    assert "stage 1 (target/retrieval) skipped" in skipped and "budget (4096)" in skipped
    autoregressive = generate(runtime_for("autoregressive", tiny_dir, tiny_draft_dir), prompt, 20)
    assert result.token_ids == autoregressive.token_ids


@pytest.mark.parametrize("preset", ["speculative", "triforce"])
def test_eos_inside_an_accepted_run_cuts_there(preset, tiny_dir, autoregressive_tokens):
    stop_token = autoregressive_tokens[9]
    first = autoregressive_tokens.index(stop_token)
    runtime = runtime_for(preset, tiny_dir, tiny_dir, SMALL_CACHES[preset])  # draft = target: long runs
    result = generate(runtime, PROMPT, eos=[stop_token])
    assert result.token_ids == autoregressive_tokens[: first + 1]
    assert result.stats.stop_reason == "eos"


@pytest.mark.parametrize("max_new_tokens", [1, 2, 7])
def test_max_new_tokens_cuts_inside_an_accepted_run(max_new_tokens, tiny_dir, autoregressive_tokens):
    runtime = runtime_for("speculative", tiny_dir, tiny_dir)
    result = generate(runtime, PROMPT, max_new_tokens)
    assert result.token_ids == autoregressive_tokens[:max_new_tokens]


SAMPLED_FIXED = SMALL_CACHES["triforce"] + [
    "sampling.temperature=0.8",
    "sampling.top_p=0.9",
    "stages.0.schedule=fixed",
    "stages.1.schedule=fixed",
]
"""Sampled triforce whose gammas do not follow measured times (as the cost model's do), so a seed
gives the same tokens every time."""


def test_sampled_cascade_is_seeded(tiny_dir, tiny_draft_dir):
    runtime = runtime_for("triforce", tiny_dir, tiny_draft_dir, SAMPLED_FIXED)
    first, again = (generate(runtime, PROMPT, 20, seed=3).token_ids for _ in range(2))
    assert first == again
    assert first != generate(runtime, PROMPT, 20, seed=4).token_ids


def test_requests_in_a_row_reuse_the_stages_that_hold_them_and_change_nothing(tiny_dir, tiny_draft_dir):
    """A runtime restarts the last request's stages for a prompt their caches hold and builds new
    ones for a longer one, or for one that would fill less than half of them; either way a request
    samples what it would on a new runtime."""
    runtime = runtime_for("triforce", tiny_dir, tiny_draft_dir, SAMPLED_FIXED)
    stages = []
    for prompt in (PROMPT[:250], PROMPT, PROMPT[:200], PROMPT[:120]):
        pipeline = runtime.pipeline_for(len(prompt), 20)
        tokens = generate(runtime, prompt, 20, seed=3, pipeline=pipeline).token_ids
        new_runtime = runtime_for("triforce", tiny_dir, tiny_draft_dir, SAMPLED_FIXED)
        assert tokens == generate(new_runtime, prompt, 20, seed=3).token_ids
        stages.append(pipeline.stages)
    assert stages[1] != stages[0] and stages[2] == stages[1] and stages[3] != stages[2]
