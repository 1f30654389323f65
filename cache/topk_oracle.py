"""``topk_oracle``: every KV head reads only the ``budget`` earlier tokens its queries attend to most.

An upper bound for selection policies at equal budget, not a fast policy: it holds every token
and scores all of them at every step. The score of a token for a KV head is its attention
probability summed over the query heads sharing that KV head, from the pass's first query: the
later tokens of a pass may be proposals under verification, and a selection that looked at them
would let a stage's distribution depend on tokens after the position (see ``retrieval``).
Tokens of the current pass are always read (causally).
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field

from cache.base import AttentionView, CacheLayout, CachePolicy
from cache.config import CachePolicyConfig
from cache.full import FullCache
from cache.received_attention import received_attention
from cache.registry import register_policy


class TopKOracleCacheConfig(CachePolicyConfig):
    """Exact token-level top-k by the current attention scores (an upper bound; slow)."""

    kind: Literal["topk_oracle"] = "topk_oracle"
    """Policy selector."""
    budget: int = Field(4096, ge=1)
    """Earlier tokens each KV head reads per step."""


@register_policy(TopKOracleCacheConfig)
class TopKOracleCache(FullCache):
    static_passes = False  # picks its keys per pass, by value

    def __init__(
        self, layout: CacheLayout, config: TopKOracleCacheConfig, source: CachePolicy | None = None
    ) -> None:
        super().__init__(layout)
        self.budget = config.budget

    def update(self, layer: int, keys, values, query) -> AttentionView:
        view = super().update(layer, keys, values, query)
        earlier = self._start
        if earlier <= self.budget:
            return view
        chosen = top_attended(query[:, :, :1], view.keys[:, :, :earlier], self.budget)  # [H_kv, budget]
        index = chosen[None, :, :, None].expand(*view.keys.shape[:2], -1, view.keys.shape[-1])
        picked_keys = torch.cat([view.keys.gather(2, index), view.keys[:, :, earlier:]], dim=2)
        picked_values = torch.cat([view.values.gather(2, index), view.values[:, :, earlier:]], dim=2)
        return AttentionView(picked_keys, picked_values, None, keys.shape[2] > 1)

    def read_bytes(self) -> int:
        return min(self.length, self.budget + 1) * self.layout.bytes_per_token


def top_attended(query: torch.Tensor, keys: torch.Tensor, count: int) -> torch.Tensor:
    """Indices [H_kv, count] of the keys [B, H_kv, S, D] with the most attention from query [B, H, T, D]."""
    return received_attention(query[0], keys[0]).topk(count, dim=-1).indices
