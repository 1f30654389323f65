"""Each stage's step cost next to its roofline on this machine.

Measures the memory bandwidth (reading a large tensor) and the matmul peak (a large square
product) in the chosen dtype, then times the passes the cascade runs at each context: a one-token
step under the full cache (autoregressive decoding), a one-token step under the retrieval cache
(the self-speculating stage's proposals) and a (gamma + 1)-token verification pass under the full
cache. A pass's roofline is max(bytes read / bandwidth, FLOPs / matmul peak), where bytes read are
the weights once plus the KV the cache policy reports, and FLOPs are 2 per weight per token plus
the attention products. The KV is random: only the timing matters.

    python scripts/roofline.py [--contexts 8000 16000 32000] [--gamma 6] [--budget 4096]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from cache import build_policy
from cache.full import FullCache
from cache.retrieval import RetrievalCacheConfig
from cascade.checkpoint import load_checkpoint, yarn_scaling
from cascade.models import default_model



def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python scripts/roofline.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8000, 16000, 32000])
    parser.add_argument("--gamma", type=int, default=6, help="proposals per verification pass")
    parser.add_argument("--budget", type=int, default=4096, help="retrieval budget")
    parser.add_argument("--repeats", type=int, default=7, help="timed passes per figure (median)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--kernels", choices=["compiled", "eager"], default="compiled",
                        help="one-token passes through the compiled kernels (as the runtime runs them) or eagerly")
    parser.add_argument("--out", type=Path, default=Path("results/roofline.json"))
    return parser.parse_args(argv)


def median_seconds(run, repeats: int) -> float:
    run()  # first touch
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times)


def memory_bandwidth(dtype: torch.dtype, repeats: int) -> float:
    """Bytes per second reading a 512 MiB tensor (a sum reads each byte once)."""
    data = torch.ones(2**29 // torch.empty((), dtype=dtype).element_size(), dtype=dtype)
    return data.nbytes / median_seconds(lambda: data.sum(), repeats)


def matmul_peak(dtype: torch.dtype, repeats: int) -> float:
    """FLOPs per second of a 2048 x 2048 x 2048 product."""
    a, b = torch.randn(2048, 2048, dtype=dtype), torch.randn(2048, 2048, dtype=dtype)
    return 2 * 2048**3 / median_seconds(lambda: a @ b, repeats)


def pass_figures(model, cache, tokens: int, repeats: int, bandwidth: float, peak: float) -> dict:
    """Time a ``tokens``-token pass at the cache's end (rolled back after each) against its roofline."""
    spec = model.spec
    start = cache.length
    ids = torch.randint(0, spec.vocab_size, (1, tokens))

    def run() -> None:
        model(ids, cache, tokens)
        cache.rollback(start)

    seconds = median_seconds(run, repeats)
    weight_bytes = sum(p.nbytes for p in model.parameters())
    kv_bytes = cache.read_bytes()
    weights = sum(p.numel() for p in model.parameters())
    keys_read = kv_bytes // spec.num_layers // (2 * spec.num_kv_heads * spec.head_dim * model.dtype.itemsize)
    attention_flops = 4 * spec.num_layers * spec.num_heads * spec.head_dim * keys_read * tokens
    flops = 2 * weights * tokens + attention_flops
    roofline = max((weight_bytes + kv_bytes) / bandwidth, flops / peak)
    return {"tokens": tokens, "ms": seconds * 1000, "bytes_read": weight_bytes + kv_bytes, "flops": flops,
            "memory_ms": (weight_bytes + kv_bytes) / bandwidth * 1000, "compute_ms": flops / peak * 1000,
            "roofline_ms": roofline * 1000, "measured_over_roofline": seconds / roofline}


def context_figures(args, path: Path, context: int, bandwidth: float, peak: float) -> dict:
    scaling = yarn_scaling(path, context + 64)
    model = load_checkpoint(path, getattr(torch, args.dtype), torch.device("cpu"), scaling).model
    model.one_token_kernels = args.kernels == "compiled"
    layout = model.cache_layout(context + 64, args.gamma + 2)
    full = FullCache(layout)
    full.allocate(context)
    full.keys.normal_()
    full.values.normal_()
    full.commit(context)
    retrieval = build_policy(RetrievalCacheConfig(budget=args.budget), layout, full)
    passes = {
        "full, 1 token (autoregressive step)": pass_figures(model, full, 1, args.repeats, bandwidth, peak),
        f"retrieval {args.budget}, 1 token (proposal)": pass_figures(model, retrieval, 1, args.repeats, bandwidth, peak),
        f"full, {args.gamma + 1} tokens (verification)": pass_figures(
            model, full, args.gamma + 1, args.repeats, bandwidth, peak),
    }
    return {"context": context, "rope_scaling": scaling, "passes": passes}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = getattr(torch, args.dtype)
    bandwidth, peak = memory_bandwidth(dtype, args.repeats), matmul_peak(dtype, args.repeats)
    print(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s, {args.dtype} matmul peak {peak / 1e9:.0f} GFLOP/s")
    path = default_model("target", log=lambda message: print(message, file=sys.stderr))
    rows = []
    print("| context | pass | measured ms | memory-bound ms | compute-bound ms | measured / roofline |")
    print("|---:|---|---:|---:|---:|---:|")
    for context in args.contexts:
        figures = context_figures(args, path, context, bandwidth, peak)
        rows.append(figures)
        for name, row in figures["passes"].items():
            print(f"| {context} | {name} | {row['ms']:.1f} | {row['memory_ms']:.1f} | {row['compute_ms']:.1f} | "
                  f"{row['measured_over_roofline']:.1f}x |")
    report = {"dtype": args.dtype, "kernels": args.kernels, "bandwidth_bytes_per_s": bandwidth,
              "matmul_flops_per_s": peak, "threads": torch.get_num_threads(), "contexts": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
