"""The speculate-verify loop over N stages; returns tokens and stats and prints nothing.

Stage k draws tokens from its own distribution by letting stage k - 1 propose and verifying the
proposals in one forward pass; stage 0 decodes by itself. The last stage (the full-cache target)
decides every emitted token, so the output is distributed exactly as its own autoregressive
samples. The probabilities a stage hands upward are its own: the tokens a verified round emits
follow the verifier's distribution (accepted proposals and the recovered token together).

Every stage's cache holds K/V for a prefix of the shared ``context`` (prompt + tokens so far);
a stage catches up on what it has not seen at its next forward pass, and rejected tokens are
rolled back in every stage below the one that rejected them.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cascade.lookup import LookupStage
from cascade.sampling import draw, greedy_tokens, token_probs
from cascade.stage import Stage, device_ids
from cascade.stats import GenerationStats, StageStats
from cascade.stop_strings import StopStrings
from cascade.tree import RANKS_SEEN, TokenTree, TreeGrowth, TreePlan, choice_ranks
from cascade.verification import Verdict, verify, verify_greedy
from configs.schema import SamplingConfig

TokenCallback = Callable[[list[int]], None]


@dataclass
class GenerationResult:
    token_ids: list[int]
    """Generated tokens only (the prompt excluded), ending with EOS if it was produced."""
    stats: GenerationStats


@dataclass(frozen=True)
class StopRule:
    """Where generation stops: EOS, ``max_new_tokens``, a completed stop string, or a cancellation
    (checked once per round; the tokens emitted until then are kept)."""

    eos_token_ids: frozenset[int]
    max_new_tokens: int
    stop_strings: StopStrings | None = None
    cancelled: threading.Event | None = None

    def cut(self, emitted: list[int], new: list[int]) -> tuple[list[int], str | None]:
        """The prefix of ``new`` autoregressive decoding would still emit, and why it stops (if it does)."""
        if self.cancelled is not None and self.cancelled.is_set():
            return [], "cancelled"
        room = self.max_new_tokens - len(emitted)
        for index, token in enumerate(new[:room]):
            if token in self.eos_token_ids:
                return new[: index + 1], "eos"
            if self.stop_strings is not None and self.stop_strings.completed(emitted, new[: index + 1]):
                return new[: index + 1], "stop_string"
        if len(new) >= room:
            return new[:room], "max_new_tokens"
        return new, None


class Draw:
    """Tokens drawn from one stage's distribution, with that distribution at each of them.

    The ids stay on the device that drew them, so a stage's decoding feeds each token to its next
    pass without the host waiting; the host reads them (``tokens``) once, when it needs them."""

    def __init__(self, ids: torch.Tensor, probs: torch.Tensor | None, tokens: list[int] | None = None) -> None:
        self.ids = ids
        """[n] int64 on the model's device."""
        self.probs = probs
        """[n, V] float32; None under greedy decoding, where the tokens are the argmaxes."""
        self._tokens = tokens

    @classmethod
    def of(cls, tokens: list[int], probs: torch.Tensor | None, device: torch.device) -> Draw:
        """Tokens the host already knows (a verdict's)."""
        return cls(device_ids(tokens, device), probs, tokens)

    @property
    def tokens(self) -> list[int]:
        if self._tokens is None:
            self._tokens = self.ids.tolist()  # the host's one wait for the device
        return self._tokens

    def __len__(self) -> int:
        return self.ids.numel()

    def __add__(self, other: Draw) -> Draw:
        probs = None if self.probs is None else torch.cat([self.probs, other.probs])
        known = self._tokens is not None and other._tokens is not None
        return Draw(torch.cat([self.ids, other.ids]), probs, self._tokens + other._tokens if known else None)

    def first(self, count: int) -> Draw:
        probs = None if self.probs is None else self.probs[:count]
        return Draw(self.ids[:count], probs, None if self._tokens is None else self._tokens[:count])


def read_together(tensors: list[torch.Tensor]) -> list[list[int]]:
    """1-D integer tensors on one device -> their values, read by the host in one transfer."""
    values = torch.cat(tensors).tolist()
    bounds = [0, *itertools.accumulate(len(tensor) for tensor in tensors)]
    return [values[start:end] for start, end in zip(bounds, bounds[1:], strict=False)]


class Pipeline:
    def __init__(self, stages: list[Stage], sampling: SamplingConfig, prefill_chunk: int) -> None:
        self.stages = stages
        self.sampling = sampling
        self.prefill_chunk = prefill_chunk
        self.greedy = sampling.temperature == 0
        self.generator: torch.Generator | None = None
        self.clock = stages[-1].clock
        """Times the rounds (proposing, verifying, plain steps) for the schedules."""
        self.draft_runs_anyway: Callable[[], bool] | None = None
        """Set by a batch (``cascade.lockstep``): whether the draft's pass that would take the lowest
        stage's next proposal runs now for other sequences anyway, so the proposal costs no time."""
        lowest = stages[0]
        depths = range(1, lowest.tree.depth + 1) if lowest.tree else ()
        self._tree_plans = {depth: TreePlan(lowest.tree.up_to(depth), lowest.device) for depth in depths}
        """The lowest stage's token tree on its device, by depth (when it proposes trees): built
        here, since copying it to the device inside a round would wait for the device."""

    @property
    def target(self) -> Stage:
        return self.stages[-1]

    def generate(
        self,
        prompt_ids: torch.Tensor,
        stop: StopRule,
        generator: torch.Generator | None = None,
        on_tokens: TokenCallback | None = None,
    ) -> GenerationResult:
        """Generate after prompt_ids [T]; ``on_tokens`` receives each run of emitted tokens."""
        self.generator = generator
        stats = GenerationStats(prompt_tokens=prompt_ids.numel(), stages=[s.stats for s in self.stages])
        started = time.perf_counter()
        first = self._draw_from_logits(self._prefill(prompt_ids)[None, :])
        context, emitted = prompt_ids.tolist(), []
        new = first
        while True:
            kept, stats.stop_reason = stop.cut(emitted, new.tokens)  # the host has caught up
            self._settle_timings()
            emitted += kept
            context += kept
            for stage in self.stages:
                stage.commit(len(context))
                if len(context) - stage.length > self.prefill_chunk:  # bypassed for long
                    stage.catch_up(context, self.prefill_chunk)
            if on_tokens:
                on_tokens(kept)
            if new is first:
                stats.prefill_s = time.perf_counter() - started
                started = time.perf_counter()
            if stats.stop_reason:
                break
            new = self._round(len(self.stages) - 1, context, stop.max_new_tokens - len(emitted))
        self._settle_timings()  # the last catch-up passes
        stats.decode_s = time.perf_counter() - started
        stats.new_tokens = len(emitted)
        stats.predicted_speedup = self._predicted_speedup()
        return GenerationResult(emitted, stats)

    def forget_pass_costs(self) -> None:
        """The batch this generation runs in has shrunk (``cascade.lockstep``): the proposing
        stages' pass costs were timed in a larger one."""
        for stage in self.stages[:-1]:
            stage.stats.forget_pass_costs()
            stage.schedule.costs_forgotten()

    def _settle_timings(self) -> None:
        for stage in self.stages:
            stage.clock.settle()

    def _prefill(self, prompt_ids: torch.Tensor) -> torch.Tensor:
        """Prefill every stage (sources before the stages reading them) -> the target's logits [V]."""
        target_logits = self.target.prefill(prompt_ids, self.prefill_chunk)
        for stage in sorted(self.stages[:-1], key=lambda s: s.source is not None):
            stage.prefill(prompt_ids, self.prefill_chunk)
        return target_logits

    def _draw(self, level: int, context: list[int], count: int, room: int) -> Draw:
        """``count`` tokens from stage ``level``'s distribution after ``context`` (not changed); from
        the lowest stage, fewer where it ends its proposals early (``stop_below``), or up to ``room``
        where more cost it nothing (``_proposes_free``)."""
        if level == 0:
            return self._decode(context, count, room)
        drawn = self._round(level, context, count)
        while len(drawn) < count:
            drawn += self._round(level, context + drawn.tokens, count - len(drawn))
        if len(drawn) > count:
            for stage in self.stages[: level + 1]:
                stage.truncate(len(context) + count)
        return drawn.first(count)

    def _decode(self, context: list[int], count: int, room: int) -> Draw:
        """Up to ``count`` tokens the lowest stage decodes by itself after ``context``: each token is
        fed to the next pass as a device tensor, so no pass waits for the host to read one (unless
        the stage ends early in doubt, ``stop_below``: then the host reads each token's confidence).
        Past ``count``, up to ``room``, while more cost it nothing (``_proposes_free``)."""
        stage = self.stages[0]
        if isinstance(stage, LookupStage):  # one continuation: its distribution is one-hot (see _verify)
            return Draw.of(stage.proposal(context, count), None, self.target.device)
        logits = stage.extend(context, 1)  # [1, V]
        drawn = self._draw_from_logits(logits)
        while not self._in_doubt(stage.stop_below, logits[-1:], drawn.probs) and (
            len(drawn) < count or self._proposes_free(stage, len(drawn), room)
        ):
            logits = stage.feed(drawn.ids[-1:], 1)
            drawn += self._draw_from_logits(logits)
        return drawn

    def _proposes_free(self, stage: Stage, drawn: int, room: int) -> bool:
        """Whether the lowest stage, having drawn its round's ``drawn`` tokens (0: its schedule
        bypasses it this round), proposes one more: in a batch whose draft runs its next pass for
        other sequences anyway (the batch verifies together, so this sequence would only wait for
        them), where its schedule finds that the token pays for its place in the verification pass
        (``Schedule.extends``). Not a lookup (it runs no pass) nor a token tree (it grows by levels).
        Which tokens are proposed never changes which are emitted."""
        return (
            self.draft_runs_anyway is not None
            and not isinstance(stage, LookupStage)
            and stage.tree is None
            and drawn < room
            and stage.schedule.extends(stage.stats, drawn)
            and self.draft_runs_anyway()
        )

    def _in_doubt(self, stop_below: float | None, logits: torch.Tensor, probs: torch.Tensor | None = None) -> bool:
        """Whether every row of ``logits`` [R, V] had its most likely next token under ``stop_below``
        probability, in the distribution the stage draws from (the last R rows of ``probs`` where it
        drew them; greedy: the softmax of the logits): the tokens drafted below them were drafted in
        doubt. The stage's own distributions alone decide, so where its proposals end changes no
        output."""
        if stop_below is None:
            return False
        if probs is None:
            probs = logits.float().softmax(-1) if self.greedy else token_probs(logits, self.sampling)
        return bool((probs[-len(logits) :].max(-1).values < stop_below).all())

    def _round(self, level: int, context: list[int], room: int) -> Draw:
        """One round of stage ``level``: >= 1 tokens of its distribution (at most ``room`` + 1)."""
        stage = self.stages[level]
        proposer = self.stages[level - 1] if level > 0 else None
        if level > 1:
            self._price_alone_proposals(proposer, self.stages[level - 2], self._holds_below(level - 1))
        held = self._holds_below(level)
        gamma = proposer.schedule.next_gamma(proposer.stats, room) if proposer and not held else 0
        if gamma and isinstance(proposer, LookupStage):  # it proposes what it finds, maybe nothing
            gamma = len(proposer.proposal(context, gamma))
            proposer.stats.unmatched += gamma == 0
        if held:
            proposer.stats.held_rounds += 1
        elif proposer:
            proposer.stats.gamma_choices[gamma] = proposer.stats.gamma_choices.get(gamma, 0) + 1
        clean = len(context) - stage.length == 1  # the pass feeds no skipped tokens: time it
        captured = self._captured_graphs(level)
        if gamma == 0 and (held or not (level == 1 and self._proposes_free(proposer, 0, room))):
            stepping = self.clock.mark()
            drawn = self._draw_from_logits(stage.extend(context, 1))
            if proposer:
                proposer.stats.plain_rounds += 1
            if proposer and clean and self._captured_graphs(level) == captured:  # timing it waits for it (CUDA)
                proposer.stats.record_plain_step(self.clock.seconds(stepping, self.clock.mark()))
            return drawn
        # its proposal first feeds tokens it skipped: a round leaves it one token behind (a rejection)
        # or two (all accepted: its last proposal and the verifier's next token were never fed to it)
        caught_up = len(context) - proposer.length > 2
        proposing = self.clock.mark()
        if proposer.tree is not None:  # either way, once read the host has caught up
            verdict, drawn, verifying, proposed = self._speculate_tree(level, context, gamma)
        else:
            verdict, drawn, verifying, proposed = self._speculate(level, context, gamma, room)
        finished = self.clock.mark()
        timed = self._captured_graphs(level) == captured
        self._record(
            proposer,
            proposed,
            verdict,
            self.clock.seconds(proposing, verifying),
            self.clock.seconds(verifying, finished),
            clean,
            timed,
            caught_up,
        )
        return drawn

    def _holds_below(self, level: int) -> bool:
        """Whether stage ``level``, itself a proposer to the stage above it, holds the stage below it
        back: until its own speculation has shown it pays (``Schedule.proven``) it proposes by its
        own plain steps, as it would alone. Not a lookup below it: its proposals cost no pass, so
        its rounds waste nothing while the stage above it is unproven."""
        if not 0 < level < len(self.stages) - 1 or isinstance(self.stages[level - 1], LookupStage):
            return False
        stage = self.stages[level]
        return not stage.schedule.proven(stage.stats)

    @staticmethod
    def _price_alone_proposals(proposer: Stage, lower: Stage, held: bool = False) -> None:
        """``proposer``'s proposals are its own plain steps while ``lower``, the stage below it, is
        bypassed or ``held`` back: priced at what those steps cost (``StageStats.alone_proposal_s``),
        else by its rounds."""
        alone = (held or lower.schedule.current == 0) and lower.stats.plain_samples
        proposer.stats.alone_proposal_s = lower.stats.step_s if alone else 0.0

    def _speculate(self, level: int, context: list[int], gamma: int, room: int) -> tuple[Verdict, Draw, int, int]:
        """Up to ``gamma`` tokens of stage ``level - 1``'s distribution (``room`` where more cost
        nothing), verified by stage ``level`` -> (verdict, the tokens it emits with their
        probabilities, the clock mark where verifying began, how many were proposed)."""
        proposal = self._draw(level - 1, context, gamma, room)
        verifying = self.clock.mark()
        logits = self.stages[level].extend(context, len(proposal) + 1, proposal.ids)  # [G + 1, V]
        verdict, target_probs = self._verify(level, proposal, logits)
        for lower in self.stages[: level + 1]:
            lower.truncate(len(context) + verdict.accepted)
        tokens = proposal.tokens[: verdict.accepted] + [verdict.next_token]
        probs = None if target_probs is None else target_probs[: verdict.accepted + 1]
        return verdict, Draw.of(tokens, probs, logits.device), verifying, len(proposal)

    def _speculate_tree(self, level: int, context: list[int], depth: int) -> tuple[Verdict, Draw, int, int]:
        """``_speculate`` for a token tree of ``depth`` levels from the lowest stage (``level`` 1):
        the verifier draws its token after the root and after every node as it would alone, and
        keeps the nodes its draws lead through."""
        growth = self._propose_tree(context, depth)
        nodes = torch.cat(growth.tokens)  # [N]
        verifying = self.clock.mark()
        logits = self.stages[level].extend(context, len(nodes) + 1, nodes, growth.whole())  # [N + 1, V]
        choices, probs = draw(logits, self.sampling, self.generator)  # [N + 1], [N + 1, V] or None
        ranked = torch.cat(growth.ranked)  # [R, K]: the root's and the fed nodes' most likely tokens
        ranks = choice_ranks(ranked, choices[: len(ranked)])  # [R]
        node_tokens, choices, ranks, parents, node_ranks = read_together(  # the host's one wait
            [nodes, choices, ranks, torch.cat(growth.parents), torch.cat(growth.ranks)]
        )
        path, next_token = TokenTree(tuple(parents), tuple(node_ranks)).follow(node_tokens, choices)
        for lower in self.stages[: level + 1]:
            lower.keep_path(len(context), path)
        ranked_at = [0] + [node + 1 for node in path if node + 1 < len(ranks)]  # the root, the fed nodes
        self._record_tree(self.stages[0].stats, len(nodes), [ranks[row] for row in ranked_at])
        rows = [0] + [node + 1 for node in path]  # the verifier's distribution at each emitted token
        tokens = [node_tokens[node] for node in path] + [next_token]
        drawn = Draw.of(tokens, None if probs is None else probs[rows], logits.device)
        return Verdict(len(path), next_token), drawn, verifying, len(growth.tokens)

    def _propose_tree(self, context: list[int], depth: int) -> TreeGrowth:
        """The lowest stage's tree of ``depth`` levels after ``context``, a pass per level but the
        last; fewer levels where every node a level was drawn below was in doubt (``stop_below``:
        then the host reads each fed level's confidence, once per level)."""
        stage = self.stages[0]
        logits = stage.extend(context, 1)  # [1, V]: after the root
        plan = self._tree_plans[min(depth, len(self._tree_plans))]  # deeper: the whole tree
        growth = TreeGrowth(plan, stage.dynamic_tree, logits.device)
        for index, level in enumerate(plan.levels):
            feed = growth.grow(level, logits)
            if index + 1 == len(plan.levels) or self._in_doubt(stage.stop_below, logits):
                break
            logits = stage.feed(growth.tokens[-1], len(level.depths), feed)  # [W, V]
        return growth

    def _verify(self, level: int, proposal: Draw, logits: torch.Tensor):
        """Stage ``level``'s verdict on ``proposal`` given its logits [G + 1, V] -> (verdict, probs)."""
        draft_tokens = proposal.ids  # [G]
        if self.greedy:
            return verify_greedy(draft_tokens, greedy_tokens(logits)), None
        target_probs = token_probs(logits, self.sampling)  # [G + 1, V]
        draft_probs = proposal.probs  # [G, V]; None: a lookup's one continuation
        if draft_probs is None:
            draft_probs = torch.nn.functional.one_hot(draft_tokens, target_probs.shape[-1]).to(target_probs.dtype)
        uniforms = torch.rand(len(draft_tokens), generator=self.generator, device=logits.device)
        return verify(draft_tokens, draft_probs, target_probs, uniforms, self.generator), target_probs

    def _draw_from_logits(self, logits: torch.Tensor) -> Draw:
        """One token from logits [1, V], as autoregressive decoding draws it (left on the device)."""
        return Draw(*draw(logits, self.sampling, self.generator))  # [1], probs [1, V] or None

    def _record(
        self,
        proposer: Stage,
        proposed: int,
        verdict: Verdict,
        propose_s: float,
        verify_s: float,
        clean: bool,
        timed: bool,
        caught_up: bool,
    ) -> None:
        """Count a verified round of ``proposed`` tokens; its times only if ``timed`` (no pass of it was
        captured), its verification's only if ``clean`` and its proposal's apart if the proposer first
        ``caught_up`` on tokens it had skipped."""
        stats = proposer.stats
        stats.rounds += 1
        stats.proposed += proposed
        stats.accepted += verdict.accepted
        stats.rejections += verdict.accepted < proposed
        if timed:
            stats.timed_rounds += 1
            stats.record_proposals(proposed, propose_s, caught_up)
            stats.verify_s += verify_s
        if clean and timed:
            stats.record_verification(proposed, verify_s)
        proposer.schedule.observe(stats, proposed, verdict.accepted)
        if proposer.cache is not None:  # a lookup keeps none
            proposer.cache.observe_acceptance(proposed, verdict.accepted)

    @staticmethod
    def _record_tree(stats: StageStats, nodes: int, ranks: list[int]) -> None:
        """Count a token-tree round's nodes and the proposer's ranks of the verifier's choices."""
        stats.tree_nodes += nodes
        if not stats.choice_ranks:
            stats.choice_ranks = [0] * (RANKS_SEEN + 1)
        for rank in ranks:
            stats.choice_ranks[rank] += 1

    def _captured_graphs(self, level: int) -> int:
        """Pass shapes captured so far by stages 0..``level`` (those a round at ``level`` runs)."""
        return sum(stage.captured_passes for stage in self.stages[: level + 1])

    def _predicted_speedup(self) -> float:
        """The cost model's expectation for the last stage, from what this run measured."""
        if len(self.stages) == 1:
            return 1.0
        proposer = self.stages[-2].stats
        return proposer.overall_speedup(proposer.mean_gamma)
