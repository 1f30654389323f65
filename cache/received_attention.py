"""The attention each cached key receives: what score-based policies (``h2o``, ``topk_oracle``) rank by."""

from __future__ import annotations

import torch


def received_attention(query: torch.Tensor, keys: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Attention probability each key receives, summed over the queries and the query heads sharing
    its KV head: query [H, T, D], keys [H_kv, S, D], additive mask [T, S] -> [H_kv, S] float32."""
    grouped = query.float().unflatten(0, (keys.shape[0], -1))  # [H_kv, G, T, D]
    logits = torch.einsum("hgtd,hsd->hgts", grouped, keys.float()) * keys.shape[-1] ** -0.5
    if mask is not None:
        logits += mask
    return logits.softmax(-1).sum((1, 2))
