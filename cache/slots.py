"""The storage every policy here shares: a preallocated slot buffer written by position.

Sequence index i (counted from the start, like ``length``) lives in slot ``i - dropped`` once it
is past the kept front; policies that drop tokens compact the buffer and raise ``dropped``.
Attention reads slots ``[0, used_slots)``; a pass's new tokens are causal among themselves.

A static pass (``set_static(True)``) does the same with shapes and tensor addresses that do not
depend on the cache's state, so it can be captured as a graph once and replayed: its tokens are
written at slot indices held in a device tensor, and attention reads the whole buffer under a
mask built from those indices on device (slots past the pass's last token are hidden like future
tokens). Host-side bookkeeping (``allocate``, ``commit``, eviction) stays outside the pass.
"""

from __future__ import annotations

import torch

from cache.base import AttentionView, CacheFullError, CacheLayout, CachePolicy

SLOT_ALIGNMENT = 64
"""Buffers hold a multiple of this many slots (the extra ones never used), so a static pass's
[T, slots] attention rows are 128-byte aligned: with a misaligned row stride cuBLAS ran the
weights-values product of a verification pass on a slow kernel without tensor cores."""


class SlotCache(CachePolicy):
    static_passes = True

    def __init__(self, layout: CacheLayout, slots: int, source: CachePolicy | None = None) -> None:
        super().__init__(layout, source)
        self.slots = slots
        """Slots this policy may use; its buffer holds that many rounded up to ``SLOT_ALIGNMENT``."""
        buffer = -(-slots // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
        shape = (layout.num_layers, 1, layout.num_kv_heads, buffer, layout.head_dim)
        self.keys = torch.zeros(shape, dtype=layout.dtype, device=layout.device)  # [L, B, H_kv, buffer, D]
        self.values = torch.zeros_like(self.keys)
        self.dropped = 0
        """Tokens of the sequence not held: sequence index i past the kept front is in slot i - dropped."""
        self._start = 0
        self._mask: torch.Tensor | None = None
        """[T, buffer] causal mask of the current static pass, built by its first layer."""
        self._static = False
        self._slot_indices: dict[int, torch.Tensor] = {}
        """Per pass length T, the device tensor [T] int64 of the slots a static pass of T writes."""
        self._pass_slots = self._slot_indices.setdefault(1, torch.zeros(1, dtype=torch.long, device=layout.device))
        """The current static pass's entry of ``_slot_indices``."""
        self._valid_slots = torch.zeros(1, dtype=torch.int32, device=layout.device)
        """[1] slots a static pass's attention reads (its last token's slot + 1)."""

    def restart(self) -> None:
        super().restart()
        self.dropped = self._start = 0
        self._mask, self._static = None, False

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
        if self._static:
            if num_new not in self._slot_indices:
                self._slot_indices[num_new] = torch.empty(num_new, dtype=torch.long, device=self.layout.device)
            self._pass_slots = self._slot_indices[num_new]
            self._pass_slots.copy_(self._as_tensor(range(self._start, self.used_slots)))
            self._valid_slots.fill_(self.used_slots)
        return self._as_tensor(range(first, self.length))

    def _as_tensor(self, indices: range) -> torch.Tensor:
        return torch.arange(indices.start, indices.stop, device=self.layout.device)

    def set_static(self, static: bool) -> None:
        self._static = static

    def update(self, layer: int, keys, values, query) -> AttentionView:
        if self._static:
            return self._static_update(layer, keys, values)
        end = self.used_slots
        self.keys[layer, :, :, self._start : end] = keys
        self.values[layer, :, :, self._start : end] = values
        return AttentionView(self.keys[layer, :, :, :end], self.values[layer, :, :, :end], None, end - self._start > 1)

    def _static_update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> AttentionView:
        """``update`` for a static pass: keys/values [B, H_kv, T, D] go to the slots of the device
        index; the view is the whole buffer [B, H_kv, buffer, D] under a [T, buffer] mask."""
        slots = self._pass_slots  # [T]
        if layer == 0:
            self._mask = causal_mask(slots, self.keys.shape[3], self.layout.dtype)
        self.keys[layer].index_copy_(2, slots, keys)
        self.values[layer].index_copy_(2, slots, values)
        return AttentionView(self.keys[layer], self.values[layer], self._mask, valid_lengths=self._valid_slots)

    def memory_bytes(self) -> int:
        return self.keys.nbytes + self.values.nbytes

    def read_bytes(self) -> int:
        return self.used_slots * self.layout.bytes_per_token


def pending_room(layout: CacheLayout) -> int:
    """Slots to keep free for tokens written between two commits."""
    return layout.max_pending or layout.capacity


def visible_keys(query_slots: torch.Tensor, num_keys: int) -> torch.Tensor:
    """[T, S] boolean, True where the query in slot p reads a key: slots 0..p (bottom-right causality)."""
    key_slots = torch.arange(num_keys, device=query_slots.device)  # [S]
    return key_slots[None, :] <= query_slots[:, None]


def causal_mask(query_slots: torch.Tensor, num_keys: int, dtype: torch.dtype) -> torch.Tensor:
    """[T, S] additive form of ``visible_keys``: 0 where the query reads the key, -inf elsewhere."""
    visible = visible_keys(query_slots, num_keys)
    return torch.full(visible.shape, float("-inf"), dtype=dtype, device=visible.device).masked_fill(visible, 0)
