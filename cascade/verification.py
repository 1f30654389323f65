"""Speculative verification as pure functions: randomness comes in as arguments.

Vocabulary (as in the literature, with roles instead of letters):
- ``draft_tokens`` [G]: what the stage below proposed, drawn from ``draft_probs`` [G, V];
- ``target_probs`` [G + 1, V]: the verifying stage's distribution at each proposal's position
  and one past the last;
- accepted: the leading proposals kept, each with probability min(1, target / draft);
- recovered token: on the first rejection, a draw from the residual normalize(max(target - draft, 0));
- bonus token: when every proposal is accepted, a draw from the verifier's next distribution.

Together they emit tokens distributed exactly as the verifier's own autoregressive samples.
Greedy decoding is the limit case (one-hot distributions), handled without building them.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from cascade.sampling import sample


@dataclass(frozen=True)
class Verdict:
    accepted: int
    """How many leading draft tokens were accepted."""
    next_token: int
    """The recovered token after a rejection, or the bonus token when all were accepted."""


def verify(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    uniforms: torch.Tensor,
    generator: torch.Generator | None,
) -> Verdict:
    """Sampling verification. ``uniforms`` [G] in [0, 1) decide acceptance; ``generator`` draws the
    recovered or bonus token. Computed on the device and read with one host sync."""
    proposals = len(draft_tokens)
    rows = torch.arange(proposals, device=draft_tokens.device)
    target_at_draft = target_probs[rows, draft_tokens]  # [G]
    draft_at_draft = draft_probs[rows, draft_tokens]  # [G]
    kept = uniforms * draft_at_draft < target_at_draft  # [G]: u < target / draft, no division
    accepted = leading_true(kept)  # [1]
    target_next = target_probs.index_select(0, accepted)[0]  # [V]
    residual = residual_probs(target_next, draft_probs.index_select(0, accepted.clamp_max(proposals - 1))[0])
    next_probs = torch.where(accepted == proposals, target_next, residual)  # bonus if all were accepted
    accepted, next_token = torch.cat([accepted, sample(next_probs, generator)[None]]).tolist()
    return Verdict(accepted, next_token)


def residual_probs(target_probs: torch.Tensor, draft_probs: torch.Tensor) -> torch.Tensor:
    """normalize(max(target - draft, 0)) [V]: what a rejection must be resampled from.

    Rejection implies target(x) < draft(x) for the drafted x, so target != draft and the excess is
    positive in exact arithmetic; if rounding erases it, target itself is the limit."""
    excess = (target_probs - draft_probs).clamp_min(0)  # [V]
    total = excess.sum()
    return torch.where(total > 0, excess / total, target_probs)


def verify_greedy(draft_tokens: torch.Tensor, target_tokens: torch.Tensor) -> Verdict:
    """Greedy verification: keep proposals while they equal the verifier's argmax ``target_tokens``
    [G + 1], then emit the verifier's argmax; both read with one host sync."""
    accepted = leading_true(draft_tokens == target_tokens[: len(draft_tokens)])  # [1]
    accepted, next_token = torch.cat([accepted, target_tokens.gather(0, accepted)]).tolist()
    return Verdict(accepted, next_token)


def leading_true(flags: torch.Tensor) -> torch.Tensor:
    """How many of flags [G] are True before the first False -> [1] int64, left on the device."""
    return flags.long().cumprod(0).sum(0, keepdim=True)
