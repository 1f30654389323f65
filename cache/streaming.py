"""``streaming`` (StreamingLLM): the first ``sinks`` tokens plus the ``window`` most recent ones.

Positions live inside the cache: slot i is rotary position i, so a model trained on short
contexts sees short positions at any sequence length. Eviction happens on ``commit``, never on
``allocate``, so rejected speculative tokens can still be rolled back; when the oldest window
tokens are dropped, the kept ones move down and their keys are re-rotated to their new slots.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from cache.base import AttentionView, CacheLayout, CachePolicy
from cache.config import CachePolicyConfig
from cache.full import causal_mask
from cache.registry import register_policy


class StreamingCacheConfig(CachePolicyConfig):
    """Attention sinks + a recent window: constant cost, any length (for the tiny draft)."""

    kind: Literal["streaming"] = "streaming"
    """Policy selector."""
    sinks: int = Field(4, ge=0)
    """First tokens of the sequence that are always kept (attention sinks)."""
    window: int = Field(1024, ge=1)
    """Most recent committed tokens kept after the sinks."""

    @model_validator(mode="after")
    def _sinks_below_window(self) -> StreamingCacheConfig:
        if self.sinks >= self.window:
            raise ValueError(f"sinks ({self.sinks}) must be smaller than window ({self.window})")
        return self


@register_policy(StreamingCacheConfig)
class StreamingCache(CachePolicy):
    def __init__(
        self, layout: CacheLayout, config: StreamingCacheConfig, source: CachePolicy | None = None
    ) -> None:
        super().__init__(layout)
        self.sinks, self.window = config.sinks, config.window
        pending = layout.max_pending or layout.capacity
        self.slots = min(layout.capacity, config.sinks + config.window + pending)
        shape = (layout.num_layers, 1, layout.num_kv_heads, self.slots, layout.head_dim)
        self.keys = torch.zeros(shape, dtype=layout.dtype, device=layout.device)  # [L, B, H_kv, slots, D]
        self.values = torch.zeros_like(self.keys)
        self.evicted = 0
        """Tokens dropped so far: sequence index i >= sinks lives in slot i - evicted."""
        self._start = 0
        self._mask: torch.Tensor | None = None

    @property
    def used_slots(self) -> int:
        return self.length - self.evicted

    def allocate(self, num_new: int) -> torch.Tensor:
        self._check_room(self.used_slots, num_new, self.slots)
        self._reserve(num_new)
        self._start = self.used_slots - num_new
        positions = torch.arange(self._start, self.used_slots, device=self.layout.device)  # [T]
        self._mask = None if num_new == 1 else causal_mask(positions, self.used_slots, self.layout.dtype)
        return positions

    def update(self, layer: int, keys, values, query) -> AttentionView:
        end = self.used_slots
        self.keys[layer, :, :, self._start : end] = keys
        self.values[layer, :, :, self._start : end] = values
        return AttentionView(
            self.keys[layer, :, :, :end], self.values[layer, :, :, :end], self._mask, self._mask is not None
        )

    def commit(self, length: int) -> None:
        super().commit(length)
        excess = (self.committed - self.evicted) - (self.sinks + self.window)
        if excess > 0:
            self._evict(excess)

    def _evict(self, count: int) -> None:
        """Drop the ``count`` oldest tokens after the sinks; later tokens move down ``count`` slots."""
        kept = slice(self.sinks + count, self.used_slots)
        moved = slice(self.sinks, self.used_slots - count)
        self.keys[:, :, :, moved] = self.layout.rotary.shift(self.keys[:, :, :, kept], -count)
        self.values[:, :, :, moved] = self.values[:, :, :, kept].clone()
        self.evicted += count

    def memory_bytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def read_bytes(self) -> int:
        return self.used_slots * self.layout.bytes_per_token
