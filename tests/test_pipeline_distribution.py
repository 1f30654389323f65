"""Seeded Monte-Carlo tests that the pipeline emits exactly the target's distribution.

The "models" are toy categorical Markov chains over a 5-token vocabulary: the next-token
distribution depends on the last token only. One long generation gives ~20K transitions; for
each previous token the emitted next tokens must follow the target's row of the transition
matrix (after the same temperature / top-k / top-p transforms). Pearson's goodness-of-fit test
decides: a token the target cannot emit fails at once, and otherwise the p-value must stay above
P_FLOOR (exact pipelines measured 0.57-0.98; the over-accepting verifiers planted below, biases
of 0.019-0.028 in total variation, 2e-33 and 2e-20).
"""

from __future__ import annotations

from collections import Counter

import pytest
import torch

import cascade.pipeline as pipeline_module
from cache.base import TreePass
from cascade.clock import Clock
from cascade.lookup import LookupStage
from cascade.pipeline import Pipeline, StopRule
from cascade.sampling import sample, token_probs
from cascade.schedule import SCHEDULES, Schedule
from cascade.stats import StageStats
from cascade.translated_stage import TranslatedStage
from cascade.translation import Translation
from cascade.tree import TokenTree
from cascade.verification import Verdict
from configs.schema import SamplingConfig
from tests.goodness_of_fit import P_FLOOR, fit_p_value

VOCAB = 5
TOKENS = 20_000


class ToyClock(Clock):
    """Simulated seconds that only the toy passes advance, so that what the cost model chooses hangs
    on the stages' costs and acceptance, not on how fast this machine runs a few Python calls (timed
    by the wall clock, a middle stage was once bypassed after 12 rounds that all happened to be
    accepted)."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.now = 0.0

    def mark(self) -> float:
        return self.now


class ToyStage:
    """A Markov-chain "model" behind the stage interface the pipeline uses. It checks the protocol:
    every context it is fed extends what it holds, it is fed at least the positions it must score,
    and nothing committed is ever rolled back. Each pass advances ``clock`` by ``pass_s``."""

    def __init__(
        self,
        name: str,
        logits: torch.Tensor,
        schedule: Schedule | None = None,
        clock: ToyClock | None = None,
        pass_s: float = 1.0,
    ) -> None:
        self.logits = logits  # [V, V]: row = previous token
        self.schedule = schedule
        self.stats = StageStats(name)
        self.device = torch.device("cpu")
        self.clock = clock or ToyClock()
        self.pass_s = pass_s
        self.cache = self
        self.source = None
        self.seen: list[int] = []
        self.committed = 0
        self.captured_passes = 0  # runs nothing as graphs
        self.tree: TokenTree | None = None
        self.dynamic_tree = False
        self.stop_below: float | None = None

    @property
    def length(self) -> int:
        return len(self.seen)

    def prefill(self, prompt_ids: torch.Tensor, chunk: int) -> torch.Tensor:
        self.seen = prompt_ids.tolist()
        self.committed = len(self.seen)
        return self.logits[self.seen[-1]]  # [V]

    def extend(
        self, context: list[int], num_logits: int, proposed: torch.Tensor | None = None, tree: TreePass | None = None
    ) -> torch.Tensor:
        """A token-tree node's next distribution, like any token's, depends on it alone."""
        if proposed is not None:
            context = context + proposed.tolist()
        held = len(self.seen)
        assert context[:held] == self.seen, "fed a context that contradicts the cache"
        assert len(context) - held >= num_logits, "asked for logits of positions it was not fed"
        self.stats.forward_calls += 1
        self.clock.now += self.pass_s
        self.seen += context[held:]
        return self.logits[context[-num_logits:]]  # [N, V]

    def feed(self, token_ids: torch.Tensor, num_logits: int, tree: TreePass | None = None) -> torch.Tensor:
        return self.extend(self.seen, num_logits, token_ids)

    def keep_path(self, start: int, path: list[int]) -> None:
        assert start >= self.committed, "rolled back a committed token"
        nodes = self.seen[start:]
        self.seen = self.seen[:start] + [nodes[node] for node in path if node < len(nodes)]

    def catch_up(self, context: list[int], chunk: int) -> None:
        self.seen = context[:-1]

    def truncate(self, length: int) -> None:
        assert length >= self.committed, "rolled back a committed token"
        del self.seen[length:]

    def commit(self, length: int) -> None:
        del self.seen[length:]
        self.committed = len(self.seen)

    def observe_acceptance(self, proposed: int, accepted: int) -> None:
        pass


def chain(seed: int, sharpness: float) -> torch.Tensor:
    """Random transition logits [V, V]; larger sharpness gives peakier rows."""
    return torch.randn(VOCAB, VOCAB, generator=torch.Generator().manual_seed(seed)) * sharpness


TARGET = chain(0, 1.5)
CLOSE = TARGET + chain(1, 0.4)  # a middle tier that mostly agrees with the target
BAD = -TARGET  # a draft that prefers what the target avoids
CUT = CLOSE.clone()
CUT[:, 3:] = float("-inf")  # a draft that keeps some tokens alone (draft.frequent_tokens)


def cascade_of(logit_tables: list[torch.Tensor], gammas: list[int], schedule: str = "fixed") -> list[ToyStage]:
    """Stages on one clock, each pass a quarter of the next stage's (the target's: one second)."""
    clock, levels = ToyClock(), len(logit_tables)
    stages = [
        ToyStage(f"toy{i}", table, SCHEDULES[schedule](gamma), clock, 4.0 ** (i + 1 - levels))
        for i, (table, gamma) in enumerate(zip(logit_tables[:-1], gammas, strict=True))
    ]
    return stages + [ToyStage("target", logit_tables[-1], clock=clock)]


def emitted_transitions(pipeline: Pipeline, seed: int = 0) -> torch.Tensor:
    """Generate TOKENS tokens after a one-token prompt -> transition counts [V, V]."""
    result = pipeline.generate(torch.tensor([0]), StopRule(frozenset(), TOKENS), torch.Generator().manual_seed(seed))
    sequence = torch.tensor([0] + result.token_ids)
    counts = torch.zeros(VOCAB, VOCAB)
    counts.index_put_((sequence[:-1], sequence[1:]), torch.ones(len(sequence) - 1), accumulate=True)
    return counts


def follows_target(counts: torch.Tensor, sampling: SamplingConfig) -> float:
    """Transition counts [V, V] -> p-value that each row follows the target's next-token distribution."""
    return fit_p_value(counts, counts.sum(1, keepdim=True) * token_probs(TARGET, sampling))


SAMPLINGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=3, top_p=0.9)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["plain", "transformed"])
@pytest.mark.parametrize("draft", [CLOSE, BAD, CUT], ids=["close-draft", "bad-draft", "cut-draft"])
def test_two_levels_emit_the_target_distribution(sampling, draft):
    pipeline = Pipeline(cascade_of([draft, TARGET], [4]), sampling, prefill_chunk=16)
    assert follows_target(emitted_transitions(pipeline), sampling) > P_FLOOR


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["plain", "transformed"])
@pytest.mark.parametrize("draft", [CLOSE, BAD], ids=["close-draft", "bad-draft"])
def test_a_draft_ending_its_rounds_in_doubt_emits_the_target_distribution(sampling, draft):
    """Each draft has rows whose most likely token is above 0.6 and rows where it is below."""
    stages = cascade_of([draft, TARGET], [4])
    stages[0].stop_below = 0.6
    pipeline = Pipeline(stages, sampling, prefill_chunk=16)
    assert follows_target(emitted_transitions(pipeline), sampling) > P_FLOOR
    stats = stages[0].stats
    assert stats.rounds < stats.proposed < 4 * stats.rounds  # rounds of 1 to 4 proposals


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["plain", "transformed"])
@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed-shape", "dynamic"])
def test_token_trees_ending_in_doubt_emit_the_target_distribution(dynamic, sampling):
    """Trees of up to 4 levels that stop growing below a level whose every node's most likely next
    token had less than 0.6 (the close draft has rows on both sides of it)."""
    stages = cascade_of([CLOSE, TARGET], [4])
    stages[0].tree, stages[0].dynamic_tree = TokenTree.best_first([0.5, 0.3, 0.1], nodes=9, depth=4), dynamic
    stages[0].stop_below = 0.6
    pipeline = Pipeline(stages, sampling, prefill_chunk=16)
    assert follows_target(emitted_transitions(pipeline), sampling) > P_FLOOR
    stats = stages[0].stats
    assert stats.rounds < stats.proposed < 4 * stats.rounds  # trees of 1 to 4 levels


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["plain", "transformed"])
def test_three_levels_emit_the_target_distribution(sampling, schedule):
    pipeline = Pipeline(cascade_of([BAD, CLOSE, TARGET], [3, 5], schedule), sampling, prefill_chunk=16)
    counts = emitted_transitions(pipeline)
    assert follows_target(counts, sampling) > P_FLOOR
    middle = pipeline.stages[1].stats
    assert middle.rounds > 0 and 0 < middle.accepted < middle.proposed


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed-shape", "dynamic"])
@pytest.mark.parametrize("levels", [2, 3])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["plain", "transformed"])
def test_token_trees_emit_the_target_distribution(sampling, levels, dynamic):
    """The lowest stage proposes a tree of its 1-3 most likely tokens per node (of 5 here)."""
    stages = cascade_of([BAD, CLOSE, TARGET][-levels:], [4, 3][: levels - 1])
    stages[0].tree, stages[0].dynamic_tree = TokenTree.best_first([0.5, 0.3, 0.1], nodes=9, depth=4), dynamic
    pipeline = Pipeline(stages, sampling, prefill_chunk=16)
    assert follows_target(emitted_transitions(pipeline), sampling) > P_FLOOR
    assert stages[0].stats.tree_nodes > stages[0].stats.proposed > stages[0].stats.accepted > 0


@pytest.mark.parametrize("levels", [2, 3])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["plain", "transformed"])
def test_prompt_lookup_proposals_emit_the_target_distribution(sampling, levels):
    """A lookup's proposal is one continuation, verified as a one-hot distribution: on a 5-token chain
    its bigrams and trigrams recur from the first tokens on, so it proposes nearly every round, to
    the target or to a middle tier."""
    lookup = LookupStage("lookup", range(2, 4), torch.device("cpu"), SCHEDULES["fixed"](4))
    pipeline = Pipeline([lookup, *cascade_of([CLOSE, TARGET][-(levels - 1) :], [3][: levels - 2])], sampling, 16)
    assert follows_target(emitted_transitions(pipeline), sampling) > P_FLOOR
    assert 0 < lookup.stats.accepted < lookup.stats.proposed
    assert lookup.stats.rounds > lookup.stats.plain_steps  # it found something to propose most rounds


SHARED = [(2, 0), (0, 1), (1, 2), (5, 3)]
"""A draft vocabulary of 6 tokens beside the target's 5: (draft id, target id) of the tokens both hold;
target 4 reads as draft 3 then 4, which alone mean nothing to the target."""


class ToyTranslation(Translation):
    """``SHARED``, the prompt spelled token by token (there is no text to encode)."""

    def __init__(self) -> None:
        draft_ids, target_ids = (torch.tensor(ids) for ids in zip(*SHARED, strict=True))
        super().__init__(draft_ids, target_ids, VOCAB, None, None, {4: [3, 4]})

    def prompt(self, prompt_ids: list[int]) -> list[int]:
        return [draft for token in prompt_ids for draft in self.draft_tokens(token)]


OTHER_TOKENIZER = torch.randn(6, 6, generator=torch.Generator().manual_seed(3)) * 0.5  # [6, 6]
for draft_before, target_before in SHARED:  # near the target's chain among the shared tokens
    for draft_next, target_next in SHARED:
        OTHER_TOKENIZER[draft_before, draft_next] += CLOSE[target_before, target_next]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["plain", "transformed"])
def test_a_draft_with_another_tokenizer_emits_the_target_distribution(sampling):
    """Its proposals are the shared tokens its chain draws; the toy stage below checks that every
    context it is fed extends what it holds, so the spelling of target token 4 as two draft tokens
    and the rollbacks across it stay consistent."""
    draft = TranslatedStage(ToyStage("other", OTHER_TOKENIZER, SCHEDULES["fixed"](3)), ToyTranslation())
    pipeline = Pipeline([draft, ToyStage("target", TARGET)], sampling, prefill_chunk=16)
    assert follows_target(emitted_transitions(pipeline), sampling) > P_FLOOR
    assert 0 < draft.stats.accepted < draft.stats.proposed
    assert draft.inner.length >= draft.length  # target 4 is spelled in two draft tokens


class MiddleTierResamplesTarget(Pipeline):
    """A known non-lossless variant: tiers below the last resample a rejection from the verifier's
    plain distribution instead of the residual."""

    def _verify(self, level, proposal, logits):
        verdict, target_probs = super()._verify(level, proposal, logits)
        if level == len(self.stages) - 1 or verdict.accepted == len(proposal):
            return verdict, target_probs
        return Verdict(verdict.accepted, int(sample(target_probs[verdict.accepted], self.generator))), target_probs


def test_the_test_catches_non_residual_middle_tier_resampling():
    sampling = SamplingConfig(temperature=1.0)
    stages = cascade_of([BAD, CLOSE, TARGET], [3, 5])
    counts = emitted_transitions(MiddleTierResamplesTarget(stages, sampling, prefill_chunk=16))
    assert follows_target(counts, sampling) < P_FLOOR


@pytest.mark.parametrize("sampling,excess", [(SAMPLINGS[0], 1.1), (SAMPLINGS[1], 1.05)], ids=["plain", "transformed"])
def test_the_test_catches_a_verifier_that_accepts_too_often(sampling, excess, monkeypatch):
    """u < excess * target / draft instead of u < target / draft: biases of 0.028 (plain, 10%) and
    0.019 (transformed, 5%) in total variation, which a bound at 3x the plain noise (0.03) misses."""
    exact_verify = pipeline_module.verify
    monkeypatch.setattr(
        pipeline_module,
        "verify",
        lambda tokens, draft_probs, target_probs, uniforms, generator: exact_verify(
            tokens, draft_probs, target_probs, uniforms / excess, generator
        ),
    )
    pipeline = Pipeline(cascade_of([CLOSE, TARGET], [4]), sampling, prefill_chunk=16)
    assert follows_target(emitted_transitions(pipeline), sampling) < P_FLOOR


EOS = 3
RUNS = 4_000


def output_law(sampling: SamplingConfig, max_new_tokens: int) -> dict[tuple[int, ...], float]:
    """Every output the target chain can sample after the prompt [0], up to EOS or the token
    limit -> its probability."""
    probs = token_probs(TARGET, sampling).tolist()
    law: dict[tuple[int, ...], float] = {}
    unfinished = {(): 1.0}
    while unfinished:
        output, chance = unfinished.popitem()
        for token, token_chance in enumerate(probs[output[-1] if output else 0]):
            if token_chance == 0:
                continue
            longer = output + (token,)
            finished = token == EOS or len(longer) == max_new_tokens
            (law if finished else unfinished)[longer] = chance * token_chance
    return law


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["plain", "transformed"])
def test_sampled_outputs_stop_as_the_target_would(sampling):
    """EOS and max_new_tokens cut the cascade's rounds (3 proposals, 4 tokens at most): whole
    outputs, their lengths included, follow the target chain's law over RUNS seeded generations."""
    stop, law = StopRule(frozenset({EOS}), 4), output_law(sampling, 4)
    pipeline = Pipeline(cascade_of([BAD, CLOSE, TARGET], [2, 3]), sampling, prefill_chunk=16)
    outputs = Counter(
        tuple(pipeline.generate(torch.tensor([0]), stop, torch.Generator().manual_seed(seed)).token_ids)
        for seed in range(RUNS)
    )
    assert set(outputs) <= set(law), f"outputs the target cannot sample: {set(outputs) - set(law)}"
    observed = torch.tensor([[float(outputs[output]) for output in law]])
    assert fit_p_value(observed, RUNS * torch.tensor([list(law.values())])) > P_FLOOR
