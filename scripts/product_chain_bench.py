"""A pass's weight products one after another, against one product of the same bytes.

A decode step of a small model runs each layer's products in turn (qkv, o, gate/up, down: 120 of them
for SmolLM2's 30 layers), each a fraction of a megabyte to a few megabytes, with the layer's other
work between them. One product over the same bytes streams its weight from memory once, start to end.
The difference between the two, per product, is what the chain pays for starting and ending each
product (the threads' fork and join, the memory streams' ramp, the threads' uneven ends), which no
roofline counts. Both run through cascade's weight kernel (``rows_times_weight``, bf16; in panels where
the AVX2 kernel takes them) on weights in huge pages (the chain's one after another in one region, as
``cascade.huge_pages`` moves a model's), side by side in one process, alternated, the median of
``--repeats``:

- ``chain``: every layer's four products of ``--shape`` (random weights, each its own), ``--rows``
  activation rows each (1: a decode step);
- ``one``: a single product whose weight has as many bytes (its outputs the chain's summed, of the
  model's hidden size).

    python scripts/product_chain_bench.py [--shape smollm2] [--layers N] [--rows 1 4] [--repeats 15] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch

from cascade import huge_pages, kernels, panels
from cascade.errors import CascadeError
from cascade.logs import show_logs
from cascade.runs import run_files

CPU = torch.device("cpu")


class Shape(NamedTuple):
    hidden: int
    intermediate: int
    heads: int
    kv_heads: int
    head_dim: int
    layers: int

    def products(self) -> list[tuple[int, int]]:
        """One layer's weights [O, I]: qkv, o, gate/up, down."""
        qkv = (self.heads + 2 * self.kv_heads) * self.head_dim
        attended = self.heads * self.head_dim
        gate_up, down = (2 * self.intermediate, self.hidden), (self.hidden, self.intermediate)
        return [(qkv, self.hidden), (self.hidden, attended), gate_up, down]


SHAPES = {
    "smollm2": Shape(576, 1536, 9, 3, 64, 30),
    "qwen2.5-0.5b": Shape(896, 4864, 14, 2, 64, 24),
    "qwen2.5-1.5b": Shape(1536, 8960, 12, 2, 128, 28),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python scripts/product_chain_bench.py", description=__doc__.split("\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="smollm2", help="the model whose layers' products to take")
    parser.add_argument("--layers", type=int, help="layers in the chain (default: the model's)")
    parser.add_argument("--rows", type=int, nargs="+", default=[1], help="activation rows of each product")
    parser.add_argument("--repeats", type=int, default=15)
    parser.add_argument(
        "--out",
        type=Path,
        help="report path (default: product_chain.json in a new run directory under "
        "$CASCADE_HOME/runs/product_chain_bench/; a manifest.json goes beside it)",
    )
    args = parser.parse_args(argv)
    if args.layers is not None and args.layers < 1:
        parser.error(f"--layers must be at least 1, got {args.layers}")
    if not all(1 <= rows <= kernels.MAX_KERNEL_ROWS for rows in args.rows):
        parser.error(f"--rows: the kernel takes 1 to {kernels.MAX_KERNEL_ROWS} rows a product, got {args.rows}")
    if args.repeats < 1:
        parser.error(f"--repeats must be at least 1, got {args.repeats}")
    return args


def kernel_weights(shapes: list[tuple[int, int]], in_panels: bool) -> list[torch.Tensor]:
    """Random bf16 weights [O, I] of ``shapes``, as the kernel reads them (panels [O / 16, I, 16] on AVX2),
    one after another in one region of huge pages, as a model's weights are moved there."""
    packed = [torch.randn(o, i).bfloat16() for o, i in shapes]
    packed = [panels.pack(weight) if in_panels else weight for weight in packed]
    sizes = [-(-weight.nbytes // huge_pages.ALIGNMENT) * huge_pages.ALIGNMENT for weight in packed]
    region = huge_pages.advised_region(sum(sizes))
    if region is None:
        return packed
    offsets = [sum(sizes[:index]) for index in range(len(sizes))]
    return [
        region[offset : offset + weight.nbytes].view(torch.bfloat16).view(weight.shape).copy_(weight)
        for offset, weight in zip(offsets, packed, strict=True)
    ]


def timed_pair(chain: list[torch.Tensor], one: torch.Tensor, rows: int, repeats: int) -> tuple[float, float]:
    """Median seconds of the chain's products in turn and of the one product, alternated."""
    product = torch.ops.cascade_kernels.rows_times_weight
    inputs = {weight.shape[1]: torch.randn(rows, weight.shape[1]).bfloat16() for weight in [*chain, one]}
    chain_s, one_s = [], []
    for _ in range(repeats + 1):  # the first round of each warms the code paths, not counted
        start = time.perf_counter()
        for weight in chain:
            product(inputs[weight.shape[1]], weight)
        chain_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        product(inputs[one.shape[1]], one)
        one_s.append(time.perf_counter() - start)
    return statistics.median(chain_s[1:]), statistics.median(one_s[1:])


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    show_logs()
    if not kernels.weight_kernel_available():
        raise CascadeError("product_chain_bench: cascade's weight kernel does not run here (see the warning above)")
    files = run_files("product_chain_bench", args.out, "product_chain.json")
    shape = SHAPES[args.shape]
    layers = args.layers or shape.layers
    in_panels = "avx2" in kernels.compiled_features()
    chain = kernel_weights(shape.products() * layers, in_panels)
    chain_bytes = sum(weight.numel() * 2 for weight in chain)
    one_outputs = -(-chain_bytes // (2 * shape.hidden * 16)) * 16  # as many bytes, whole panels
    [one] = kernel_weights([(one_outputs, shape.hidden)], in_panels)
    print("| rows | chain of products ms (GB/s) | one product ms (GB/s) | chain's cost a product, us |")
    print("|---:|---:|---:|---:|")
    rows = []
    for count in args.rows:
        chain_s, one_s = timed_pair(chain, one, count, args.repeats)
        one_rate = one.numel() * 2 / one_s
        row = {
            "rows": count,
            "chain_ms": 1e3 * chain_s,
            "chain_gb_per_s": chain_bytes / chain_s / 1e9,
            "one_ms": 1e3 * one_s,
            "one_gb_per_s": one_rate / 1e9,
            "cost_per_product_us": 1e6 * (chain_s - chain_bytes / one_rate) / len(chain),
        }
        rows.append(row)
        print(
            f"| {count} | {row['chain_ms']:.2f} ({row['chain_gb_per_s']:.1f}) | {row['one_ms']:.2f} "
            f"({row['one_gb_per_s']:.1f}) | {row['cost_per_product_us']:.1f} |",
            flush=True,
        )
    report = {
        "shape": shape._asdict(),
        "layers": layers,
        "products": len(chain),
        "chain_bytes": chain_bytes,
        "one_bytes": one.numel() * 2,
        "panels": in_panels,
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "rows": rows,
    }
    files.write(report, vars(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
