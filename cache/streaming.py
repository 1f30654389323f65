"""``streaming`` (StreamingLLM): the first ``sinks`` tokens plus the ``window`` most recent ones.

Positions live inside the cache: slot i is rotary position i, so a model trained on short
contexts sees short positions at any sequence length. Eviction happens on ``commit``, never on
``allocate``, so rejected speculative tokens can still be rolled back, and only once
``evict_every`` tokens past the window have accumulated (each eviction passes over the whole
window); when the oldest window tokens are dropped, the kept ones move down and their keys are
re-rotated to their new slots. The re-rotation starts from a float32 copy of the window's keys,
not from the rounded keys attention reads: a key moved at many evictions of a long generation is
then rounded to the cache's dtype once per move, not once more at each.
"""

from __future__ import annotations

from typing import Literal

import torch
from pydantic import Field, model_validator

from cache.base import CacheLayout, CachePolicy
from cache.config import CachePolicyConfig
from cache.registry import register_policy
from cache.slots import SlotCache, pending_room


class StreamingCacheConfig(CachePolicyConfig):
    """Attention sinks + a recent window: constant cost, any length (for the tiny draft)."""

    kind: Literal["streaming"] = "streaming"
    """Policy selector."""
    sinks: int = Field(4, ge=0)
    """First tokens of the sequence that are always kept (attention sinks)."""
    window: int = Field(1024, ge=1)
    """Most recent committed tokens kept after the sinks."""
    prefill_tail: int | None = Field(None, ge=1)
    """Prefill feeds only the sinks and the prompt's last ``prefill_tail`` tokens, not the ones
    between, which the window would have evicted: a long prompt's prefill costs about a
    ``prefill_tail``-token one. The kept tokens' K/V are then computed from that tail alone (with
    several times ``window`` the difference fades through the layers' windows), which can change
    what a draft proposes, never what the pipeline outputs. None feeds every token."""
    evict_every: int | None = Field(None, ge=1)
    """Tokens past the window that a commit lets accumulate before it evicts them all: between
    evictions the window holds up to ``evict_every - 1`` more tokens. Each eviction moves and
    re-rotates every kept key (some 45-75 ms for a window of 2,044 SmolLM2 tokens on two cores), so
    evicting at every round's commit would cost a pass over the window per round. None: a
    sixteenth of the window."""

    @classmethod
    def at_budget(cls, budget: int) -> StreamingCacheConfig:
        return cls(sinks=4, window=budget - 4, evict_every=1)  # never more than the budget

    @property
    def most_held(self) -> int:
        """Tokens held after a commit: the sinks, the window and what waits for the next eviction."""
        return self.sinks + self.window + self.eviction_batch - 1

    @property
    def eviction_batch(self) -> int:
        return self.evict_every or max(1, self.window // 16)

    def rotary_positions(self, sequence_tokens: int) -> int:
        return min(sequence_tokens, self.most_held)  # slot i is position i

    def unfed_prompt(self, length: int) -> range:
        """The prompt positions a prefill of ``length`` tokens leaves out: between the sinks and the tail."""
        if self.prefill_tail is None:
            return range(0)
        return range(self.sinks, max(self.sinks, length - self.prefill_tail))

    def holds_every_prompt_token(self, prompt_tokens: int) -> bool:
        """A prompt that fits before the first eviction, every token of it fed."""
        return not self.unfed_prompt(prompt_tokens) and prompt_tokens <= self.most_held

    def within_positions(self, positions: int) -> tuple[str, str]:
        """Narrow the window: the widest with which this policy reads at most ``positions`` positions."""
        window = positions - self.sinks
        while window > 1 and self.model_copy(update={"window": window}).most_held > positions:
            window -= 1
        return "a window within it", f"window={window}"

    @model_validator(mode="after")
    def _sinks_below_window(self) -> StreamingCacheConfig:
        if self.sinks >= self.window:
            raise ValueError(f"sinks ({self.sinks}) must be smaller than window ({self.window})")
        return self


@register_policy(StreamingCacheConfig)
class StreamingCache(SlotCache):
    def __init__(self, layout: CacheLayout, config: StreamingCacheConfig, source: CachePolicy | None = None) -> None:
        super().__init__(layout, min(layout.capacity, config.most_held + pending_room(layout)))
        self.config = config
        self.sinks, self.window = config.sinks, config.window
        self.eviction_batch = config.eviction_batch
        self._exact_keys: torch.Tensor | None = None
        """[L, B, H_kv, buffer, D] float32: the window's keys as re-rotated, before rounding
        (allocated at the first eviction)."""
        self._exact_up_to = 0
        """Slots below this hold their current key in ``_exact_keys`` (those past it: only in ``keys``)."""

    def restart(self) -> None:
        super().restart()
        self._exact_up_to = 0

    def allocate(self, num_new: int) -> torch.Tensor:
        self._allocate_slots(num_new)
        return self._as_tensor(range(self._start, self.used_slots))  # in-cache positions

    def commit(self, length: int) -> None:
        super().commit(length)
        excess = (self.committed - self.dropped) - (self.sinks + self.window)
        if excess >= self.eviction_batch:
            self._evict(excess)

    def unfed_prompt(self, length: int) -> range:
        return self.config.unfed_prompt(length)

    def skip(self, count: int) -> None:
        if count and (self.committed != self.length or self.used_slots > self.sinks):
            raise ValueError(f"skip({count}) needs every token committed and only the sinks held")
        self.length += count
        self.committed += count
        self.dropped += count

    def _evict(self, count: int) -> None:
        """Drop the ``count`` oldest tokens after the sinks; later tokens move down ``count`` slots."""
        kept = slice(self.sinks + count, self.used_slots)
        moved = slice(self.sinks, self.used_slots - count)
        exact = self._exact_window()
        exact[:, :, :, moved] = self.layout.rotary.shift(exact[:, :, :, kept], -count)
        self.keys[:, :, :, moved] = exact[:, :, :, moved]
        self.values[:, :, :, moved] = self.values[:, :, :, kept].clone()
        self.dropped += count
        self._exact_up_to = self.committed - self.dropped  # a later rollback may rewrite the rest

    def _exact_window(self) -> torch.Tensor:
        """``_exact_keys`` with every held window slot current (keys written since the last
        eviction copied in as written)."""
        if self._exact_keys is None:
            self._exact_keys = torch.zeros_like(self.keys, dtype=torch.float32)
        fresh = slice(max(self._exact_up_to, self.sinks), self.used_slots)
        self._exact_keys[:, :, :, fresh] = self.keys[:, :, :, fresh]
        return self._exact_keys
