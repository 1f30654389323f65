"""One layer's attention for a token-tree verification pass, kernel by kernel.

The pass is what the verifier runs over a tree of N nodes (N + 1 queries: the root and the nodes)
after S - N - 1 context keys, in SmolLM2's attention shape (9 query heads sharing 3 KV heads of
64 dimensions), bf16, random keys and values under the mask a tree's ancestry gives. Each kernel
is timed side by side in one run (median of ``--repeats``) and checked against a float64
reference (largest absolute difference):

- ``cpu`` / ``sdpa`` / ``cuda`` / ``flash``: the attention families as configs pick them (the
  ones that can run on the device);
- ``grouped_sdpa``: SDPA with each KV head's query group folded into rows, which the ``cpu``
  family ran tree passes of 9-64 queries through before they went to per-KV-head products.

    python scripts/attention_bench.py [--keys 4096 32768 120000] [--nodes 15 31 63] [--repeats 10]
        [--device cpu] [--out results/attention_tree_cpu.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
from roofline import median_seconds

from cache.base import AttentionView
from cache.slots import tree_mask
from cascade import attention
from cascade.errors import CascadeError
from cascade.tree import TokenTree

HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
RANK_ACCEPTANCE = (0.67, 0.12, 0.06, 0.04)
"""The trees' shape: the default ``rank_acceptance``, at most 6 levels deep (gamma 6)."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python scripts/attention_bench.py", description=__doc__.split("\n")[0])
    parser.add_argument("--keys", type=int, nargs="+", default=[4096, 32768, 120000])
    parser.add_argument("--nodes", type=int, nargs="+", default=[15, 31, 63])
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--out", type=Path, default=Path("results/attention_tree_cpu.json"))
    args = parser.parse_args(argv)
    if min(args.keys) <= max(args.nodes) + 1:
        parser.error(f"--keys must exceed the largest tree's pass ({max(args.nodes) + 1} tokens)")
    return args


def tree_pass(num_keys: int, nodes: int, device: torch.device) -> tuple[torch.Tensor, AttentionView]:
    """Random query [1, H, N + 1, D] and the view of a verification pass over a tree of ``nodes``."""
    generator = torch.Generator().manual_seed(num_keys + nodes)
    query = torch.randn(1, HEADS, nodes + 1, HEAD_DIM, generator=generator)
    keys, values = torch.randn(2, 1, KV_HEADS, num_keys, HEAD_DIM, generator=generator)
    query, keys, values = (x.to(device=device, dtype=torch.bfloat16) for x in (query, keys, values))
    ancestry = TokenTree.best_first(RANK_ACCEPTANCE, nodes, depth=6).ancestry.to(device)  # [N, N]
    slots = torch.arange(num_keys - nodes - 1, num_keys, device=device)  # [N + 1] the root, the nodes
    mask = tree_mask(slots, num_keys, ancestry, torch.bfloat16)  # [N + 1, S]
    return query, AttentionView(keys, values, mask, masked_tail=nodes + 1)


def reference(query: torch.Tensor, view: AttentionView, scale: float) -> torch.Tensor:
    """float64 attention [1, H, T, D] under the view's whole mask."""
    group = HEADS // KV_HEADS
    keys, values = (x.double().repeat_interleave(group, 1) for x in (view.keys, view.values))  # [1, H, S, D]
    scores = query.double() @ keys.transpose(-1, -2) * scale + view.mask.double()  # [1, H, T, S]
    return scores.softmax(-1) @ values


def kernels_for(device: torch.device) -> dict[str, attention.AttentionKernel]:
    runnable = {}
    for family, kernel in attention.KERNELS.items():
        try:
            attention.resolve_kernels(family, device)
        except CascadeError:
            continue
        runnable[family] = kernel
    return runnable | {"grouped_sdpa": attention._grouped_sdpa}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device, scale = torch.device(args.device), HEAD_DIM**-0.5
    kernels = kernels_for(device)
    print("| keys | tree nodes | " + " | ".join(f"{name} ms (max error)" for name in kernels) + " |")
    print("|---:|---:|" + "---:|" * len(kernels))
    rows = []
    for num_keys in args.keys:
        for nodes in args.nodes:
            query, view = tree_pass(num_keys, nodes, device)
            expected = reference(query, view, scale)
            row = {"keys": num_keys, "nodes": nodes, "ms": {}, "max_error": {}}
            for name, kernel in kernels.items():
                row["ms"][name] = 1e3 * median_seconds(lambda: kernel(query, view, scale), args.repeats, device)
                row["max_error"][name] = (kernel(query, view, scale).double() - expected).abs().max().item()
            rows.append(row)
            print(f"| {num_keys} | {nodes} | " + " | ".join(
                f"{row['ms'][name]:.2f} ({row['max_error'][name]:.1e})" for name in kernels) + " |", flush=True)
    report = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "threads": torch.get_num_threads(), "repeats": args.repeats, "rows": rows}
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
