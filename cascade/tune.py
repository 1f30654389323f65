"""``python -m cascade.tune``: measure this machine's kernel thresholds (``cascade.tuning``) and keep
them for every later run on it. About a minute; each threshold is timed where it applies (the
compiled attention crossover and, with AVX512-BF16, the order a decode step reads its weights in on
the CPU; the key blocks on a GPU when there is one).

    python -m cascade.tune [--repeats 20]
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import statistics
import time
from collections.abc import Callable

import torch

from cache.base import AttentionView
from cascade import attention, fused, huge_pages, kernels
from cascade.errors import entry_point
from cascade.graphs import cuda_graph
from cascade.limits import median_seconds
from cascade.tuning import Tuning, machine_tuning, save_tuning

CPU = torch.device("cpu")
HEADS, KV_HEADS, HEAD_DIM = 9, 3, 64
"""The attention shape timed (SmolLM2's: 9 query heads sharing 3 KV heads of 64)."""
KEY_COUNTS = (1024, 2048, 4096, 8192, 16384)
"""Cached keys of the one-query passes timed for ``compiled_attention_max_keys``."""
VERIFIED_TOKENS = 7
STEP_MATRICES = ((3072, 576), (576, 1536), (49152, 576), (17920, 1536), (1536, 8960))
"""[O, I] of the one-row products timed for ``step_in_memory_order``: SmolLM2's gate and up, down and
output head, Qwen2.5 1.5B's gate and up and down (144 MiB together, past any L3)."""
SPLIT_KEY_COUNTS = (16384, 65536)
BLOCK_SIZES = (256, 512, 1024, 2048, 4096)
"""Cached keys and key blocks of the 7-token weights-values products timed for ``split_keys``."""


def compiled_attention_crossover(seconds: Callable[[str, int], float]) -> tuple[int, dict]:
    """From ``seconds(kernel, keys)`` of the ``compiled`` and ``cpu`` one-query kernels at each of
    ``KEY_COUNTS`` -> the threshold (between the last count at which the compiled kernel is the
    faster, from the first on, and the next; 0 if it never is) and the timings."""
    measured = {keys: {kernel: seconds(kernel, keys) for kernel in ("compiled", "cpu")} for keys in KEY_COUNTS}
    wins = 0
    while wins < len(KEY_COUNTS) and measured[KEY_COUNTS[wins]]["compiled"] < measured[KEY_COUNTS[wins]]["cpu"]:
        wins += 1
    if wins in (0, len(KEY_COUNTS)):
        return (0 if wins == 0 else KEY_COUNTS[-1]), measured
    return round(math.sqrt(KEY_COUNTS[wins - 1] * KEY_COUNTS[wins])), measured  # the geometric middle


def fastest_split(seconds: Callable[[int, int], float]) -> tuple[int, dict]:
    """From ``seconds(block, keys)`` of the blockwise product at each of ``SPLIT_KEY_COUNTS`` ->
    the block size with the least time summed over them, and the timings."""
    measured = {block: {keys: seconds(block, keys) for keys in SPLIT_KEY_COUNTS} for block in BLOCK_SIZES}
    return min(BLOCK_SIZES, key=lambda block: sum(measured[block].values())), measured


def one_query_seconds(repeats: int) -> Callable[[str, int], float]:
    """Median seconds of a one-query float32 pass through each kernel (``compiled`` or ``cpu``)."""

    def seconds(kernel: str, keys: int) -> float:
        generator = torch.Generator().manual_seed(keys)
        query = torch.randn(1, HEADS, 1, HEAD_DIM, generator=generator)
        cached = torch.randn(2, 1, KV_HEADS, keys, HEAD_DIM, generator=generator)
        scale = HEAD_DIM**-0.5
        if kernel == "compiled":
            return median_seconds(lambda: fused.compiled_attention(query, cached[0], cached[1], scale), repeats, CPU)
        view = AttentionView(cached[0], cached[1], None)
        return median_seconds(lambda: attention.attend_cpu(query, view, scale), repeats, CPU)

    return seconds


def split_seconds(repeats: int, device: torch.device) -> Callable[[int, int], float]:
    """Median seconds of a replayed 7-token weights-values product over blocks of each size."""

    def seconds(block: int, keys: int) -> float:
        weights = torch.rand(1, KV_HEADS, HEADS // KV_HEADS * VERIFIED_TOKENS, keys, device=device).bfloat16()
        values = torch.randn(1, KV_HEADS, keys, HEAD_DIM, device=device).bfloat16()
        return median_seconds(cuda_graph(lambda: attention.blockwise_product(weights, values, block)), repeats, device)

    return seconds


def step_order_seconds(repeats: int) -> dict[str, float]:
    """Median seconds of one-row products through every ``STEP_MATRICES`` weight (in huge pages, as a
    model's weights lie) read in memory order and across blocks, the two orders alternated call by
    call: a VM's memory speed moves within seconds."""
    weights = [huge_pages.zeros(shape, torch.bfloat16, CPU).normal_() for shape in STEP_MATRICES]
    rows = [torch.randn(1, weight.shape[1]).bfloat16() for weight in weights]
    times: dict[bool, list[float]] = {True: [], False: []}
    for repeat in range(repeats):
        for in_memory_order in (True, False) if repeat % 2 else (False, True):
            torch.ops.cascade_kernels.set_step_in_memory_order(in_memory_order)
            started = time.perf_counter()
            for row, weight in zip(rows, weights, strict=True):
                torch.ops.cascade_kernels.rows_times_weight(row, weight)
            times[in_memory_order].append(time.perf_counter() - started)
    torch.ops.cascade_kernels.set_step_in_memory_order(machine_tuning().step_in_memory_order)
    return {"memory_order": statistics.median(times[True]), "across": statistics.median(times[False])}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m cascade.tune", description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=20, help="timed calls per figure (median)")
    return parser.parse_args(argv)


@entry_point
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tuning, measurements = machine_tuning(), {}
    max_keys, measurements["compiled_attention"] = compiled_attention_crossover(one_query_seconds(args.repeats))
    tuning = dataclasses.replace(tuning, compiled_attention_max_keys=max_keys)
    if kernels.step_orders_available():
        measurements["step_order"] = step_order_seconds(args.repeats)
        in_memory_order = measurements["step_order"]["memory_order"] < measurements["step_order"]["across"]
        tuning = dataclasses.replace(tuning, step_in_memory_order=in_memory_order)
    if torch.cuda.is_available():
        split, measurements["split_keys"] = fastest_split(split_seconds(args.repeats, torch.device("cuda")))
        tuning = dataclasses.replace(tuning, split_keys=split)
    path = save_tuning(tuning, measurements)
    print(f"{tuning} (defaults: {Tuning()}); kept in {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
