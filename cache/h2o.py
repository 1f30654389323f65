"""``h2o`` (Heavy-Hitter Oracle): the ``recent`` newest tokens plus the older tokens that have
received the most attention so far, ``budget`` tokens in all, chosen per KV head.

A token's score is the attention probability it received, accumulated over every committed
query (summed over the query heads sharing its KV head). Scores are folded in on ``commit`` from
the queries kept since the last commit, so rejected speculative tokens never count; eviction
happens on ``commit`` too. Keys keep their original rotary positions.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from cache.base import AttentionView, CacheLayout, CachePolicy
from cache.config import CachePolicyConfig
from cache.received_attention import received_attention
from cache.registry import register_policy
from cache.slots import SlotCache, causal_mask, pending_room

SCORE_BLOCK = 512
"""Queries scored per block when folding attention into the scores (bounds the [H, T, S] temporaries)."""


class H2OCacheConfig(CachePolicyConfig):
    """Heavy hitters by accumulated attention + a recent window (H2O)."""

    kind: Literal["h2o"] = "h2o"
    """Policy selector."""
    budget: int = Field(4096, ge=2)
    """Tokens each KV head keeps: heavy hitters plus the recent window."""
    recent: int = Field(256, ge=1)
    """Newest tokens always kept (part of the budget)."""

    @classmethod
    def at_budget(cls, budget: int) -> H2OCacheConfig:
        return cls(budget=budget, recent=budget // 2)  # half heavy hitters, half recent

    @model_validator(mode="after")
    def _recent_within_budget(self) -> H2OCacheConfig:
        if self.recent >= self.budget:
            raise ValueError(f"recent ({self.recent}) must be smaller than budget ({self.budget})")
        return self


@register_policy(H2OCacheConfig)
class H2OCache(SlotCache):
    static_passes = False  # keeps each pass's queries for scoring at commit
    tree_passes = False  # scores every held query as a token of the sequence

    def __init__(self, layout: CacheLayout, config: H2OCacheConfig, source: CachePolicy | None = None) -> None:
        super().__init__(layout, min(layout.capacity, config.budget + pending_room(layout)))
        self.budget, self.recent = config.budget, config.recent
        self.scores = torch.zeros(layout.num_layers, layout.num_kv_heads, self.slots, device=layout.device)
        """[L, H_kv, slots] attention each held token has received from committed queries."""
        self.pending: list[tuple[int, list[torch.Tensor | None]]] = []
        """(first sequence index, per-layer queries [B, H, T, D]) of each pass since the last commit."""

    def restart(self) -> None:
        super().restart()
        self.scores.zero_()
        self.pending = []

    def allocate(self, num_new: int) -> torch.Tensor:
        positions = self._allocate_slots(num_new)  # [T] absolute: keys keep their rotation
        self.pending.append((self.length - num_new, [None] * self.layout.num_layers))
        return positions

    def update(self, layer: int, keys, values, query) -> AttentionView:
        self.pending[-1][1][layer] = query
        return super().update(layer, keys, values, query)

    def rollback(self, length: int) -> None:
        super().rollback(length)
        self.pending = [
            (first, [query[:, :, : length - first] for query in queries])
            for first, queries in self.pending
            if first < length
        ]

    def commit(self, length: int) -> None:
        super().commit(length)
        still_pending = []
        for first, queries in self.pending:
            accepted = max(0, min(length - first, queries[0].shape[2]))
            for layer, query in enumerate(queries):
                self._accumulate(layer, query[:, :, :accepted], first - self.dropped)  # [B, H, T', D]
            if accepted < queries[0].shape[2]:
                still_pending.append((first + accepted, [query[:, :, accepted:] for query in queries]))
        self.pending = still_pending
        excess = (self.committed - self.dropped) - self.budget
        if excess > 0:
            self._evict(excess)

    def _accumulate(self, layer: int, query: torch.Tensor, first_slot: int) -> None:
        """Add the attention that queries in slots first_slot.. pay to each earlier slot."""
        for start in range(0, query.shape[2], SCORE_BLOCK):
            block = query[0, :, start : start + SCORE_BLOCK]  # [H, T, D]
            end = first_slot + start + block.shape[1]
            query_slots = torch.arange(end - block.shape[1], end, device=block.device)
            mask = causal_mask(query_slots, end, torch.float32)  # [T, S]
            self.scores[layer, :, :end] += received_attention(block, self.keys[layer, 0, :, :end], mask)

    def _evict(self, count: int) -> None:
        """Per head, drop the ``count`` lowest-scored tokens older than the recent window."""
        used = self.used_slots
        old = self.committed - self.dropped - self.recent  # slots eligible for eviction: [0, old)
        keep_old = self.scores[:, :, :old].topk(old - count, dim=-1).indices.sort(-1).values  # [L, H_kv, K]
        newer = torch.arange(old, used, device=keep_old.device).expand(*keep_old.shape[:2], -1)
        kept = torch.cat([keep_old, newer], dim=-1)  # [L, H_kv, used - count]
        index = kept[:, None, :, :, None].expand(-1, 1, -1, -1, self.layout.head_dim)
        kept_slots = used - count
        self.keys[:, :, :, :kept_slots] = self.keys[:, :, :, :used].gather(3, index)
        self.values[:, :, :, :kept_slots] = self.values[:, :, :, :used].gather(3, index)
        self.scores[:, :, :kept_slots] = self.scores[:, :, :used].gather(2, kept)
        self.scores[:, :, kept_slots:] = 0
        self.dropped += count

    def memory_bytes(self) -> int:
        return super().memory_bytes() + self.scores.nbytes
