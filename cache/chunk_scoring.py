"""How the retrieval cache ranks a layer's prompt chunks against a query, and what it reads to do so.

A scoring reads a summary of the chunks, not every key, where it can: a summary is computed once
per prompt (or per selection, when chunks are selected only once) and each selection then reads
it alone. Per KV head, the query heads of its group score its chunks together:

- ``mean_key`` (TriForce): the chunk's mean key (float32) against the group's summed query. The
  summary is a quarter of the keys at chunk size 8 in bf16; one product per chunk.
- ``bound`` (Quest's criterion): the chunk's per-dimension minimum and maximum key, which bound
  from above what any of its keys can score against a query (``q_d`` times the maximum where
  ``q_d`` is positive, the minimum where it is negative). Each head's bounds are turned into an
  attention over the chunks and summed over the group. Two products per chunk.
- ``attention``: the attention probability the chunk's tokens receive from the group's queries,
  exact for the selecting query; the summary is the keys themselves, one product per token.
"""

from __future__ import annotations

from typing import Literal

import torch

from cache.received_attention import received_attention

Scoring = Literal["mean_key", "bound", "attention"]


def summarize_chunks(keys: torch.Tensor, size: int, scoring: Scoring) -> tuple[torch.Tensor, ...]:
    """What ``scoring`` reads of the chunks of ``size`` tokens of keys [H_kv, C*size, D]."""
    chunks = keys.unflatten(1, (-1, size))  # [H_kv, C, size, D]
    if scoring == "mean_key":
        return (chunks.float().mean(2),)  # [H_kv, C, D]
    if scoring == "bound":
        return chunks.amin(2), chunks.amax(2)  # [H_kv, C, D] each, in the keys' dtype
    return (keys,)


def score_chunks(query: torch.Tensor, summary: tuple[torch.Tensor, ...], size: int, scoring: Scoring) -> torch.Tensor:
    """Scores [H_kv, C] float32 of the chunks ``summary`` (from ``summarize_chunks``) describes,
    for the selecting query [H, 1, D]."""
    if scoring == "attention":
        (keys,) = summary
        return received_attention(query, keys, products_in_kv_dtype=True).unflatten(1, (-1, size)).sum(2)
    num_kv_heads = summary[0].shape[0]
    group = query[:, 0].unflatten(0, (num_kv_heads, -1))  # [H_kv, G, D]
    if scoring == "mean_key":
        (means,) = summary
        return torch.einsum("hcd,hd->hc", means, group.float().sum(1))
    lowest, highest = summary
    group = group.to(highest.dtype)
    positive, negative = group.clamp(min=0).transpose(1, 2), group.clamp(max=0).transpose(1, 2)  # [H_kv, D, G]
    bounds = torch.bmm(highest, positive) + torch.bmm(lowest, negative)  # [H_kv, C, G]
    logits = bounds.float() * query.shape[-1] ** -0.5
    return logits.softmax(1).sum(2)
