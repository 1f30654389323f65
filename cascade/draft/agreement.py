"""Greedy top-1 agreement of a draft with the target, each under the cache it runs with in a cascade.

Teacher forcing on a document: both models read its first ``T - E`` tokens, then each predicts
the token after every one of the last ``E``. The target holds everything (full cache); the draft
holds what its policy keeps (by default StreamingLLM with 4 sinks and a 252-token window, as in the
``triforce`` preset). Agreement is the fraction of the E positions where their argmaxes match.
"""

from __future__ import annotations

import torch

from cache import POLICIES
from cache.config import CachePolicyConfig
from cascade.model import CausalLM
from cascade.stage import Stage

PREFILL_CHUNK = 1024


def default_draft_cache() -> CachePolicyConfig:
    return POLICIES["streaming"].config(sinks=4, window=252)


def target_predictions(target: CausalLM, ids: torch.Tensor, evaluated: int) -> torch.Tensor:
    """[E] target argmax after each of the last ``evaluated`` tokens of ``ids`` [T]."""
    stage = Stage("target", target, POLICIES["full"].config(), target.cache_layout(ids.numel(), PREFILL_CHUNK))
    stage.prefill(ids[:-evaluated], PREFILL_CHUNK)
    return stage.extend(ids.tolist(), evaluated).argmax(-1)  # [E]


def draft_predictions(
    draft: CausalLM, ids: torch.Tensor, evaluated: int, cache: CachePolicyConfig | None = None
) -> torch.Tensor:
    """[E] draft argmax after each of the last ``evaluated`` tokens, fed one at a time as in decoding."""
    layout = draft.cache_layout(ids.numel(), PREFILL_CHUNK)
    stage = Stage("draft", draft, cache or default_draft_cache(), layout)
    stage.prefill(ids[:-evaluated], PREFILL_CHUNK)
    context = ids.tolist()
    predictions = []
    for end in range(ids.numel() - evaluated + 1, ids.numel() + 1):
        predictions.append(stage.extend(context[:end], 1)[-1].argmax())
        stage.commit(end)
    return torch.stack(predictions)  # [E]


def greedy_agreement(
    target: CausalLM, draft: CausalLM, ids: torch.Tensor, evaluated: int, cache: CachePolicyConfig | None = None
) -> float:
    """Fraction of the last ``evaluated`` positions of ``ids`` [T] where draft and target agree."""
    if not 0 < evaluated < ids.numel():
        raise ValueError(f"evaluated must be in 1..{ids.numel() - 1}, got {evaluated}")
    matches = target_predictions(target, ids, evaluated) == draft_predictions(draft, ids, evaluated, cache)
    return matches.float().mean().item()
