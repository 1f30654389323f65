"""Graphs of a stage's short passes: decode steps, proposals and verifications.

At this project's model sizes a short pass is hundreds of small kernels, and on a GPU launching
them costs more than running them (the draft and retrieval stages are launch-bound). A pass
whose shapes and tensor addresses never change can be captured once and replayed: the cache runs
it statically (``SlotCache.set_static``: slot indices in a device tensor, the whole buffer read
under a mask), the token ids and positions are copied into fixed input tensors, and all that
depends on the cache's state on the host (allocation, commits, eviction, whether a pass selects
chunks) stays outside the graph. One graph per pass shape (tokens, logits, token-tree nodes and
their ancestry's shape) and cache variant (a retrieval cache's selecting pass runs more ops than
its other passes), captured on first use; a tree's ancestry is copied into a buffer of its shape.

``cuda_graph`` captures with ``torch.cuda.CUDAGraph``. Any other capture can stand in for it:
the tests capture with ``torch.compile(fullgraph=True, dynamic=False)``, which fails on a graph
break or a host sync and compiles again if a pass depended on a host value that changed, so a
CPU run checks what a CUDA graph would silently get wrong.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable

import torch

from cache.base import CachePolicy, TreePass
from cascade.model import CausalLM

MAX_GRAPH_TOKENS = 16
"""Passes of up to this many tokens are graphed (proposals and verification up to gamma 15), and
token-tree passes of any width (at most 64 nodes, a few shapes per tree); prefill chunks and long
catch-ups run eagerly."""

GraphKey = tuple[int, int | None, Hashable, tuple[int, int] | None]
Replay = Callable[[], torch.Tensor]
Capture = Callable[[Replay], Replay]
"""Turns a pass over fixed input tensors into a replay of it that returns its output tensor."""


def cuda_graph(run: Replay) -> Replay:
    """Capture ``run`` as a CUDA graph, after one warm-up run on a side stream (lazy
    initialisation in cuBLAS and flash-attn must not happen during capture)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        run()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        output = run()

    def replay() -> torch.Tensor:
        graph.replay()
        return output

    return replay


class PassGraphs:
    """Runs a model's passes over one cache, short ones as captured graphs."""

    def __init__(self, model: CausalLM, cache: CachePolicy, capture: Capture) -> None:
        if not cache.static_passes:
            raise ValueError(f"{type(cache).__name__} has no static passes to capture")
        self.model, self.cache, self.capture = model, cache, capture
        self.graphs: dict[GraphKey, tuple[Replay, torch.Tensor, torch.Tensor]] = {}
        """Per (tokens, logits, the cache's pass variant, tree ancestry shape or None): the replay
        and its token-id [1, T] and position [T] inputs."""

    @torch.inference_mode()
    def __call__(self, token_ids: torch.Tensor, num_logits: int | None, tree: TreePass | None = None) -> torch.Tensor:
        """token_ids [1, T] -> logits [1, N, V], as ``CausalLM.forward`` computes them."""
        num_tokens = token_ids.shape[1]
        static = (num_tokens <= MAX_GRAPH_TOKENS or tree is not None) and self.cache.graph_ready
        self.cache.set_static(static)
        positions = self.cache.allocate(num_tokens) if tree is None else self.cache.allocate_tree(num_tokens, tree)
        if not static:
            return self.model.forward_at(token_ids, positions, self.cache, num_logits)
        key = (num_tokens, num_logits, self.cache.pass_variant, None if tree is None else tuple(tree.ancestry.shape))
        if key not in self.graphs:
            self._drop_stale_variants(key[2])
            self.graphs[key] = self._capture(token_ids, positions, num_logits)
        replay, static_ids, static_positions = self.graphs[key]
        static_ids.copy_(token_ids)
        static_positions.copy_(positions)
        return replay().clone()  # the graph's output tensor is overwritten by its next replay

    def _drop_stale_variants(self, variant: Hashable) -> None:
        """A cache has one valid variant besides None at a time (see ``CachePolicy.pass_variant``)."""
        if variant is not None:
            self.graphs = {key: graph for key, graph in self.graphs.items() if key[2] in (None, variant)}

    def _capture(self, token_ids: torch.Tensor, positions: torch.Tensor, num_logits: int | None):
        static_ids, static_positions = token_ids.clone(), positions.clone()

        def run() -> torch.Tensor:
            return self.model.forward_at(static_ids, static_positions, self.cache, num_logits)

        return self.capture(run), static_ids, static_positions
