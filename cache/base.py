"""The cache-policy protocol: one policy owns the KV layout of one model for one stage.

A forward pass over ``T`` new tokens talks to its policy in three steps:

1. ``allocate(T)`` reserves slots for the new tokens and returns their rotary positions;
2. each layer calls ``update(layer, keys, values, query)`` to write its new K/V and gets back an
   :class:`AttentionView` of what attention must read (keys, values and, when needed, a mask);
   policies that choose what to keep by attention scores (H2O, top-k) score with the query;
3. the caller later ``commit``s the tokens it keeps or ``rollback``s the ones it rejects.

``restart`` empties a policy for the next sequence without giving up its buffers.

Models never know which policy they run under; rollback is a pointer move, never a copy.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Hashable
from dataclasses import dataclass

import torch

from cascade.rope import Rotary


@dataclass(frozen=True)
class CacheLayout:
    """Shape of the KV a model produces; every policy is built from one."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    capacity: int
    """Most tokens the policy must be able to hold at once (prompt + generation + speculation)."""
    dtype: torch.dtype
    device: torch.device
    rotary: Rotary | None = None
    """The model's rotary embedding, for policies that move keys to new positions."""
    max_pending: int | None = None
    """Most tokens written between two commits (a prefill chunk or one speculation round);
    None means up to ``capacity``. Policies that evict on commit keep this much spare room."""

    @property
    def bytes_per_token(self) -> int:
        """K and V bytes one token occupies across all layers."""
        itemsize = torch.empty((), dtype=self.dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * itemsize


@dataclass(frozen=True)
class AttentionView:
    """What one layer's attention reads for the current forward pass."""

    keys: torch.Tensor  # [B, H_kv, S, D]
    values: torch.Tensor  # [B, H_kv, S, D]
    mask: torch.Tensor | None
    """[T, S] additive, in the KV dtype: 0 where query t may read key s, -inf where it may not.
    None for a causal view and when every query reads every key."""
    causal: bool = False
    """True when the pass's T tokens are the view's last T keys and read one another causally
    (bottom-right aligned), every earlier key visible to all. Such a view carries no mask: each
    kernel applies the causality its own way (a causal mode, or a mask over just the last T keys),
    so a long prefill chunk never builds a [T, S] mask."""
    static: bool = False
    """True for a static pass's view (see ``SlotCache.set_static``): keys and values are the whole
    slot buffer and ``mask`` [T, buffer] hides every slot a query must not read, so the view's
    shapes and addresses are the same at every pass of its width and a kernel compiled for them
    once serves them all."""
    valid_lengths: torch.Tensor | None = None
    """[B] int32, set for a static pass's causal view: of the whole buffer the first
    ``valid_lengths`` slots hold this pass's tokens and everything before them (``mask`` hides the
    rest), so a kernel that takes cache lengths (flash-attn's kvcache kernel) can read just those.
    None for a token tree's static view, whose mask is not causal."""
    masked_tail: int = 0
    """For an eager token-tree pass (see ``TreePass``): only the view's last ``masked_tail`` keys
    (the pass's tokens and the tree's earlier nodes) are masked, every earlier key is read by every
    query (``mask``'s columns before them are zeros), so a kernel need add only the mask's last
    ``masked_tail`` columns. 0 when the mask may hide any key."""


@dataclass(frozen=True)
class TreePass:
    """The last ``len(depths)`` tokens of a pass are nodes of a token tree (``cascade.tree``): each
    reads the sequence before the tree and, of the tree's nodes, only its ancestors and itself.
    The tree's nodes are written in consecutive slots after its root, this pass's last."""

    depths: torch.Tensor
    """[T_tree] int64 on the cache's device: each node's depth below the root (1 for its children),
    which sets its rotary position."""
    ancestry: torch.Tensor
    """[T_tree, N] bool on the cache's device: which of the tree's N nodes written so far (this
    pass's are the last T_tree) each node reads."""

    @property
    def earlier_nodes(self) -> int:
        """Nodes of the tree earlier passes wrote."""
        return self.ancestry.shape[1] - self.ancestry.shape[0]


class CacheFullError(RuntimeError):
    """Raised when a policy is asked to hold more tokens than its layout's capacity."""


class CachePolicy(ABC):
    """Base class of every KV cache policy (see the module docstring for the protocol)."""

    reads_source = False
    """True for policies built from another stage's full cache of the same model (``source``)."""
    tree_passes = False
    """True for policies that can run a pass over token-tree nodes (``allocate_tree``)."""
    static_passes = False
    """True for policies that can run passes with state-independent shapes and tensor addresses
    (``set_static``), which lets a pass be captured once as a graph and replayed."""

    def __init__(self, layout: CacheLayout, source: CachePolicy | None = None) -> None:
        """``source``: another stage's cache of the same model whose KV this policy may read
        instead of holding its own copy (e.g. retrieval reading the full cache's prompt)."""
        self.layout = layout
        self.source = source
        self.length = 0
        """Tokens written so far, speculative ones included."""
        self.committed = 0
        """Tokens the pipeline has accepted for good; ``rollback`` never goes below this."""

    @abstractmethod
    def allocate(self, num_new: int) -> torch.Tensor:
        """Reserve slots for ``num_new`` tokens; returns their rotary positions, [T] int64."""

    def allocate_tree(self, num_new: int, tree: TreePass) -> torch.Tensor:
        """``allocate`` for a pass whose last tokens are the nodes of ``tree``; returns the rotary
        positions, each node's its root's plus its depth."""
        raise NotImplementedError(f"{type(self).__name__} cannot run token-tree passes")

    def keep_path(self, start: int, path: list[int]) -> None:
        """Of the tree nodes held after the first ``start`` tokens (breadth-first), keep those of
        ``path`` (a path down from the root) as the tokens after ``start``; forget the rest."""
        raise NotImplementedError(f"{type(self).__name__} cannot run token-tree passes")

    @abstractmethod
    def update(self, layer: int, keys: torch.Tensor, values: torch.Tensor, query: torch.Tensor) -> AttentionView:
        """Write one layer's new keys/values ([B, H_kv, T, D], rotated) and return what to read.

        ``query`` [B, H, T, D] (rotated) is the layer's query for the same tokens."""

    @abstractmethod
    def memory_bytes(self) -> int:
        """Bytes of KV storage this policy holds (allocated, not just used)."""

    @abstractmethod
    def read_bytes(self) -> int:
        """KV bytes one single-token decode step reads at the current length."""

    def commit(self, length: int) -> None:
        """Accept the first ``length`` tokens for good (policies may evict here)."""
        if not self.committed <= length <= self.length:
            raise ValueError(f"commit({length}) outside [{self.committed}, {self.length}]")
        self.committed = length

    def keep_last_queries(self) -> None:
        """Keep each layer's query of the next pass's last token, for policies that read this one
        (a prefill marks its last pass so); policies no other reads ignore it."""

    def plain_pass(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        """For the pass just allocated: (keys, values [L, B, H_kv, slots, D], its first slot) when each
        layer's ``update`` would only write the pass's K/V at consecutive slots from there and return
        a view of every slot up to its last, causal among the pass: a kernel may then do that itself,
        for every layer in one call. None (the default) when ``update`` does more."""
        return None

    def adopt(self, length: int) -> int:
        """Hold, of the first ``length`` sequence tokens, those after what it holds that it can take
        from its source without a pass (a policy that would replace its own K/V of them with the
        source's anyway); returns the tokens it now holds. Most policies take none."""
        return self.length

    def unfed_prompt(self, length: int) -> range:
        """Of a prompt of ``length`` tokens, those a prefill may leave out, passing ``skip`` their
        count instead: tokens this policy would have evicted before the prompt ends. The tokens it
        keeps are then computed from less context, so only a proposing stage's policy may offer
        this. Most policies need every token fed."""
        return range(0)

    def skip(self, count: int) -> None:
        """Count the next ``count`` tokens (of ``unfed_prompt``) as seen and evicted, unwritten."""
        if count:
            raise NotImplementedError(f"{type(self).__name__} holds every prompt token it is given")

    def rollback(self, length: int) -> None:
        """Forget every token after the first ``length``, as if they were never written."""
        if not self.committed <= length <= self.length:
            raise ValueError(f"rollback({length}) outside [{self.committed}, {self.length}]")
        self.length = length

    def restart(self) -> None:
        """Empty the cache for a new sequence, keeping its buffers: the next request of a runtime
        reuses them (and every graph captured over them) instead of allocating its own."""
        self.length = self.committed = 0

    @property
    def graph_ready(self) -> bool:
        """False while the next pass must run eagerly (e.g. a pending chunk selection)."""
        return self.static_passes

    @property
    def pass_variant(self) -> Hashable:
        """What the pass just allocated runs besides its shape's usual ops, or None: passes of one
        shape and different variants are captured as different graphs. A variant is only valid
        while this cache holds its current prompt (graphs of earlier variants are dropped)."""
        return None

    def set_static(self, static: bool) -> None:
        """Make the next passes static (see ``static_passes``); only policies that support it."""
        if static:
            raise NotImplementedError(f"{type(self).__name__} has no static passes")

    def observe_acceptance(self, proposed: int, accepted: int) -> None:
        """The stage above verified ``proposed`` tokens this cache's stage proposed and kept
        ``accepted``; policies that refresh on an acceptance drop listen here."""

    def _reserve(self, num_new: int) -> int:
        """Advance ``length`` by ``num_new`` within capacity; returns the first new slot."""
        if num_new < 1:
            raise ValueError(f"allocate needs at least one token, got {num_new}")
        if self.length + num_new > self.layout.capacity:
            raise CacheFullError(
                f"cache holds {self.length} of {self.layout.capacity} tokens; cannot add {num_new} more"
            )
        start = self.length
        self.length += num_new
        return start
