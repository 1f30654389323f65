"""How the retrieval cache ranks a layer's prompt chunks against a query, and what it reads to do so.

A scoring reads a summary of the chunks, not every key, where it can: a summary is computed once
per prompt (or per selection, when chunks are selected only once) and each selection then reads
it alone. Per KV head, the query heads of its group score its chunks together:

- ``mean_key`` (TriForce): the chunk's mean key (float32) against the group's summed query. The
  summary is a quarter of the keys at chunk size 8 in bf16; one product per chunk. A selection made
  once scores the keys themselves instead (``score_prompt``): writing the means cost more than it saves.
- ``bound`` (Quest's criterion): the chunk's per-dimension minimum and maximum key, which bound
  from above what any of its keys can score against a query (``q_d`` times the maximum where
  ``q_d`` is positive, the minimum where it is negative). Each head's bounds are turned into an
  attention over the chunks and summed over the group. Two products per chunk.
- ``attention``: the attention probability the chunk's tokens receive from the group's queries,
  exact for the selecting query; the summary is the keys themselves, one product per token.
- ``sparq`` (SparQ Attention's first step): that attention approximated from the ``query_dims``
  dimensions where the group's queries are largest in magnitude, each head's logits tempered by the
  share of its query's L1 norm those dimensions hold. The summary is the keys laid out by dimension
  ([H_kv, D, S], as many bytes again as the keys), so a selection reads ``query_dims`` of its rows.
"""

from __future__ import annotations

from typing import Literal

import torch

from cache.received_attention import received_attention

Scoring = Literal["mean_key", "bound", "attention", "sparq"]


def summarize_chunks(keys: torch.Tensor, size: int, scoring: Scoring) -> tuple[torch.Tensor, ...]:
    """What ``scoring`` reads of the chunks of ``size`` tokens of keys [H_kv, C*size, D]."""
    chunks = keys.unflatten(1, (-1, size))  # [H_kv, C, size, D]
    if scoring == "mean_key":
        return (chunks.float().mean(2),)  # [H_kv, C, D]
    if scoring == "bound":
        return chunks.amin(2), chunks.amax(2)  # [H_kv, C, D] each, in the keys' dtype
    if scoring == "sparq":
        return (keys.transpose(1, 2).contiguous(),)  # [H_kv, D, C*size]
    return (keys,)


def score_prompt(query: torch.Tensor, keys: torch.Tensor, size: int, scoring: Scoring, query_dims: int) -> torch.Tensor:
    """Scores [H_kv, C] float32 of the chunks of ``size`` tokens of keys [H_kv, C*size, D] for a
    selection made once, without a stored summary: ``mean_key`` as the group's summed query against
    every key, summed per chunk (a mean key's score, by linearity, without writing the float32
    means: SmolLM2's at 32K on a 2-core EPYC took 3.1-3.5 ms per layer, against 0.55 ms for these
    products, the products rounded to the keys' dtype); the others from their summary."""
    if scoring != "mean_key":
        return score_chunks(query, summarize_chunks(keys, size, scoring), size, scoring, query_dims)
    num_kv_heads = keys.shape[0]
    summed = query[:, 0].unflatten(0, (num_kv_heads, -1)).float().sum(1)  # [H_kv, D]
    summed = summed.to(keys.dtype)
    # a matrix product per head: each head's keys are contiguous where the heads together are not (bmm
    # copied them), and a [S, D] x [D, 1] product ran about 2x faster than the matrix-vector one
    products = torch.stack([keys[head] @ summed[head, :, None] for head in range(num_kv_heads)])  # [H_kv, C*size, 1]
    return products.view(num_kv_heads, -1, size).sum(2, dtype=torch.float32) / size


def score_chunks(
    query: torch.Tensor, summary: tuple[torch.Tensor, ...], size: int, scoring: Scoring, query_dims: int
) -> torch.Tensor:
    """Scores [H_kv, C] float32 of the chunks ``summary`` (from ``summarize_chunks``) describes,
    for the selecting query [H, 1, D] (``sparq`` reads ``query_dims`` of its dimensions)."""
    if scoring == "attention":
        (keys,) = summary
        return received_attention(query, keys, products_in_kv_dtype=True).unflatten(1, (-1, size)).sum(2)
    if scoring == "sparq":
        (keys_by_dim,) = summary
        return sparse_query_attention(query, keys_by_dim, query_dims).unflatten(1, (-1, size)).sum(2)
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


def sparse_query_attention(query: torch.Tensor, keys_by_dim: torch.Tensor, query_dims: int) -> torch.Tensor:
    """Approximate attention probability [H_kv, S] float32 each key receives from query [H, 1, D],
    summed over each group's heads, reading ``query_dims`` rows of keys_by_dim [H_kv, D, S]."""
    num_kv_heads, head_dim = keys_by_dim.shape[:2]
    group = query[:, 0].unflatten(0, (num_kv_heads, -1)).float()  # [H_kv, G, D]
    dims = group.abs().sum(1).topk(query_dims, dim=-1).indices  # [H_kv, r]: the group's largest
    heads = torch.arange(num_kv_heads, device=dims.device)[:, None]  # [H_kv, 1]
    rows = keys_by_dim[heads, dims].float()  # [H_kv, r, S]: float32 products; with partial logits
    # rounded to bf16, a 128-token run at 64K accepted 0.856 per token instead of 0.889
    partial = group.gather(2, dims[:, None, :].expand(-1, group.shape[1], -1))  # [H_kv, G, r]
    share = partial.abs().sum(-1, keepdim=True) / group.abs().sum(-1, keepdim=True)  # [H_kv, G, 1]
    logits = torch.bmm(partial, rows)  # [H_kv, G, S]
    return (logits * (head_dim * share).rsqrt()).softmax(-1).sum(1)
