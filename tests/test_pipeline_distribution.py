"""Seeded Monte-Carlo tests that the pipeline emits exactly the target's distribution.

The "models" are toy categorical Markov chains over a 5-token vocabulary: the next-token
distribution depends on the last token only. One long generation gives ~20K transitions; for
each previous token the emitted next tokens must follow the target's row of the transition
matrix (after the same temperature / top-k / top-p transforms), within a total-variation bound
several times the sampling noise (measured: 0.007-0.009).
"""

from __future__ import annotations

import pytest
import torch

from cache.base import TreePass
from cascade.clock import Clock
from cascade.pipeline import Pipeline, StopRule
from cascade.sampling import sample, token_probs
from cascade.schedule import SCHEDULES, Schedule
from cascade.stats import StageStats
from cascade.tree import TokenTree
from cascade.verification import Verdict
from configs.schema import SamplingConfig

VOCAB = 5
TOKENS = 20_000
TV_BOUND = 0.03


class ToyStage:
    """A Markov-chain "model" behind the stage interface the pipeline uses. It checks the protocol:
    every context it is fed extends what it holds, it is fed at least the positions it must score,
    and nothing committed is ever rolled back."""

    def __init__(self, name: str, logits: torch.Tensor, schedule: Schedule | None = None) -> None:
        self.logits = logits  # [V, V]: row = previous token
        self.schedule = schedule
        self.stats = StageStats(name)
        self.clock = Clock(torch.device("cpu"))
        self.cache = self
        self.source = None
        self.seen: list[int] = []
        self.committed = 0
        self.captured_passes = 0  # runs nothing as graphs
        self.tree: TokenTree | None = None
        self.dynamic_tree = False

    @property
    def length(self) -> int:
        return len(self.seen)

    def prefill(self, prompt_ids: torch.Tensor, chunk: int) -> torch.Tensor:
        self.seen = prompt_ids.tolist()
        self.committed = len(self.seen)
        return self.logits[self.seen[-1]]  # [V]

    def extend(self, context: list[int], num_logits: int, proposed: torch.Tensor | None = None,
               tree: TreePass | None = None) -> torch.Tensor:
        """A token-tree node's next distribution, like any token's, depends on it alone."""
        if proposed is not None:
            context = context + proposed.tolist()
        held = len(self.seen)
        assert context[:held] == self.seen, "fed a context that contradicts the cache"
        assert len(context) - held >= num_logits, "asked for logits of positions it was not fed"
        self.stats.forward_calls += 1
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


def cascade_of(logit_tables: list[torch.Tensor], gammas: list[int], schedule: str = "fixed") -> list[ToyStage]:
    stages = [ToyStage(f"toy{i}", table, SCHEDULES[schedule](gamma)) for i, (table, gamma) in
              enumerate(zip(logit_tables[:-1], gammas, strict=True))]
    return stages + [ToyStage("target", logit_tables[-1])]


def emitted_transitions(pipeline: Pipeline, seed: int = 0) -> torch.Tensor:
    """Generate TOKENS tokens after a one-token prompt -> transition counts [V, V]."""
    result = pipeline.generate(torch.tensor([0]), StopRule(frozenset(), TOKENS), torch.Generator().manual_seed(seed))
    sequence = torch.tensor([0] + result.token_ids)
    counts = torch.zeros(VOCAB, VOCAB)
    counts.index_put_((sequence[:-1], sequence[1:]), torch.ones(len(sequence) - 1), accumulate=True)
    return counts


def total_variation(counts: torch.Tensor, target_probs: torch.Tensor) -> float:
    """Distance between the emitted (previous, next) pairs and previous ~ emitted, next ~ target."""
    pairs = counts / counts.sum()
    expected = pairs.sum(1, keepdim=True) * target_probs
    return 0.5 * float((pairs - expected).abs().sum())


SAMPLINGS = [SamplingConfig(temperature=1.0), SamplingConfig(temperature=0.7, top_k=3, top_p=0.9)]


@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["plain", "transformed"])
@pytest.mark.parametrize("draft", [CLOSE, BAD], ids=["close-draft", "bad-draft"])
def test_two_levels_emit_the_target_distribution(sampling, draft):
    pipeline = Pipeline(cascade_of([draft, TARGET], [4]), sampling, prefill_chunk=16)
    assert total_variation(emitted_transitions(pipeline), token_probs(TARGET, sampling)) < TV_BOUND


@pytest.mark.parametrize("schedule", sorted(SCHEDULES))
def test_three_levels_emit_the_target_distribution(schedule):
    sampling = SamplingConfig(temperature=1.0)
    pipeline = Pipeline(cascade_of([BAD, CLOSE, TARGET], [3, 5], schedule), sampling, prefill_chunk=16)
    counts = emitted_transitions(pipeline)
    assert total_variation(counts, token_probs(TARGET, sampling)) < TV_BOUND
    middle = pipeline.stages[1].stats
    assert middle.rounds > 0 and 0 < middle.accepted < middle.proposed


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed-shape", "dynamic"])
@pytest.mark.parametrize("levels", [2, 3])
@pytest.mark.parametrize("sampling", SAMPLINGS, ids=["plain", "transformed"])
def test_token_trees_emit_the_target_distribution(sampling, levels, dynamic):
    """The lowest stage proposes a tree of its 1-3 most likely tokens per node (of 5 here)."""
    stages = cascade_of([BAD, CLOSE, TARGET][-levels:], [4, 3][:levels - 1])
    stages[0].tree, stages[0].dynamic_tree = TokenTree.best_first([0.5, 0.3, 0.1], nodes=9, depth=4), dynamic
    pipeline = Pipeline(stages, sampling, prefill_chunk=16)
    assert total_variation(emitted_transitions(pipeline), token_probs(TARGET, sampling)) < TV_BOUND
    assert stages[0].stats.tree_nodes > stages[0].stats.proposed > stages[0].stats.accepted > 0


class MiddleTierResamplesTarget(Pipeline):
    """A known non-lossless variant: tiers below the last resample a rejection from the verifier's
    plain distribution instead of the residual."""

    def _verify(self, level, proposal, logits):
        verdict, target_probs = super()._verify(level, proposal, logits)
        if level == len(self.stages) - 1 or verdict.accepted == len(proposal):
            return verdict, target_probs
        return Verdict(verdict.accepted, int(sample(target_probs[verdict.accepted], self.generator))), target_probs


def test_the_bound_catches_non_residual_middle_tier_resampling():
    sampling = SamplingConfig(temperature=1.0)
    stages = cascade_of([BAD, CLOSE, TARGET], [3, 5])
    counts = emitted_transitions(MiddleTierResamplesTarget(stages, sampling, prefill_chunk=16))
    assert total_variation(counts, token_probs(TARGET, sampling)) > 2 * TV_BOUND
