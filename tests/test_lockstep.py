"""Speculating presets on several sequences at once (``cascade.lockstep``): each sequence of a batch
gets what it gets alone, bit for bit, while the passes its rows run at the same time share calls."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import pytest
import torch

from cascade import batch, lockstep
from cascade.batch import BatchRequest
from cascade.errors import CascadeError
from cascade.llm import LLM
from cascade.model import CausalLM
from cascade.pipeline import StopRule
from cascade.schedule import Schedule
from cascade.stats import StageStats
from configs.schema import SamplingConfig
from tests.test_batch import needs_layer_kernels
from tests.test_pipeline import SMALL_CACHES, generate, runtime_for

LENGTHS = (300, 180, 240)
PROMPTS = [
    torch.randint(0, 49152, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    for seed, length in enumerate(LENGTHS)
]
NEW_TOKENS = (24, 9, 17)
SAMPLINGS = {"greedy": SamplingConfig(temperature=0.0), "sampled": SamplingConfig(temperature=0.8, top_p=0.9)}
DTYPES = ["float32", pytest.param("bfloat16", marks=needs_layer_kernels)]


def fixed_runtime(preset, tiny_dir, tiny_draft_dir, dtype):
    """``preset`` with caches smaller than the prompts and fixed gammas: every stage proposes every
    round, so a sequence draws the same random numbers alone and in a batch."""
    proposers = 2 if preset == "triforce" else 1
    fixed = [f"stages.{index}.schedule=fixed" for index in range(proposers)]
    return runtime_for(preset, tiny_dir, tiny_draft_dir, [*SMALL_CACHES[preset], *fixed], dtype=dtype)


def requests(sampling: SamplingConfig, eos=(frozenset(), frozenset(), frozenset())) -> list[BatchRequest]:
    return [
        BatchRequest(prompt, StopRule(stop, new), sampling, seed)
        for seed, (prompt, new, stop) in enumerate(zip(PROMPTS, NEW_TOKENS, eos, strict=True))
    ]


def alone(runtime, request: BatchRequest):
    stop, prompt = request.stop, request.prompt_ids
    pipeline = runtime.pipeline_for(len(prompt), stop.max_new_tokens, request.sampling)
    return generate(runtime, prompt, stop.max_new_tokens, stop.eos_token_ids, request.seed, pipeline)


@pytest.fixture
def shared_calls(monkeypatch) -> list[int]:
    """Sequences per ``decoder_layers`` call that ``forward_batch`` shared among several."""
    sizes: list[int] = []
    forward_shared = CausalLM._forward_shared

    def recorded(model, passes, *rest):
        sizes.append(len(passes))
        return forward_shared(model, passes, *rest)

    monkeypatch.setattr(CausalLM, "_forward_shared", recorded)
    return sizes


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("preset", ["speculative", "self-spec", "triforce"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_each_sequence_of_a_batch_gets_the_tokens_and_rounds_it_gets_alone(
    preset, sampling, dtype, tiny_dir, tiny_draft_dir, shared_calls
):
    """Prompts and budgets of different lengths, a seed each; in bf16 the rows share the kernels' calls."""
    runtime = fixed_runtime(preset, tiny_dir, tiny_draft_dir, dtype)
    batch_requests = requests(SAMPLINGS[sampling])
    together = lockstep.generate_together(runtime, batch_requests)
    if dtype == "bfloat16":
        assert max(shared_calls) > 1
    for request, result in zip(batch_requests, together, strict=True):
        reference = alone(runtime, request)
        assert result.token_ids == reference.token_ids
        assert len(result.token_ids) == request.stop.max_new_tokens
        rounds = [(stage.rounds, stage.proposed, stage.accepted) for stage in result.stats.stages]
        assert rounds == [(stage.rounds, stage.proposed, stage.accepted) for stage in reference.stats.stages]
        assert any(stage.rounds for stage in result.stats.stages)


@pytest.mark.parametrize("sampling", list(SAMPLINGS))
@pytest.mark.parametrize("preset", ["lookup", "lookup-speculative"])
def test_prompt_lookup_in_a_batch_gets_what_each_sequence_gets_alone(preset, sampling, tiny_dir, tiny_draft_dir):
    """A lookup stage runs no model: each sequence's proposals are its own, between the batch's passes.
    Lookups of single tokens over 120 new tokens: the tiny model's greedy text repeats a token now and then."""
    proposers = 2 if preset == "lookup-speculative" else 1
    overrides = ["stages.0.lookup.min_ngram=1", *(f"stages.{i}.schedule=fixed" for i in range(proposers))]
    runtime = runtime_for(preset, tiny_dir, tiny_draft_dir, overrides)
    batch_requests = [replace(one, stop=StopRule(frozenset(), 120)) for one in requests(SAMPLINGS[sampling])]
    together = lockstep.generate_together(runtime, batch_requests)
    for request, result in zip(batch_requests, together, strict=True):
        reference = alone(runtime, request)
        assert result.token_ids == reference.token_ids
        rounds = [(stage.rounds, stage.proposed, stage.accepted) for stage in result.stats.stages]
        assert rounds == [(stage.rounds, stage.proposed, stage.accepted) for stage in reference.stats.stages]
    if sampling == "greedy":
        assert any(result.stats.stages[0].rounds for result in together)


@pytest.mark.parametrize("dtype", DTYPES)
def test_the_cost_model_schedules_each_sequence_and_greedy_tokens_stay_the_targets(tiny_dir, dtype):
    """The presets' cost model (timed in the batch, so its gammas may differ from a lone run's)."""
    runtime = runtime_for("self-spec", tiny_dir, tiny_dir, SMALL_CACHES["self-spec"], dtype=dtype)
    batch_requests = requests(SAMPLINGS["greedy"])
    together = lockstep.generate_together(runtime, batch_requests)
    assert [r.token_ids for r in together] == [alone(runtime, request).token_ids for request in batch_requests]
    assert all(result.stats.stages[0].schedule == "cost_model" for result in together)


class ScriptedSequence:
    """Stands in for a ``lockstep.Sequence`` in ``tick``: hands over a pass to each model of its
    script in turn, one a turn, then finishes. A script entry ``(draft, model)`` asks first whether
    the draft runs in this tick, and hands over a draft pass if it does, else one to ``model``."""

    def __init__(self, name: str, models: list[object]) -> None:
        self.name = name
        self.script = list(models)
        self.handed: lockstep.HandedPass | None = None
        self.finished = False
        self.asking = False
        self.answers: list[bool] = []

    waiting = lockstep.Sequence.waiting

    def take_turn(self) -> None:
        self.asking = bool(self.script) and isinstance(self.script[0], tuple)
        if not self.asking:
            self.handed = lockstep.HandedPass(self.script.pop(0), self.name) if self.script else None
            self.finished = self.handed is None

    def answer(self, draft_runs: bool) -> None:
        self.asking = False
        self.answers.append(draft_runs)
        draft, otherwise = self.script.pop(0)
        self.handed = lockstep.HandedPass(draft if draft_runs else otherwise, self.name)


def ticks(running: list[ScriptedSequence], draft: object, monkeypatch) -> list[list[tuple[object, str]]]:
    """Tick ``running`` until every scripted sequence has finished -> each tick's passes (model, sequence)."""
    calls: list[list[tuple[object, str]]] = []

    def run(handed: list[lockstep.HandedPass]) -> None:
        calls.append([(one.model, one.sequence) for one in handed])
        for one in handed:
            one.logits = torch.zeros(1, 1)

    monkeypatch.setattr(lockstep, "run_passes", run)
    while running:
        running = lockstep.tick(running, draft)
    return calls


def test_a_tick_runs_the_drafts_waiting_passes_first_so_the_batch_verifies_together(monkeypatch):
    """Sequence a proposes two tokens, b one: b's verification waits for a's second proposal, and the
    target then runs both verifications in one call."""
    draft, target = object(), object()
    running = [ScriptedSequence("a", [draft, draft, target]), ScriptedSequence("b", [draft, target])]
    calls = ticks(running, draft, monkeypatch)
    assert calls == [[(draft, "a"), (draft, "b")], [(draft, "a")], [(target, "a"), (target, "b")]]


def test_a_sequence_that_asks_proposes_in_the_ticks_the_draft_runs_for_others(monkeypatch):
    """a has proposed its gamma and asks twice: the draft runs for b in the first tick (a proposes
    in it too), not in the second (a verifies with b, told only once b has taken its turn)."""
    draft, target = object(), object()
    a = ScriptedSequence("a", [draft, (draft, target), (draft, target)])
    b = ScriptedSequence("b", [draft, draft, target])
    calls = ticks([a, b], draft, monkeypatch)
    assert a.answers == [True, False]
    assert calls == [[(draft, "a"), (draft, "b")], [(draft, "a"), (draft, "b")], [(target, "a"), (target, "b")]]


class FreeProposals(Schedule):
    """A fixed ``gamma`` that takes every proposal that costs nothing, up to ``widest``."""

    def __init__(self, gamma: int, widest: int) -> None:
        super().__init__(gamma)
        self.widest = widest

    def extends(self, stats, drawn: int) -> bool:
        return drawn < self.widest


def free_proposal_batch(tiny_dir, monkeypatch, gammas: list[int], settings: list[str]):
    """Two sequences of the target drafting for itself, each on a ``FreeProposals`` schedule of its
    gamma (up to 4) -> their results, checked to be their greedy tokens alone."""
    runtime = runtime_for("speculative", tiny_dir, tiny_dir, ["stages.0.stop_below=null", *settings])
    schedules = iter(gammas)
    monkeypatch.setattr(lockstep, "schedules_for", lambda config: [FreeProposals(next(schedules), 4), None])
    batch_requests = requests(SAMPLINGS["greedy"])[:2]
    together = lockstep.generate_together(runtime, batch_requests)
    for request, result in zip(batch_requests, together, strict=True):
        assert result.token_ids == alone(runtime, request).token_ids
    return together


@pytest.mark.parametrize("first_gamma", [1, 0])
def test_a_sequence_proposes_while_the_draft_runs_for_another_and_emits_the_same_tokens(
    first_gamma, tiny_dir, monkeypatch
):
    """The first sequence's gamma is 1 (or 0: its schedule bypasses its draft), the second's 4: in
    the ticks the draft runs for the second, the first proposes too (every proposal of the target
    drafting for itself is accepted), with the target's greedy tokens."""
    together = free_proposal_batch(tiny_dir, monkeypatch, [first_gamma, 4], ["stages.0.schedule=fixed"])
    first, second = (result.stats.stages[0] for result in together)
    assert second.proposed == sum(gamma * rounds for gamma, rounds in second.gamma_choices.items())
    assert first.gamma_choices == {first_gamma: first.rounds + first.plain_steps}
    assert first.plain_rounds == first.plain_steps  # a round proposing for free is not a plain one
    assert first.rounds >= second.rounds and first.proposed > first_gamma * first.rounds
    assert first.accepted == first.proposed


def test_a_bypassed_token_tree_takes_plain_steps_in_a_batch(tiny_dir, monkeypatch):
    """A tree grows by levels, not by one more proposal: bypassed, it steps while the other
    sequence's trees are drafted, with the target's greedy tokens."""
    tree = ["stages.0.tree.nodes=6", "stages.0.tree.rank_acceptance=[0.6, 0.2, 0.1]", "stages.0.schedule=fixed"]
    together = free_proposal_batch(tiny_dir, monkeypatch, [0, 3], tree)
    first, second = (result.stats.stages[0] for result in together)
    assert first.rounds == 0 and first.plain_steps == len(together[0].token_ids) - 1 and second.rounds > 0


def test_the_sequences_left_when_one_finishes_drop_the_pass_costs_timed_in_the_larger_batch(
    tiny_dir, tiny_draft_dir, monkeypatch
):
    """Budgets of 24, 9 and 17 tokens: when the second finishes the first and third forget their
    verifications' times, when the third does the first (a batch-4 verification costs more than
    one of the last row alone), and every sequence's tokens stay its own."""
    forgotten: list[int] = []
    forget = StageStats.forget_pass_costs
    monkeypatch.setattr(StageStats, "forget_pass_costs", lambda stats: forgotten.append(id(stats)) or forget(stats))
    runtime = fixed_runtime("speculative", tiny_dir, tiny_draft_dir, "float32")
    batch_requests = requests(SAMPLINGS["greedy"])
    together = lockstep.generate_together(runtime, batch_requests)
    assert [r.token_ids for r in together] == [alone(runtime, request).token_ids for request in batch_requests]
    first, _, third = (result.stats.stages[0] for result in together)
    assert forgotten == [id(first), id(third), id(first)]


def test_a_sequence_that_stops_early_leaves_the_batch_and_the_others_go_on(tiny_dir, tiny_draft_dir):
    runtime = fixed_runtime("self-spec", tiny_dir, tiny_draft_dir, "float32")
    first = alone(runtime, requests(SAMPLINGS["greedy"])[0]).token_ids
    eos = (frozenset({first[5]}), frozenset(), frozenset())
    batch_requests = requests(SAMPLINGS["greedy"], eos)
    together = lockstep.generate_together(runtime, batch_requests)
    assert together[0].token_ids == first[: first.index(first[5]) + 1]
    assert together[0].stats.stop_reason == "eos"
    assert [len(result.token_ids) for result in together[1:]] == list(NEW_TOKENS[1:])
    assert [r.token_ids for r in together] == [alone(runtime, request).token_ids for request in batch_requests]


def test_a_failing_sequence_raises_its_error_after_the_others_finish(tiny_dir, tiny_draft_dir):
    runtime = fixed_runtime("speculative", tiny_dir, tiny_draft_dir, "float32")
    finished = []

    def fail(tokens: list[int]) -> None:
        raise ValueError("the receiver of sequence 1 broke")

    batch_requests = requests(SAMPLINGS["greedy"])
    batch_requests[0] = replace(batch_requests[0], on_tokens=finished.append)
    batch_requests[1] = replace(batch_requests[1], on_tokens=fail)
    with pytest.raises(ValueError, match="the receiver of sequence 1 broke"):
        lockstep.generate_together(runtime, batch_requests)
    assert len(finished) > 1  # sequence 0 went on emitting after sequence 1 failed


def test_a_batch_whose_caches_may_not_fit_in_memory_is_refused_before_any_is_built(tiny_dir, monkeypatch):
    runtime = runtime_for("self-spec", tiny_dir, tiny_dir, SMALL_CACHES["self-spec"])
    monkeypatch.setattr(batch, "available_memory", lambda device: 1000)
    with pytest.raises(CascadeError, match=r"a batch of 3 sequences needs .* GiB of KV cache, and 0.00 GiB"):
        lockstep.generate_together(runtime, requests(SAMPLINGS["greedy"]))


@needs_layer_kernels
def test_a_speculating_llm_generates_a_list_together_with_each_prompts_own_tokens(tiny_dir, shared_calls):
    llm = LLM("self-spec", target=tiny_dir, dtype="bfloat16", reuse_prompts=False, **{"stages.0.cache.budget": 64})
    prompts = [prompt[:length] for prompt, length in zip(PROMPTS, (200, 120, 160), strict=True)]
    together = llm.generate(prompts, max_new_tokens=12, batch_size=2)
    assert [c.token_ids for c in together] == [llm.generate(p, max_new_tokens=12).token_ids for p in prompts]
    assert all(len(c.stats["stages"]) == 2 for c in together) and max(shared_calls) > 1


@pytest.mark.parametrize("dtype", DTYPES)
def test_requests_from_several_threads_join_the_running_batch_and_get_their_own_tokens(tiny_dir, dtype, shared_calls):
    """Four requests at once, at most three in the batch: the fourth joins when one leaves."""
    llm = LLM("self-spec", target=tiny_dir, dtype=dtype, reuse_prompts=False, **{"stages.0.cache.budget": 64})
    prompts = [*PROMPTS, PROMPTS[0][:150]]
    requests = [llm.prepare(prompt, max_new_tokens=new) for prompt, new in zip(prompts, (*NEW_TOKENS, 5), strict=True)]
    alone = [llm.run(request).token_ids for request in requests]
    llm.join_concurrent(3)
    with ThreadPoolExecutor(len(requests)) as pool:
        together = list(pool.map(llm.run, requests))
    assert [completion.token_ids for completion in together] == alone
    assert dtype == "float32" or max(shared_calls) == 3


def test_a_joining_request_that_cannot_fit_in_memory_is_refused_and_the_next_one_runs(tiny_dir, monkeypatch):
    llm = LLM("self-spec", target=tiny_dir, reuse_prompts=False, **{"stages.0.cache.budget": 64})
    request = llm.prepare(PROMPTS[1], max_new_tokens=4)
    alone = llm.run(request).token_ids
    llm.join_concurrent(2)
    monkeypatch.setattr(batch, "available_memory", lambda device: 1000)
    with pytest.raises(CascadeError, match=r"a generation joining the running batch needs .* GiB of KV cache, and 0"):
        llm.run(request)
    monkeypatch.undo()
    assert llm.run(request).token_ids == alone


@pytest.mark.parametrize("size", [0, -1, 2.5])
def test_joining_needs_a_whole_number_of_sequences(tiny_dir, size):
    llm = LLM("autoregressive", target=tiny_dir, reuse_prompts=False)
    with pytest.raises(CascadeError, match=f"max_sequences: must be a whole number of at least 1; got {size}"):
        llm.join_concurrent(size)
