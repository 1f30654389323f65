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

from cache.base import AttentionView, CacheFullError, CacheLayout, CachePolicy, TreePass
from cascade import huge_pages

SLOT_ALIGNMENT = 64
"""Buffers hold a multiple of this many slots (the extra ones never used), so a static pass's
[T, slots] attention rows are 128-byte aligned: with a misaligned row stride cuBLAS ran the
weights-values product of a verification pass on a slow kernel without tensor cores."""


class SlotCache(CachePolicy):
    static_passes = True
    tree_passes = True

    def __init__(self, layout: CacheLayout, slots: int, source: CachePolicy | None = None) -> None:
        super().__init__(layout, source)
        self.slots = slots
        """Slots this policy may use; its buffer holds that many rounded up to ``SLOT_ALIGNMENT``."""
        buffer = -(-slots // SLOT_ALIGNMENT) * SLOT_ALIGNMENT
        shape = (layout.num_layers, 1, layout.num_kv_heads, buffer, layout.head_dim)
        # [L, B, H_kv, buffer, D] each, in huge pages on a CPU: every long pass reads them whole
        self.keys = huge_pages.zeros(shape, layout.dtype, layout.device)
        self.values = huge_pages.zeros(shape, layout.dtype, layout.device)
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
        self._tree: torch.Tensor | None = None
        """[T_tree, N] bool ancestry of the current pass's tree nodes (see ``TreePass``), or None;
        for a static pass, a buffer kept per shape in ``_tree_ancestries``."""
        self._tree_ancestries: dict[tuple[int, int], torch.Tensor] = {}
        self.last_queries: torch.Tensor | None = None
        """[L, H, D] rotated: each layer's query of the last token of the pass ``keep_last_queries``
        marked, for a policy that reads this cache (retrieval selects its chunks with them); a
        subclass others read turns that on (``FullCache``)."""
        self.last_queries_at: int | None = None
        """The sequence index of that token; None until a marked pass (or ``hold_last_queries``)."""
        self._keeping_queries = False

    def restart(self) -> None:
        super().restart()
        self.dropped = self._start = 0
        self._mask, self._static = None, False
        self.last_queries_at, self._keeping_queries = None, False

    def hold_last_queries(self, queries: torch.Tensor) -> None:
        """Take queries [L, H, D] as ``last_queries`` of the last token held (a stored prefill's)."""
        self.last_queries, self.last_queries_at = queries, self.length - 1

    @property
    def used_slots(self) -> int:
        return self.length - self.dropped

    def _allocate_slots(self, num_new: int) -> torch.Tensor:
        """Reserve ``num_new`` slots after the used ones; returns the sequence indices [T]."""
        self._check_room(num_new)
        first = self._reserve(num_new)
        self._start = self.used_slots - num_new
        self._tree = None
        if self._static:
            if num_new not in self._slot_indices:
                self._slot_indices[num_new] = torch.empty(num_new, dtype=torch.long, device=self.layout.device)
            self._pass_slots = self._slot_indices[num_new]
            self._pass_slots.copy_(self._as_tensor(range(self._start, self.used_slots)))
            self._valid_slots.fill_(self.used_slots)
        return self._as_tensor(range(first, self.length))

    def _check_room(self, num_new: int) -> None:
        if self.used_slots + num_new > self.slots:
            raise CacheFullError(
                f"{type(self).__name__} has {self.slots - self.used_slots} free slots; cannot add "
                f"{num_new} more (more tokens were written between commits than max_pending allows)"
            )

    def _as_tensor(self, indices: range) -> torch.Tensor:
        return torch.arange(indices.start, indices.stop, device=self.layout.device)

    def set_static(self, static: bool) -> None:
        self._static = static

    def allocate_tree(self, num_new: int, tree: TreePass) -> torch.Tensor:
        if not self.tree_passes:
            return super().allocate_tree(num_new, tree)
        positions = self.allocate(num_new)  # [T]
        self._tree = tree.ancestry
        if self._static:  # the pass reads the ancestry from a buffer of its shape
            self._tree = self._tree_ancestries.setdefault(tree.ancestry.shape, torch.empty_like(tree.ancestry))
            self._tree.copy_(tree.ancestry)
        nodes = len(tree.depths)
        root = positions[-nodes] - tree.earlier_nodes - 1  # [] the root's position
        return torch.cat([positions[:-nodes], root + tree.depths])

    def keep_path(self, start: int, path: list[int]) -> None:
        kept = [node for node in path if node < self.length - start]  # the nodes this cache holds
        if kept != list(range(len(kept))):
            first = start - self.dropped  # the first node's slot
            sources = torch.tensor([first + node for node in kept]).to(self.layout.device, non_blocking=True)
            for buffer in (self.keys, self.values):
                buffer[:, :, :, first : first + len(kept)] = buffer[:, :, :, sources]
        self.rollback(start + len(kept))

    def plain_pass(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        return self._plain_slots() if type(self).update is SlotCache.update else None

    def _plain_slots(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """``plain_pass`` as far as this class's ``update`` goes: an eager pass that is no token tree
        and keeps no queries."""
        plain = not (self._static or self._tree is not None or self._keeping_queries)
        return (self.keys, self.values, self._start) if plain else None

    def update(self, layer: int, keys, values, query) -> AttentionView:
        if self._keeping_queries:
            self._keep_query(layer, query)
        if self._static:
            return self._static_update(layer, keys, values)
        end = self.used_slots
        self.keys[layer, :, :, self._start : end] = keys
        self.values[layer, :, :, self._start : end] = values
        keys, values = self.keys[layer, :, :, :end], self.values[layer, :, :, :end]
        if self._tree is None:
            return AttentionView(keys, values, None, end - self._start > 1)
        if layer == 0:
            self._mask = tree_mask(self._as_tensor(range(self._start, end)), end, self._tree, self.layout.dtype)
        tree_rows, nodes = self._tree.shape
        return AttentionView(keys, values, self._mask, masked_tail=end - self._start + nodes - tree_rows)

    def _keep_query(self, layer: int, query: torch.Tensor) -> None:
        """Keep query [B, H, T, D]'s last token as ``last_queries[layer]``; the last layer ends the pass's."""
        if self.last_queries is None:
            num_layers, (num_heads, head_dim) = self.layout.num_layers, (query.shape[1], query.shape[3])
            self.last_queries = query.new_empty(num_layers, num_heads, head_dim)  # [L, H, D]
        self.last_queries[layer] = query[0, :, -1]
        if layer == self.layout.num_layers - 1:
            self._keeping_queries, self.last_queries_at = False, self.length - 1

    def _static_update(self, layer: int, keys: torch.Tensor, values: torch.Tensor) -> AttentionView:
        """``update`` for a static pass: keys/values [B, H_kv, T, D] go to the slots of the device
        index; the view is the whole buffer [B, H_kv, buffer, D] under a [T, buffer] mask."""
        slots, buffer = self._pass_slots, self.keys.shape[3]  # [T]
        if layer == 0:
            tree = self._tree
            self._mask = (
                causal_mask(slots, buffer, self.layout.dtype)
                if tree is None
                else tree_mask(slots, buffer, tree, self.layout.dtype)
            )
        self.keys[layer].index_copy_(2, slots, keys)
        self.values[layer].index_copy_(2, slots, values)
        valid = self._valid_slots if self._tree is None else None  # a tree's mask is not causal
        return AttentionView(self.keys[layer], self.values[layer], self._mask, static=True, valid_lengths=valid)

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


def tree_mask(query_slots: torch.Tensor, num_keys: int, ancestry: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[T, S] additive mask of a pass whose last T_tree queries are token-tree nodes: ``causal_mask``,
    with each node's row over the tree's N slots (ending at the pass's last) set by ``ancestry``
    [T_tree, N] (see ``TreePass``). Built on the device from ``query_slots`` [T]."""
    mask = causal_mask(query_slots, num_keys, dtype)
    tree_rows, nodes = ancestry.shape
    first_node = query_slots[-tree_rows:][:1] - (nodes - tree_rows)  # [1] the tree's first slot
    node_slots = first_node + torch.arange(nodes, device=query_slots.device)  # [N]
    hidden = torch.zeros(ancestry.shape, dtype=dtype, device=ancestry.device).masked_fill(~ancestry, float("-inf"))
    mask[-tree_rows:].index_copy_(1, node_slots, hidden)
    return mask
