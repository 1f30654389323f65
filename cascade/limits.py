"""What this machine can do at most, measured now: the memory bandwidth and the matmul rate that a
pass's roofline divides by (these machines drift between minutes, so a benchmark measures them in
each run rather than trusting an earlier figure)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch

from cascade import huge_pages

BANDWIDTH_BUFFER_BYTES = {"cpu": 2**30, "cuda": 2**32}
"""Bytes read per bandwidth sample: far larger than any cache level, as a model's weights are."""


def timings(run: Callable[[], object], repeats: int, device: torch.device) -> list[float]:
    """Wall times of ``repeats`` calls of ``run`` after one untimed call (first touch, and, with
    graphs, the capture)."""
    run()
    times = []
    for _ in range(repeats):
        torch.cuda.synchronize() if device.type == "cuda" else None
        started = time.perf_counter()
        run()
        torch.cuda.synchronize() if device.type == "cuda" else None
        times.append(time.perf_counter() - started)
    return times


def median_seconds(run: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Median wall time of ``run`` (see ``timings``): what a pass costs."""
    return statistics.median(timings(run, repeats, device))


def memory_bandwidth(repeats: int = 5, device: torch.device = torch.device("cpu")) -> float:
    """Bytes per second reading a 1 GiB (CPU) or 4 GiB (CUDA) float32 tensor once (a sum), with the
    threads torch uses: the fastest of ``repeats`` reads, as STREAM reports its best rate (what the
    memory can deliver now; on a VM whose neighbours share the memory, the median runs lower). On a
    CPU the tensor lies in huge pages, as a model's weights and KV caches do: on 4 KiB pages the same
    read ran at 43-47 GB/s where huge pages gave 64-65 (2-core EPYC VM, one process), so a roofline
    divided by it would have credited passes with speed their pages, not their kernels, lacked."""
    size = BANDWIDTH_BUFFER_BYTES.get(device.type, 2**30)
    data = huge_pages.zeros((size // 4,), torch.float32, device)
    data.fill_(1.0)  # written, so every page is the buffer's own (unwritten ones all map the zero page)
    return data.nbytes / min(timings(data.sum, repeats, device))


def matmul_peak(dtype: torch.dtype, repeats: int = 5, device: torch.device = torch.device("cpu")) -> float:
    """FLOPs per second of an n x n x n product (n = 2048 on CPU, 8192 on CUDA)."""
    n = 8192 if device.type == "cuda" else 2048
    a, b = (torch.randn(n, n, dtype=dtype, device=device) for _ in range(2))
    return 2 * n**3 / median_seconds(lambda: a @ b, repeats, device)
