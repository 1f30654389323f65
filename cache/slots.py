"""The storage every policy here shares: a preallocated slot buffer written by position.

Sequence index i (counted from the start, like ``length``) lives in slot ``i - dropped`` once it
is past the kept front; policies that drop tokens compact the buffer and raise ``dropped``.
Attention reads slots ``[0, used_slots)``; a pass's new tokens are causal among themselves.
"""

from __future__ import annotations

import torch

from cache.base import AttentionView, CacheFullError, CacheLayout, CachePolicy


class SlotCache(CachePolicy):
    def __init__(self, layout: CacheLayout, slots: int, source: CachePolicy | None = None) -> None:
        super().__init__(layout, source)
        self.slots = slots
        shape = (layout.num_layers, 1, layout.num_kv_heads, slots, layout.head_dim)
        self.keys = torch.zeros(shape, dtype=layout.dtype, device=layout.device)  # [L, B, H_kv, slots, D]
        self.values = torch.zeros_like(self.keys)
        self.dropped = 0
        """Tokens of the sequence not held: sequence index i past the kept front is in slot i - dropped."""
        self._start = 0
        self._mask: torch.Tensor | None = None
        """[T, S] causal mask of the current pass, built by its first ``update`` (None for one token)."""

    @property
    def used_slots(self) -> int:
        return self.length - self.dropped

    def _allocate_slots(self, num_new: int) -> torch.Tensor:
        """Reserve ``num_new`` slots after the used ones; returns the sequence indices [T]."""
        if self.used_slots + num_new > self.slots:
            raise CacheFullError(
                f"{type(self).__name__} has {self.slots - self.used_slots} free slots; cannot add "
                f"{num_new} more (more tokens were written between commits than max_pending allows)"
            )
        first = self._reserve(num_new)
        self._start = self.used_slots - num_new
        self._mask = None
        return torch.arange(first, self.length, device=self.layout.device)

    def update(self, layer: int, keys, values, query) -> AttentionView:
        end = self.used_slots
        if self._mask is None and end - self._start > 1:  # built on use: a restored prompt needs none
            slots = torch.arange(self._start, end, device=self.layout.device)  # [T]
            self._mask = causal_mask(slots, end, self.layout.dtype)
        self.keys[layer, :, :, self._start : end] = keys
        self.values[layer, :, :, self._start : end] = values
        return AttentionView(
            self.keys[layer, :, :, :end], self.values[layer, :, :, :end], self._mask, self._mask is not None
        )

    def memory_bytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def read_bytes(self) -> int:
        return self.used_slots * self.layout.bytes_per_token


def pending_room(layout: CacheLayout) -> int:
    """Slots to keep free for tokens written between two commits."""
    return layout.max_pending or layout.capacity


def causal_mask(query_slots: torch.Tensor, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, S] additive: query in slot p reads keys in slots 0..p (bottom-right aligned causality)."""
    key_slots = torch.arange(num_keys, device=query_slots.device)  # [S]
    hidden = key_slots[None, :] > query_slots[:, None]  # [T, S]
    return torch.zeros(hidden.shape, dtype=dtype, device=hidden.device).masked_fill(hidden, float("-inf"))
