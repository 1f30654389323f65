"""A pass's weight products one after another, against one product of the same bytes.

A decode step of a small model runs each layer's products in turn (qkv, o, gate/up, down: 120 of them
for SmolLM2's 30 layers), each a fraction of a megabyte to a few megabytes, with the layer's other
work between them. One product over the same bytes streams its weight from memory once, start to end.
The difference between the two, per product, is what the chain pays for starting and ending each
product (the threads' fork and join, the memory streams' ramp, the threads' uneven ends), which no
roofline counts. Both run through cascade's weight kernels (``--weights``: bf16, in panels where the
AVX2 kernel takes them; int8 or 4-bit as ``cascade.quantise`` packs a draft's) on weights in huge pages
(the chain's one after another in one region, as ``cascade.huge_pages`` moves a model's), side by
side in one process, alternated, the median of ``--repeats``:

- ``chain``: every layer's four products of ``--shape`` (random weights, each its own), ``--rows``
  activation rows each (1: a decode step);
- ``one``: a single product whose weight has as many bytes (its outputs the chain's summed, of the
  model's hidden size).

    python scripts/product_chain_bench.py [--shape smollm2] [--weights bf16] [--layers N] [--rows 1 4]
        [--repeats 15] [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path
from typing import NamedTuple

import torch
from torch import nn

from cascade import huge_pages, kernels, panels
from cascade.errors import CascadeError
from cascade.logs import show_logs
from cascade.quantise import Int4Linear, Int8Linear, projection
from cascade.runs import run_files


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
    parser.add_argument("--weights", choices=["bf16", "int8", "int4"], default="bf16", help="how the weights are held")
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


def projections(shapes: list[tuple[int, int]], weights: str, in_panels: bool) -> list[nn.Module]:
    """Projections [O, I] of ``shapes`` with random weights held as ``weights`` says (bf16 in panels on
    AVX2), their tensors one after another in one region of huge pages, as a model's are moved there."""
    made = []
    for outputs, inputs in shapes:
        linear = nn.Linear(inputs, outputs, bias=False, dtype=torch.bfloat16)
        if weights == "bf16":
            made.append(panels.PanelLinear(linear) if in_panels else linear)
        else:
            made.append((Int8Linear if weights == "int8" else Int4Linear)(linear.float()))
    huge_pages.move_to_huge_pages(nn.ModuleList(made))
    return made


def weight_bytes(linear: nn.Module) -> int:
    """What a product with ``linear`` reads: its weight and any scales."""
    return sum(tensor.nbytes for tensor in projection(linear) if tensor is not None)


def product(rows: torch.Tensor, linear: nn.Module) -> torch.Tensor:
    """rows [T, I] times ``linear``'s weight through cascade's kernel for how it is held -> [T, O]."""
    weight, scales = projection(linear)
    if scales is None:
        return torch.ops.cascade_kernels.rows_times_weight(rows, weight)
    kernel = "rows_times_int4" if weight.dtype == torch.uint8 else "rows_times_int8"
    return getattr(torch.ops.cascade_kernels, kernel)(rows, weight, scales)


def timed_pair(chain: list[nn.Module], one: nn.Module, rows: int, repeats: int) -> tuple[float, float]:
    """Median seconds of the chain's products in turn and of the one product, alternated."""
    inputs = {linear.in_features: torch.randn(rows, linear.in_features).bfloat16() for linear in [*chain, one]}
    chain_s, one_s = [], []
    for _ in range(repeats + 1):  # the first round of each warms the code paths, not counted
        start = time.perf_counter()
        for linear in chain:
            product(inputs[linear.in_features], linear)
        chain_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        product(inputs[one.in_features], one)
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
    if args.weights != "bf16" and not kernels.quantised_kernels_available():
        raise CascadeError(f"product_chain_bench: cascade's {args.weights} kernel does not run here")
    in_panels = "avx2" in kernels.compiled_features()
    chain = projections(shape.products() * layers, args.weights, in_panels)
    chain_bytes = sum(weight_bytes(linear) for linear in chain)
    weights = sum(o * i for o, i in shape.products()) * layers
    outputs = -(-weights // (shape.hidden * 16)) * 16  # as many weights, in whole panels (blocks) of 16 outputs
    [one] = projections([(outputs, shape.hidden)], args.weights, in_panels)
    print("| rows | chain of products ms (GB/s) | one product ms (GB/s) | chain's cost a product, us |")
    print("|---:|---:|---:|---:|")
    rows = []
    for count in args.rows:
        chain_s, one_s = timed_pair(chain, one, count, args.repeats)
        one_rate = weight_bytes(one) / one_s
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
        "one_bytes": weight_bytes(one),
        "weights": args.weights,
        "panels": in_panels and args.weights == "bf16",
        "threads": torch.get_num_threads(),
        "repeats": args.repeats,
        "rows": rows,
    }
    files.write(report, vars(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
