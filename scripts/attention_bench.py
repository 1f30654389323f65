"""One layer's attention for the passes a cascade runs, kernel by kernel.

Passes in one model's attention shape (``--shape``: SmolLM2's 9 query heads sharing 3 KV heads of
64 dimensions by default; Qwen2.5-Coder 1.5B's 12 sharing 2 of 128, or the 0.5B's 14 sharing 2 of
64), bf16, random keys and values, each over S keys of which its own tokens are the last:

- ``--queries T``: a causal pass of T tokens (1: a decode step or proposal; 7: the verification
  of 6 proposals);
- ``--nodes N``: the verification of a token tree of N nodes (N + 1 queries: the root and the
  nodes), under the mask its ancestry gives.

``--layers N`` gives each pass N layers' keys and values (random, each its own) and times it over
all of them in turn, as a model's pass reads them: from memory, not from the caches a single layer's
repeated call leaves them in (ms reported per layer). ``--static`` builds each view as a graphed
pass reads it (every pass on a GPU with CUDA graphs): the whole slot buffer under a [T, buffer]
mask; without it, as an eager pass does (the valid keys, causal or masked only in its tail). Each
kernel is timed side by side in one run (median of ``--repeats``; on CUDA each call is captured as a
CUDA graph and replayed, as graphed passes run) and checked against a float64 reference (largest absolute difference):

- ``cpu`` / ``sdpa`` / ``cuda`` / ``flash`` / ``flex``: the attention families as configs pick them
  (the ones that can run on the device);
- ``grouped_sdpa``: SDPA with each KV head's query group folded into rows, which the ``cpu``
  family ran tree passes of 9-64 queries through before they went to per-KV-head products;
- ``kernel`` (CPU, where cascade's kernels build): what a model's pass runs there, cascade's
  attention kernel for bf16 causal and token-tree views of up to 16 tokens (``fused.attend``), the
  ``cpu`` family for the rest (static views, wider passes).

    python scripts/attention_bench.py [--keys 4096 32768 120000] [--queries 1 7] [--nodes 15 31 63]
        [--shape smollm2] [--layers 1] [--kernels cpu kernel] [--static] [--repeats 10] [--device cpu]
        [--out FILE]
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import NamedTuple

import torch

from cache.base import AttentionView
from cache.slots import SLOT_ALIGNMENT, causal_mask, tree_mask
from cascade import attention, fused
from cascade.errors import CascadeError
from cascade.graphs import cuda_graph
from cascade.limits import median_seconds
from cascade.logs import show_logs
from cascade.runs import run_files
from cascade.tree import TokenTree


class Shape(NamedTuple):
    heads: int
    kv_heads: int
    head_dim: int


SHAPES = {
    "smollm2": Shape(9, 3, 64),
    "qwen2.5-1.5b": Shape(12, 2, 128),
    "qwen2.5-0.5b": Shape(14, 2, 64),
}
RANK_ACCEPTANCE = (0.67, 0.12, 0.06, 0.04)
"""The trees' shape: the default ``rank_acceptance``, at most 6 levels deep (gamma 6)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python scripts/attention_bench.py", description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[4096, 32768, 120000])
    parser.add_argument("--queries", type=int, nargs="*", default=[], help="causal passes of these many tokens")
    parser.add_argument("--nodes", type=int, nargs="*", default=[15, 31, 63], help="token trees of these many nodes")
    parser.add_argument("--shape", choices=SHAPES, default="smollm2", help="the model whose attention heads to take")
    parser.add_argument("--static", action="store_true", help="views as graphed passes read them (whole buffers)")
    parser.add_argument(
        "--layers", type=int, default=1, help="layers' K/V each pass reads in turn (from memory, as a model's pass)"
    )
    parser.add_argument("--kernels", nargs="+", metavar="NAME", help="time only these (default: every one that runs)")
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--out",
        type=Path,
        help="report path (default: attention.json in a new run directory under "
        "$CASCADE_HOME/runs/attention_bench/); a manifest is written beside it",
    )
    args = parser.parse_args(argv)
    if not args.queries and not args.nodes:
        parser.error("name at least one pass: --queries T or --nodes N")
    if args.layers < 1:
        parser.error(f"--layers must be at least 1, got {args.layers}")
    widest = max([*args.queries, *(nodes + 1 for nodes in args.nodes)])
    if min(args.keys) <= widest:
        parser.error(f"--keys must exceed the widest pass ({widest} tokens)")
    return args


def pass_view(
    shape: Shape,
    num_keys: int,
    num_queries: int,
    tree: TokenTree | None,
    static: bool,
    device: torch.device,
    layer: int = 0,
) -> tuple[torch.Tensor, AttentionView]:
    """Random query [1, H, T, D] and the view of a pass whose T tokens are the last of ``num_keys``:
    causal among themselves, or the root and the nodes of ``tree``; each ``layer`` draws its own."""
    generator = torch.Generator().manual_seed(num_keys + num_queries + 7919 * layer)
    buffer = -(-num_keys // SLOT_ALIGNMENT) * SLOT_ALIGNMENT if static else num_keys
    query = torch.randn(1, shape.heads, num_queries, shape.head_dim, generator=generator)
    keys, values = torch.randn(2, 1, shape.kv_heads, buffer, shape.head_dim, generator=generator)
    query, keys, values = (x.to(device=device, dtype=torch.bfloat16) for x in (query, keys, values))
    slots = torch.arange(num_keys - num_queries, num_keys, device=device)  # [T]
    if tree is not None:
        mask = tree_mask(slots, buffer, tree.ancestry.to(device), torch.bfloat16)  # [T, S]
        return query, AttentionView(keys, values, mask, static=static, masked_tail=0 if static else num_queries)
    if static:
        valid = torch.tensor([num_keys], dtype=torch.int32, device=device)
        return query, AttentionView(
            keys, values, causal_mask(slots, buffer, torch.bfloat16), static=True, valid_lengths=valid
        )
    return query, AttentionView(keys, values, None, causal=num_queries > 1)


def reference(query: torch.Tensor, view: AttentionView, scale: float) -> torch.Tensor:
    """float64 attention [1, H, T, D] under the view's whole mask (a causal view's built here)."""
    group = query.shape[1] // view.keys.shape[1]
    keys, values = (x.double().repeat_interleave(group, 1) for x in (view.keys, view.values))  # [1, H, S, D]
    num_queries, num_keys = query.shape[2], keys.shape[2]
    mask = view.mask
    if mask is None:
        mask = causal_mask(torch.arange(num_keys - num_queries, num_keys, device=query.device), num_keys, torch.float64)
    scores = query.double() @ keys.transpose(-1, -2) * scale + mask.double()  # [1, H, T, S]
    return scores.softmax(-1) @ values


def kernels_for(device: torch.device, names: list[str] | None) -> dict[str, attention.AttentionKernel]:
    """The kernels that run on ``device``, all of them or those ``names`` asks for."""
    runnable = {}
    for family, kernel in attention.KERNELS.items():
        try:
            attention.resolve_kernels(family, device)
        except CascadeError:
            continue
        runnable[family] = kernel
    runnable["grouped_sdpa"] = attention._grouped_sdpa
    if device.type == "cpu" and fused.use_cpu_kernels() and fused.attention_kernel:
        runnable["kernel"] = lambda query, view, scale: fused.attend(query, view, scale, attention.attend_cpu)
    unknown = sorted(set(names or []) - set(runnable))
    if unknown:
        raise SystemExit(f"--kernels: {', '.join(unknown)} cannot run here; these can: {', '.join(runnable)}")
    return {name: kernel for name, kernel in runnable.items() if names is None or name in names}


def passes(args: argparse.Namespace) -> list[tuple[str, int, TokenTree | None]]:
    """(name, queries, tree or None) of every pass the arguments name."""
    causal = [(f"{queries} causal", queries, None) for queries in args.queries]
    trees = [
        (f"tree {nodes}", nodes + 1, TokenTree.best_first(RANK_ACCEPTANCE, nodes, depth=6)) for nodes in args.nodes
    ]
    return causal + trees


def timed(
    kernel: attention.AttentionKernel,
    query: torch.Tensor,
    views: list[AttentionView],
    scale: float,
    repeats: int,
    device: torch.device,
) -> tuple[float, torch.Tensor]:
    """Median seconds of one call per layer (the pass over every layer's view in turn; on CUDA a replay
    of it captured as a graph) and the first layer's output."""

    def call() -> torch.Tensor:
        outs = [kernel(query, view, scale) for view in views]
        return outs[0]

    run = cuda_graph(call) if device.type == "cuda" else call
    return median_seconds(run, repeats, device) / len(views), run()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    show_logs()
    files = run_files("attention_bench", args.out, "attention.json")
    shape = SHAPES[args.shape]
    device, scale = torch.device(args.device), shape.head_dim**-0.5
    kernels = kernels_for(device, args.kernels)
    print("| keys | pass | " + " | ".join(f"{name} ms (max error)" for name in kernels) + " |")
    print("|---:|---|" + "---:|" * len(kernels))
    rows = []
    for num_keys in args.keys:
        for name, num_queries, tree in passes(args):
            query, view = pass_view(shape, num_keys, num_queries, tree, args.static, device)
            views = [view] + [
                pass_view(shape, num_keys, num_queries, tree, args.static, device, layer)[1]
                for layer in range(1, args.layers)
            ]
            expected = reference(query, view, scale)
            row = {
                "keys": num_keys,
                "pass": name,
                "queries": num_queries,
                "nodes": len(tree) if tree else None,
                "kv_bytes": 2 * shape.kv_heads * num_keys * shape.head_dim * 2,
                "ms": {},
                "max_error": {},
            }
            for kernel_name, kernel in kernels.items():
                seconds, out = timed(kernel, query, views, scale, args.repeats, device)
                row["ms"][kernel_name] = 1e3 * seconds
                row["max_error"][kernel_name] = (out.double() - expected).abs().max().item()
            rows.append(row)
            print(
                f"| {num_keys} | {name} | "
                + " | ".join(f"{row['ms'][k]:.2f} ({row['max_error'][k]:.1e})" for k in kernels)
                + " |",
                flush=True,
            )
    report = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
        "shape": shape._asdict(),
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "static": args.static,
        "layers": args.layers,
        "rows": rows,
    }
    files.write(report, vars(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
