"""Counters a generation run fills in; the pipeline records them, callers decide what to print."""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, field

from cascade.costs import along_curve, expected_speedup, expected_tokens, rising_curve

PLAIN_SAMPLES_KEPT = 32
"""Plain-step times, and per-token proposal times of rounds, a stage keeps for their medians
(``StageStats.step_s``, ``StageStats.proposal_s``)."""
VERIFICATION_SAMPLES_KEPT = 8
"""Clean verification passes' times a stage keeps per gamma for their median (``StageStats.verification_s``)."""
PASS_OVER_STEP = 1.5
"""The most the cheapest verification pass timed is taken to cost over a plain step before any plain
step is timed: a pass does a step's work and more, so a step costs at most that pass's time and, read
this far, at least two thirds of it (2-token passes of the Qwen2.5 1.5B at 32K on the AMX Xeon cost
1.0-1.1 steps, single passes swinging between 145 and 230 ms with the VM's speed)."""
OUTPACED = 1.1
"""How much dearer than a verification pass of some width plain steps must look before their times are
taken for a slower phase of the generation (``StageStats.step_outpaced``): a few percent either way is
noise."""


@dataclass
class StageStats:
    name: str
    prefill_s: float = 0.0
    """Time this stage spent on the prompt (0 for stages that read another stage's KV)."""
    prefill_loaded: bool = False
    """The prompt's K/V came from the prompt cache instead of a prefill."""
    prefill_reused: int = 0
    """Prompt tokens whose K/V came from the prompt cache (all of them when ``prefill_loaded``; a
    prefix of whole prefill passes when the cache held a prompt that begins the same way)."""
    forward_calls: int = 0
    """Decode and verification passes after the prompt."""
    tokens_processed: int = 0
    """Tokens fed through those passes."""
    time_s: float = 0.0
    """Time in those passes."""
    kv_bytes_read: int = 0
    """KV bytes those passes read."""
    rounds: int = 0
    """Times this stage's proposals were verified by the stage above."""
    proposed: int = 0
    accepted: int = 0
    rejections: int = 0
    """Rounds that ended in a rejection (the others accepted every proposal)."""
    unmatched: int = 0
    """Rounds a lookup stage found nothing to propose in (the stage above took a plain step)."""
    plain_rounds: int = 0
    """Rounds the stage above decoded alone, one plain step each: this stage bypassed or held back,
    a plain step timed, or a lookup that found nothing (``unmatched``)."""
    timed_rounds: int = 0
    """Rounds whose time is counted: those during which no stage captured a pass as a graph (a
    capture's eager run and recording would be charged to the passes the cost model weighs)."""
    timed_proposed: int = 0
    """Proposals of those rounds."""
    propose_s: float = 0.0
    """Time drawing the timed rounds' proposals, the stages below it included."""
    proposal_samples: list[float] = field(default_factory=list)
    """Per timed round, its proposal time over its proposals (the latest ``PLAIN_SAMPLES_KEPT``):
    their median is a proposal's cost, which a one-off dear pass (a retrieval cache's first
    selection) does not set. Rounds whose proposal began by catching up on tokens the stage skipped
    (after plain steps or bypassed rounds) are not among them (``catch_up_s``)."""
    alone_proposal_s: float = 0.0
    """While the stage below this one is bypassed or held back (``held_rounds``), this stage proposes
    by its own plain steps, and a proposal costs what they do (that stage's ``step_s``, set by the
    pipeline; 0 while it proposes): its proposal samples, timed while that stage proposed, price
    another proposer. In ``triforce`` on SmolLM2 at 8K the retrieval stage's warm-up rounds, each a
    draft proposal and its verification, priced a proposal at 15 ms against 11.5 for its plain steps
    beside 15-17 ms full steps; its later rounds (probes) began by catching up, so it never saw the
    cheaper price and stayed bypassed."""
    catch_up_s: float = 0.0
    """The latest timed round whose proposal began by catching up on skipped tokens (a probe after
    bypassed rounds): its time over its proposals. Counted among the proposal samples, two probes'
    catch-ups among a cold warm-up's four rounds priced the Qwen2.5 0.5B draft's proposals at 16K at
    0.12 s instead of 0.03, and its cost model bypassed a draft that paid 1.5x (2-core Zen 3)."""
    verify_s: float = 0.0
    """Time the stage above spent verifying them."""
    clean_verifications: dict[int, int] = field(default_factory=dict)
    """Verification passes of exactly gamma + 1 tokens (the verifier had nothing to catch up on),
    by gamma: the passes the cost model fits its verification time to."""
    clean_verification_s: dict[int, float] = field(default_factory=dict)
    """Their time, by gamma."""
    verification_samples: dict[int, list[float]] = field(default_factory=dict)
    """The latest of their times by gamma (at most ``VERIFICATION_SAMPLES_KEPT``, carried ones
    first), whose medians the cost model fits: one slow pass does not set a width's cost once it has
    been timed again."""
    plain_steps: int = 0
    """One-token passes of the stage above decoding alone (gamma 0: bypassed, or timing a plain
    step); passes that also caught up on skipped tokens are not counted."""
    plain_s: float = 0.0
    """Time of those passes."""
    plain_samples: list[float] = field(default_factory=list)
    """The latest of their times (at most ``PLAIN_SAMPLES_KEPT``), whose median is a plain step's cost:
    one slow pass (a first touch, a noisy neighbour) does not set it."""
    plain_samples_stale: bool = False
    """The next plain step's time replaces ``plain_samples`` (``retime_plain_step``)."""
    schedule: str = ""
    """The gamma schedule of this stage's proposals ('' for the last stage, which proposes nothing)."""
    gamma_choices: dict[int, int] = field(default_factory=dict)
    """Rounds run at each gamma the schedule chose (0: bypassed, the verifier decoded alone)."""
    held_rounds: int = 0
    """Rounds of the stage above sat out while that stage's own speculation was unproven (it
    proposed by its plain steps; ``Pipeline._holds_below``): not among ``gamma_choices``."""
    tree_nodes: int = 0
    """Token-tree nodes proposed (see ``cascade.tree``); a tree round counts its depth as proposed."""
    choice_ranks: list[int] = field(default_factory=list)
    """Token-tree rounds: at each node where the verifier chose its next token (the root and the
    accepted nodes this stage had fed), how often that token was this stage's r-th most likely,
    by r; the last count is for the tokens ranked lower than all of those."""
    costs_carried: bool = False
    """This generation started from the pass costs of the runtime's previous request
    (``cascade.pass_costs``): ``plain_samples``, ``proposal_samples`` and ``verification_samples``
    began with that request's."""

    def record_plain_step(self, seconds: float) -> None:
        self.plain_steps += 1
        self.plain_s += seconds
        self.plain_samples = [seconds] if self.plain_samples_stale else latest_samples(self.plain_samples, seconds)
        self.plain_samples_stale = False

    def record_verification(self, proposed: int, seconds: float) -> None:
        """A clean, timed verification of ``proposed`` tokens took ``seconds``."""
        self.clean_verifications[proposed] = self.clean_verifications.get(proposed, 0) + 1
        self.clean_verification_s[proposed] = self.clean_verification_s.get(proposed, 0.0) + seconds
        kept = self.verification_samples.get(proposed, [])
        self.verification_samples[proposed] = latest_samples(kept, seconds, VERIFICATION_SAMPLES_KEPT)

    def retime_plain_step(self) -> None:
        """The plain steps timed so far are from another phase of the generation (a process's slow
        first steps, a shorter context): the next one's time replaces theirs."""
        self.plain_samples_stale = True

    def step_outpaced(self) -> bool:
        """Whether the plain steps' median is more than ``OUTPACED`` times the median of verification
        passes of some width timed at least twice. A pass of more tokens over the same cache costs at
        least a step, so such steps were timed in a slower phase (a process's first passes: SmolLM2's
        `triforce` at 8K timed its first full-cache steps at 19-26 ms, its 2-token verifications at
        17-20 ms and its steps later at ~15 ms, and predicted 1.66x where it ran at 1.07x)."""
        if not self.plain_samples or self.plain_samples_stale:
            return False
        passes = [statistics.median(times) for times in self.verification_samples.values() if len(times) >= 2]
        return bool(passes) and self.step_s > OUTPACED * min(passes)

    def forget_pass_costs(self) -> None:
        """The passes timed so far ran in a batch of another size (``cascade.lockstep``): their
        verifications' times are dropped and the next plain step's replaces the plain steps'. The
        proposals' are kept: a draft's pass costs about the same for a few rows as for one (the
        Qwen2.5 0.5B at 8K: 28-44 ms at batch 4 on a 2-core Xeon with AMX), where a verification
        of four rows cost 1.3-1.7 of one row's."""
        self.verification_samples = {}
        self.retime_plain_step()

    def record_proposals(self, proposed: int, seconds: float, caught_up: bool = False) -> None:
        """A timed round drew ``proposed`` tokens in ``seconds``, after catching up on tokens the stage
        had skipped if ``caught_up`` (then its time is ``catch_up_s``, not a proposal sample)."""
        self.timed_proposed += proposed
        self.propose_s += seconds
        if caught_up:
            self.catch_up_s = seconds / proposed
        else:
            self.proposal_samples = latest_samples(self.proposal_samples, seconds / proposed)

    @property
    def proposal_s(self) -> float:
        """A proposed token's time: its plain steps' while the stage below is bypassed or
        held back (``alone_proposal_s``), else the median over the latest timed rounds (0 before the first)."""
        if self.alone_proposal_s:
            return self.alone_proposal_s
        return statistics.median(self.proposal_samples) if self.proposal_samples else 0.0

    @property
    def step_s(self) -> float:
        """A plain step's time: the median of the latest samples (0 before the first)."""
        return statistics.median(self.plain_samples) if self.plain_samples else 0.0

    @property
    def rank_acceptance(self) -> list[float]:
        """``choice_ranks`` as shares: the measured ``tree.rank_acceptance``."""
        total = sum(self.choice_ranks)
        return [count / total for count in self.choice_ranks[:-1]] if total else []

    @property
    def acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def mean_accepted_run(self) -> float:
        """Proposals accepted per verification round."""
        return self.accepted / self.rounds if self.rounds else 0.0

    @property
    def acceptance_mle(self) -> float:
        """Per-token acceptance a, maximum likelihood: each run ends at a rejection or is cut at gamma."""
        trials = self.accepted + self.rejections
        return self.accepted / trials if trials else 0.0

    @property
    def cost_ratio(self) -> float:
        """Time of one proposed token over one verification pass."""
        if not self.timed_proposed or not self.verify_s:
            return 0.0
        return self.proposal_s / (self.verify_s / self.timed_rounds)

    @property
    def verify_over_step(self) -> float:
        """Time of one verification pass over one plain step of the verifier (0 if not measured)."""
        if not self.timed_rounds or not self.plain_samples:
            return 0.0
        return (self.verify_s / self.timed_rounds) / self.step_s

    @property
    def step_range_s(self) -> tuple[float, float]:
        """The least and the most a plain step may cost: the median of the timed ones twice, else from
        the cheapest verification pass timed (``PASS_OVER_STEP``), else the mean pass (0 before any)."""
        if self.plain_samples:
            return self.step_s, self.step_s
        passes = [statistics.median(times) for times in self.verification_samples.values()]
        most = min(passes) if passes else (self.verify_s / self.timed_rounds if self.timed_rounds else 0.0)
        return most / PASS_OVER_STEP, most

    def verification_s(self, gamma: float, hopeful: bool = False) -> float:
        """Expected time of a verification pass of ``gamma`` proposals: the piecewise-linear curve
        through the median pass time at each gamma verified so far (``verification_samples``, carried
        ones included) and a plain step's at gamma 0, kept from falling (``costs.rising_curve``;
        weighted by their sample counts), continued past the widest pass timed along its last segment
        (``hopeful``: flat there, as long as the widest pass timed). On a CPU it is flat while a pass
        is bound by reading the weights and rises once its products become compute-bound; on a GPU it
        stays nearly flat. Without clean passes or plain steps yet: the mean verification pass."""
        points = [(g, statistics.median(times), len(times)) for g, times in self.verification_samples.items()]
        if self.plain_samples:
            points.append((0, self.step_s, len(self.plain_samples)))
        if not points:
            return self.verify_s / self.timed_rounds if self.timed_rounds else 0.0
        return along_curve(rising_curve(points), gamma, extend=not hopeful)

    def expected_speedup(
        self,
        gamma: float,
        acceptance: float | None = None,
        proposal_s: float | None = None,
        hopeful: bool = False,
        least: bool = False,
    ) -> float:
        """The cost model's speed-up at ``gamma`` from these measurements (``acceptance``,
        ``proposal_s``: assumed instead of the measured ones; ``hopeful``: a pass wider than any timed
        no dearer than the widest, ``verification_s``), against the most a plain step may cost
        (``step_range_s``; ``least``: the least, the lowest speed-up it allows)."""
        unpriced = proposal_s is None and not (self.proposal_samples or self.alone_proposal_s)
        if unpriced or not (self.plain_samples or self.timed_rounds):
            return 1.0
        step_s = self.step_range_s[0 if least else 1]
        acceptance = self.acceptance_mle if acceptance is None else acceptance
        proposal_s = self.proposal_s if proposal_s is None else proposal_s
        return expected_speedup(acceptance, proposal_s, self.verification_s(gamma, hopeful), step_s, gamma)

    def overall_speedup(self, gamma: float) -> float:
        """``expected_speedup`` over the rounds this stage proposed in, blended by time with the
        rounds the stage above decoded alone (``plain_rounds``: one token a step each). A generation
        whose stage was bypassed for most of its rounds runs at about a plain step's speed, whatever
        its few speculating rounds promised: the SmolLM2 draft of the Qwen2.5 1.5B across tokenizers
        at 16K (2-core Zen 5) speculated in 8 rounds of 59, ran at 1.0x its plain steps, and was
        predicted 1.43x from those 8 alone."""
        gain = self.expected_speedup(gamma)
        if not self.plain_rounds or not self.rounds:
            return gain
        tokens = expected_tokens(self.acceptance_mle, gamma)  # a proposing round's, in tokens / steps = gain
        return (self.rounds * tokens + self.plain_rounds) / (self.rounds * tokens / gain + self.plain_rounds)

    @property
    def mean_gamma(self) -> float:
        return self.proposed / self.rounds if self.rounds else 0.0

    def to_dict(self) -> dict:
        data = asdict(self)
        for name in (
            "acceptance_rate",
            "acceptance_mle",
            "mean_accepted_run",
            "cost_ratio",
            "verify_over_step",
            "mean_gamma",
            "rank_acceptance",
        ):
            data[name] = getattr(self, name)
        return data


def latest_samples(samples: list[float], new: float, kept: int = PLAIN_SAMPLES_KEPT) -> list[float]:
    """``samples`` with ``new`` appended, the oldest dropped past ``kept``."""
    return [*samples[1 - kept :], new]


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    """Prompt processing plus choosing the first new token (time to first token)."""
    decode_s: float = 0.0
    """Every step after the first new token: new_tokens - 1 of them."""
    stop_reason: str = ""
    """"eos", "max_new_tokens", "stop_string" or "cancelled" (``StopRule``)."""
    stages: list[StageStats] = field(default_factory=list)
    predicted_speedup: float = 1.0
    """The cost model's speed-up over plain decoding, from what the run measured of the stage
    proposing to the last one (see ``StageStats.expected_speedup``); scripts/bench.py measures
    the real one against an autoregressive run."""

    @property
    def tokens_per_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def ms_per_token(self) -> float:
        return 1000 / self.tokens_per_s if self.tokens_per_s else 0.0

    @property
    def tokens_per_verify(self) -> float:
        """Tokens emitted after the first per forward pass of the full-cache stage."""
        calls = self.stages[-1].forward_calls if self.stages else 0
        return (self.new_tokens - 1) / calls if calls > 0 else 0.0

    @property
    def prefill_loaded(self) -> bool:
        """Some stage loaded its prompt from the prompt cache: ``prefill_s`` is no prefill time."""
        return any(stage.prefill_loaded for stage in self.stages)

    def to_dict(self) -> dict:
        data = asdict(self)
        data["stages"] = [stage.to_dict() for stage in self.stages]
        for name in ("tokens_per_s", "ms_per_token", "tokens_per_verify", "prefill_loaded"):
            data[name] = getattr(self, name)
        return data
