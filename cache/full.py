"""``full``: every token's K/V, preallocated and written by position (as in gpt-fast)."""

from __future__ import annotations

from typing import Literal

import torch

from cache.base import AttentionView, CacheLayout, CachePolicy
from cache.config import CachePolicyConfig
from cache.registry import register_policy


class FullCacheConfig(CachePolicyConfig):
    """Keep the whole context: exact attention, cost grows with the context."""

    kind: Literal["full"] = "full"
    """Policy selector."""


@register_policy(FullCacheConfig)
class FullCache(CachePolicy):
    def __init__(
        self, layout: CacheLayout, config: FullCacheConfig | None = None, source: CachePolicy | None = None
    ) -> None:
        super().__init__(layout)  # holds every token itself: a source is never needed
        shape = (layout.num_layers, 1, layout.num_kv_heads, layout.capacity, layout.head_dim)
        self.keys = torch.zeros(shape, dtype=layout.dtype, device=layout.device)  # [L, B, H_kv, S, D]
        self.values = torch.zeros_like(self.keys)
        self._start = 0
        self._mask: torch.Tensor | None = None

    def allocate(self, num_new: int) -> torch.Tensor:
        self._start = self._reserve(num_new)
        positions = torch.arange(self._start, self.length, device=self.layout.device)  # [T]
        self._mask = None if num_new == 1 else causal_mask(positions, self.length, self.layout.dtype)
        return positions

    def update(
        self, layer: int, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor
    ) -> AttentionView:
        self.keys[layer, :, :, self._start : self.length] = keys
        self.values[layer, :, :, self._start : self.length] = values
        return AttentionView(
            keys=self.keys[layer, :, :, : self.length],
            values=self.values[layer, :, :, : self.length],
            mask=self._mask,
            causal=self._mask is not None,
        )

    def memory_bytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def read_bytes(self) -> int:
        return self.length * self.layout.bytes_per_token


def causal_mask(query_slots: torch.Tensor, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, S] additive: query in slot p reads keys in slots 0..p (bottom-right aligned causality)."""
    key_slots = torch.arange(num_keys, device=query_slots.device)  # [S]
    hidden = key_slots[None, :] > query_slots[:, None]  # [T, S]
    return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill(hidden, float("-inf"))
