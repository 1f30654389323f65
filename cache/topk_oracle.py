"""``topk_oracle``: every KV head reads only the ``budget`` earlier tokens its queries attend to most.

An upper bound for selection policies at equal budget, not a fast policy: it holds every token
and scores all of them at every step. The score of a token for a KV head is its attention
probability summed over the query heads sharing that KV head, from the pass's first query: the
later tokens of a pass may be proposals under verification, and a selection that looked at them
would let a stage's distribution depend on tokens after the position (see ``retrieval``).
Tokens of the current pass are always read (causally).

The prompt's K/V are copied from the ``source`` full cache of the same model, computed with full
attention like the prompt retrieval reads. Prefilled under its own selection, each later prompt
chunk would read only the ``budget`` keys its first token chose, and the oracle would start from a
prompt no other policy sees.
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
    reads_source = True
    static_passes = False  # picks its keys per pass, by value
    tree_passes = False  # its views are causal by construction

    def __init__(self, layout: CacheLayout, config: TopKOracleCacheConfig, source: CachePolicy | None = None) -> None:
        if not isinstance(source, FullCache):
            raise ValueError("the topk_oracle cache copies the prompt from a full cache of the same model")
        super().__init__(layout)
        self.source = source
        self.budget = config.budget
        self._take_prompt()

    def restart(self) -> None:
        """Start over on the prompt the source now holds (it was prefilled again)."""
        super().restart()
        self._take_prompt()

    def _take_prompt(self) -> None:
        """Copy the source's committed tokens (the prompt) and commit them."""
        prompt = self.source.committed
        self.allocate(prompt)
        for mine, source in ((self.keys, self.source.keys), (self.values, self.source.values)):
            mine[:, :, :, :prompt] = source[:, :, :, :prompt]  # [L, B, H_kv, prompt, D]
        self.commit(prompt)

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
