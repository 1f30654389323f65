"""Token trees: what the lowest stage proposes when one verification pass should test several
continuations at once (SpecInfer, Sequoia).

A tree hangs below the root, the last token of the context. Each node is one of its parent's most
likely next tokens under the proposing stage, named by its ``rank`` there (0: the argmax), so a
tree's shape is fixed ahead of time and every level is one proposing pass of a known width. The
verifying stage reads the whole tree in one pass, each node attending to the context and its own
ancestors, and follows the path its own choices take: the tokens it emits are exactly those it
would emit alone, whatever the tree.

The shape comes from how often the verifier's token is the proposer's rank-r token
(``rank_acceptance``): assuming that does not depend on the position, a node's chance of being
reached is the product of its path's rank acceptances, and the tree of n nodes that reaches the
most tokens in expectation takes the n nodes of highest such chance (Sequoia's construction;
those always form a tree, as a node's chance is below its parent's and its elder sibling's).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property

import torch

from cache.base import TreePass

ROOT = -1
"""The parent index of the root's children."""
RANKS_SEEN = 8
"""How many of the proposer's most likely tokens the rank statistics tell apart (``choice_ranks``)."""


@dataclass(frozen=True)
class TokenTree:
    """Nodes in breadth-first order (a shape built here: by depth, then by parent, then by rank)."""

    parents: tuple[int, ...]
    """Each node's parent node, or ``ROOT``."""
    ranks: tuple[int, ...]
    """Each node's rank among its parent's proposed next tokens (0: the most likely)."""

    @classmethod
    def chain(cls, depth: int) -> TokenTree:
        """``depth`` argmax proposals in a row: plain speculative decoding's proposal."""
        return cls(tuple(range(-1, depth - 1)), (0,) * depth)

    @classmethod
    def best_first(cls, rank_acceptance: Sequence[float], nodes: int, depth: int) -> TokenTree:
        """The tree of at most ``nodes`` nodes and ``depth`` levels with the most tokens accepted in
        expectation when the verifier's token is the proposer's rank-r one with probability
        ``rank_acceptance[r]`` at every node."""
        found: list[tuple[float, int, int, int]] = []  # (chance, parent, rank, depth), parents by finding order
        frontier = [(-rank_acceptance[0], ROOT, 0, 1)]
        while frontier and len(found) < nodes:
            negative_chance, parent, rank, level = heapq.heappop(frontier)
            found.append((-negative_chance, parent, rank, level))
            chance, node = -negative_chance, len(found) - 1
            if rank + 1 < len(rank_acceptance):  # the next sibling
                parent_chance = found[parent][0] if parent != ROOT else 1.0
                heapq.heappush(frontier, (-parent_chance * rank_acceptance[rank + 1], parent, rank + 1, level))
            if level < depth:  # the first child
                heapq.heappush(frontier, (-chance * rank_acceptance[0], node, 0, level + 1))
        return cls._breadth_first([(parent, rank, level) for _, parent, rank, level in found])

    @classmethod
    def _breadth_first(cls, found: list[tuple[int, int, int]]) -> TokenTree:
        """Nodes given as (parent in this list, rank, depth) -> the tree in breadth-first order."""
        keys: list[tuple[int, ...]] = []  # each node's ranks from the root: sorts breadth-first
        for parent, rank, _ in found:
            keys.append((keys[parent] if parent != ROOT else ()) + (rank,))
        order = sorted(range(len(found)), key=lambda node: (len(keys[node]), keys[node]))
        position = {node: index for index, node in enumerate(order)}
        parents = tuple(ROOT if found[node][0] == ROOT else position[found[node][0]] for node in order)
        return cls(parents, tuple(found[node][1] for node in order))

    def __len__(self) -> int:
        return len(self.parents)

    @cached_property
    def depths(self) -> tuple[int, ...]:
        """Each node's depth (1 for the root's children)."""
        depths: list[int] = []
        for parent in self.parents:
            depths.append(1 if parent == ROOT else depths[parent] + 1)
        return tuple(depths)

    @property
    def depth(self) -> int:
        return max(self.depths, default=0)

    def up_to(self, depth: int) -> TokenTree:
        """The nodes of depth at most ``depth`` (a breadth-first prefix)."""
        count = sum(node_depth <= depth for node_depth in self.depths)
        return TokenTree(self.parents[:count], self.ranks[:count])

    def level(self, depth: int) -> range:
        """The nodes at ``depth``."""
        return range(self.depths.index(depth), len(self.depths) - self.depths[::-1].index(depth))

    def tree_pass(self, device: torch.device, depth: int | None = None) -> TreePass:
        """The pass over the nodes at ``depth`` after the earlier levels, or over every node."""
        nodes = self.level(depth) if depth else range(len(self))
        depths = torch.tensor(self.depths[nodes.start : nodes.stop], device=device)
        return TreePass(depths, self.ancestry[nodes.start : nodes.stop, : nodes.stop].to(device))

    @cached_property
    def ancestry(self) -> torch.Tensor:
        """[N, N] bool: node i reads node j (j is i or one of its ancestors)."""
        reads = torch.eye(len(self), dtype=torch.bool)
        for node, parent in enumerate(self.parents):
            if parent != ROOT:
                reads[node] |= reads[parent]
        return reads

    def expected_accepted(self, rank_acceptance: Sequence[float]) -> float:
        """Tokens of the tree accepted per round in expectation under ``rank_acceptance``."""
        chances: list[float] = []
        for parent, rank in zip(self.parents, self.ranks, strict=True):
            chances.append((chances[parent] if parent != ROOT else 1.0) * rank_acceptance[rank])
        return sum(chances)

    def follow(self, node_tokens: Sequence[int], choices: Sequence[int]) -> tuple[list[int], int]:
        """The verifier's walk down the tree: ``node_tokens`` [N] are the nodes' tokens and
        ``choices`` [N + 1] the verifier's token after the root and after each node. Returns the
        nodes it accepts (a path from the root) and the token it emits after the last of them."""
        path, node = [], ROOT
        while True:
            choice = choices[node + 1]
            child = next((child for child in self._children[node] if node_tokens[child] == choice), None)
            if child is None:
                return path, choice
            path.append(child)
            node = child

    @cached_property
    def _children(self) -> dict[int, list[int]]:
        children: dict[int, list[int]] = {ROOT: []} | {node: [] for node in range(len(self))}
        for node, parent in enumerate(self.parents):
            children[parent].append(node)
        return children


@dataclass(frozen=True)
class TreeLevel:
    """One level of a tree's shape as the proposing stage grows it, on its device."""

    parent_rows: torch.Tensor
    """[W] int64: each node's parent's row among the previous pass's logits (a fixed shape's)."""
    ranks: torch.Tensor
    """[W] int64: each node's rank among its parent's next tokens (a fixed shape's)."""
    width: int
    """How many of each parent's most likely tokens the level draws from (a fixed shape's)."""
    depths: torch.Tensor
    """[W] int64: the level's depth, once per node."""
    first: int
    """The level's first node."""


class TreePlan:
    """A tree shape's tensors on one device, level by level."""

    def __init__(self, tree: TokenTree, device: torch.device) -> None:
        self.levels = []
        for depth in range(1, tree.depth + 1):
            nodes = tree.level(depth)
            previous = tree.level(depth - 1).start if depth > 1 else ROOT  # row 0 of the last pass's logits
            parent_rows = [parent - previous for parent in tree.parents[nodes.start : nodes.stop]]
            ranks = tree.ranks[nodes.start : nodes.stop]
            self.levels.append(
                TreeLevel(
                    torch.tensor(parent_rows, device=device),
                    torch.tensor(ranks, device=device),
                    max(ranks) + 1,
                    torch.full((len(nodes),), depth, device=device),
                    nodes.start,
                )
            )


class TreeGrowth:
    """One round's tree as the proposing stage grows it, a level per pass, without reading the
    device. With ``dynamic`` each level keeps its width but its nodes are the most likely
    continuations by the proposer's path probabilities (EAGLE-2) instead of the shape's fixed ranks."""

    def __init__(self, plan: TreePlan, dynamic: bool, device: torch.device) -> None:
        self.plan, self.dynamic = plan, dynamic
        self.tokens: list[torch.Tensor] = []  # per level [W] int64
        self.parents: list[torch.Tensor] = []  # per level [W] int64, ROOT for the root's children
        self.ranks: list[torch.Tensor] = []  # per level [W] int64
        self.reads: list[torch.Tensor] = []  # per level [W, nodes up to it] bool: each node's ancestry
        self.ranked: list[torch.Tensor] = []  # per pass [rows, K]: the proposer's most likely tokens
        self._scores = torch.zeros(1, device=device)  # [rows] log-probability of each fed row's path
        self._last_reads = torch.zeros(1, 0, dtype=torch.bool, device=device)  # [rows, nodes so far]

    def grow(self, level: TreeLevel, logits: torch.Tensor) -> TreePass:
        """Add ``level``'s nodes below the rows of ``logits`` [rows, V] (the last level's nodes, or
        the root) -> the pass that feeds them to the proposer."""
        width = len(level.depths)
        draws = width if self.dynamic else level.width
        best = logits.topk(min(max(draws, RANKS_SEEN), logits.shape[-1]), dim=-1)  # [rows, K]
        self.ranked.append(best.indices[:, :RANKS_SEEN])
        if self.dynamic:
            log_probs = best.values[:, :draws].float() - logits.float().logsumexp(-1, keepdim=True)  # [rows, K]
            paths = (self._scores[:, None] + log_probs).flatten().topk(width)  # [W]
            rows, ranks, self._scores = paths.indices // draws, paths.indices % draws, paths.values
        else:
            rows, ranks = level.parent_rows, level.ranks
        self.tokens.append(best.indices[rows, ranks])
        self.ranks.append(ranks)
        previous = self.plan.levels[len(self.parents) - 1].first if self.parents else None  # the rows' first node
        self.parents.append(torch.full_like(rows, ROOT) if previous is None else rows + previous)
        eye = torch.eye(width, dtype=torch.bool, device=logits.device)
        self._last_reads = torch.cat([self._last_reads[rows], eye], dim=1)  # [W, nodes up to this level]
        self.reads.append(self._last_reads)
        return TreePass(level.depths, self._last_reads)

    def whole(self) -> TreePass:
        """The verifier's pass over every node grown (the plan's levels, or its first ones)."""
        nodes = sum(len(tokens) for tokens in self.tokens)
        reads = torch.cat([torch.nn.functional.pad(rows, (0, nodes - rows.shape[1])) for rows in self.reads])
        depths = [level.depths for level in self.plan.levels[: len(self.tokens)]]
        return TreePass(torch.cat(depths), reads)  # [N], [N, N]


def choice_ranks(ranked: torch.Tensor, choices: torch.Tensor) -> torch.Tensor:
    """The rank of each of the verifier's ``choices`` [R] among the proposer's most likely tokens at
    the same node, ``ranked`` [R, K] -> [R] int64 (K where it is none of them)."""
    matches = ranked == choices[:, None]  # [R, K]: at most one True per row
    return torch.where(matches.any(-1), matches.long().argmax(-1), ranked.shape[1])
