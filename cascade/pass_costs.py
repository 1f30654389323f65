"""What a stage's passes cost, carried from a runtime's request to its next one.

A pass's time depends on the machine, the models and the context's length, not on what the prompt
says, so a runtime that serves one request after another (the Python API, the server, a
summarization job over many documents, a benchmark's warm-up generations) need not time its passes
from nothing each time. Where the next prompt's length is within ``CARRY_WITHIN`` of the last one's,
each stage's new stats start from the last request's costs (``fresh_stats``): its latest plain-step
and proposal times, and its verification passes' times by width. The cost model then takes no plain
steps first and picks its first gammas from these costs and a hopeful acceptance (``schedule``),
while the acceptance, which depends on the prompt, is measured afresh. The request's own timings
join the carried ones in the same sample windows, the latest kept.

The warm-up this spares: the Qwen2.5-Coder pair at 1K on a 2-core Zen 3 spent ~1.0 s of a 3.2 s,
64-token generation on its 3 plain steps and its rounds at gammas 1, 2 and 8 (~14 tokens), which at
the rate of its later rounds would have taken ~0.65 s.
"""

from __future__ import annotations

from cascade.schedule import Schedule
from cascade.stats import StageStats

CARRY_WITHIN = 1.25
"""The largest ratio between two prompts' lengths across which pass costs carry: a step of the Qwen2.5
1.5B reads 3.1 GB of weights and 28 KB of KV a token, so its cost barely moves within 1K-2K tokens,
while SmolLM2-135M's grows by a fifth between 5K and 8K."""


def carries(timed_at: int | None, prompt_tokens: int) -> bool:
    """Whether costs timed on a prompt of ``timed_at`` tokens (None: none timed) stand for one of
    ``prompt_tokens``."""
    if timed_at is None:
        return False
    return max(timed_at, prompt_tokens) <= CARRY_WITHIN * min(timed_at, prompt_tokens)


def fresh_stats(name: str, schedule: Schedule | None, last: StageStats | None = None) -> StageStats:
    """A stage's stats for its next generation under ``schedule``, starting from the pass costs its
    ``last`` stats timed or carried (None: from nothing)."""
    schedule_name = schedule.name if schedule else ""
    if last is None:
        return StageStats(name, schedule=schedule_name)
    return StageStats(
        name,
        schedule=schedule_name,
        costs_carried=bool(last.plain_samples or last.proposal_samples or last.verification_samples),
        plain_samples=list(last.plain_samples),
        proposal_samples=list(last.proposal_samples),
        verification_samples={gamma: list(times) for gamma, times in last.verification_samples.items()},
    )
