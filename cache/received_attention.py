"""The attention each cached key receives: what score-based policies (``h2o``, ``topk_oracle``) rank by."""

from __future__ import annotations

import torch


def received_attention(
    query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None = None, products_in_kv_dtype: bool = False
) -> torch.Tensor:
    """Attention probability each key receives, summed over the queries and the query heads sharing
    its KV head: query [H, T, D], keys [H_kv, S, D], additive mask [T, S] -> [H_kv, S] float32.

    The query-key products are float32 unless ``products_in_kv_dtype``: then they are taken in the
    keys' dtype and only the logits are float32 (in bf16 on a CPU about 7x faster than through a
    float32 copy of every key, for rankings that agreed on 99.6% of the top 512 of 8000 chunks)."""
    dtype = keys.dtype if products_in_kv_dtype else torch.float32
    rows = query.to(dtype).unflatten(0, (keys.shape[0], -1)).flatten(1, 2)  # [H_kv, G*T, D]
    products = torch.bmm(keys.to(dtype), rows.transpose(1, 2)).transpose(1, 2)  # [H_kv, G*T, S]; keys
    # on the left: a cache slice's rows are contiguous, its transpose would be copied first
    logits = products.float().unflatten(1, (-1, query.shape[1])) * keys.shape[-1] ** -0.5  # [H_kv, G, T, S]
    if mask is not None:
        logits += mask
    return logits.softmax(-1).sum((1, 2))
