"""``full``: every token's K/V, preallocated and written by position (as in gpt-fast)."""

from __future__ import annotations

from typing import Literal

import torch

from cache.base import CacheLayout, CachePolicy
from cache.config import CachePolicyConfig
from cache.registry import register_policy
from cache.slots import SlotCache


class FullCacheConfig(CachePolicyConfig):
    """Keep the whole context: exact attention, cost grows with the context."""

    kind: Literal["full"] = "full"
    """Policy selector."""

    def holds_every_prompt_token(self, prompt_tokens: int) -> bool:
        return True


@register_policy(FullCacheConfig)
class FullCache(SlotCache):
    def __init__(
        self, layout: CacheLayout, config: FullCacheConfig | None = None, source: CachePolicy | None = None
    ) -> None:
        super().__init__(layout, layout.capacity)  # holds every token itself: never needs a source

    def allocate(self, num_new: int) -> torch.Tensor:
        return self._allocate_slots(num_new)  # nothing is dropped: slots are positions

    def keep_last_queries(self) -> None:
        """Policies of other stages read this cache (``reads_source``): keep them the queries."""
        self._keeping_queries, self.last_queries_at = True, None
