"""Autoregressive decoding of several sequences at once: every step is one pass of all unfinished
sequences, which share each read of the target's weights (at short and medium contexts the weights,
not the KV, are most of what a step reads).

Each sequence keeps what it would have alone: its own full cache (prefilled, or loaded from the
prompt cache, by itself), sampling settings, seed and stop rule. Its rows of a batched pass compute
what a pass of its own does, bit for bit (``CausalLM.forward_batch``), and it draws its tokens with
its own generator, so it emits the tokens its own generation would, whatever the batch holds. A
sequence that stops (end of sequence, a stop string, its ``max_new_tokens``, a cancellation) leaves
the batch; the others go on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cascade.errors import CascadeError
from cascade.model import SequencePass
from cascade.pipeline import GenerationResult, StopRule, TokenCallback, read_together
from cascade.runtime import CacheRequest, Runtime
from cascade.sampling import draw
from cascade.stage import Stage
from cascade.stats import GenerationStats
from configs.schema import SamplingConfig


@dataclass(frozen=True)
class BatchRequest:
    """One sequence to generate in a batch (its prompt checked against the context limit)."""

    prompt_ids: list[int]
    stop: StopRule
    sampling: SamplingConfig
    seed: int
    on_tokens: TokenCallback | None = None


def generate_batch(runtime: Runtime, requests: list[BatchRequest]) -> list[GenerationResult]:
    """``requests`` decoded autoregressively together on ``runtime``'s target (whatever its preset:
    each one's tokens are the target's own) -> each one's result, in order. Refused up front if
    their caches would not fit in memory."""
    device = runtime.target.model.device
    rows = [
        BatchRow(
            stage,
            torch.tensor(request.prompt_ids, device=device),
            request.stop,
            request.sampling,
            torch.Generator(device=device).manual_seed(request.seed),
            request.on_tokens,
        )
        for stage, request in zip(batch_stages(runtime, requests), requests, strict=True)
    ]
    return decode_batch(rows, runtime.config.prefill_chunk)


def batch_stages(runtime: Runtime, requests: list[BatchRequest]) -> list[Stage]:
    """A full-cache stage of the target per request, each cache sized for its own sequence."""
    target = runtime.config.stages[-1]
    config = runtime.config.model_copy(update={"stages": [target]})
    chunk = runtime.config.prefill_chunk
    sizes = [
        CacheRequest(
            (target,), len(request.prompt_ids) + request.stop.max_new_tokens, request.stop.max_new_tokens, chunk + 1
        )
        for request in requests
    ]
    layout = runtime.target.model.cache_layout(1)
    needed = sum(size.capacity for size in sizes) * layout.bytes_per_token
    check_memory(needed, f"a batch of {len(requests)} sequences", layout.device)
    return [runtime.build_stages(config, size, [None])[0] for size in sizes]


def check_memory(needed: int, what: str, device: torch.device) -> None:
    """Refuse ``what`` (a batch, say) whose caches need more than the memory available now, before
    any is built."""
    available = available_memory(device)
    if available is not None and needed > available:
        raise CascadeError(
            f"{what} needs {needed / 2**30:.2f} GiB of KV cache, and {available / 2**30:.2f} GiB of {device.type} "
            "memory is available: generate fewer sequences at once (batch_size) or shorter ones"
        )


def available_memory(device: torch.device) -> int | None:
    """Bytes free for new allocations on ``device`` now (None where the OS does not say)."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        lines = Path("/proc/meminfo").read_text().splitlines()
    except OSError:
        return None
    kib = [int(line.split()[1]) for line in lines if line.startswith("MemAvailable:")]
    return kib[0] * 1024 if kib else None


@dataclass
class BatchRow:
    """One sequence of a batch, and what it has emitted so far."""

    stage: Stage
    """The target under a full cache of this sequence's own."""
    prompt_ids: torch.Tensor
    """[T] int64 on the model's device."""
    stop: StopRule
    sampling: SamplingConfig
    generator: torch.Generator
    on_tokens: TokenCallback | None = None
    emitted: list[int] = field(default_factory=list)
    drawn: torch.Tensor | None = None
    """[1] int64 on the model's device: the token drawn last, not yet fed."""
    stats: GenerationStats = field(default_factory=GenerationStats)

    @property
    def finished(self) -> bool:
        return bool(self.stats.stop_reason)

    @property
    def length(self) -> int:
        """Tokens of the sequence: the prompt and what it has emitted."""
        return self.prompt_ids.numel() + len(self.emitted)


def decode_batch(rows: list[BatchRow], prefill_chunk: int) -> list[GenerationResult]:
    """Prefill each row, then decode every unfinished row together -> each row's result, in order."""
    for row in rows:
        prefill(row, prefill_chunk)
    started = time.perf_counter()
    while active := [row for row in rows if not row.finished]:
        step(active)
        drawn = read_together([row.drawn for row in active])  # the host's one wait per step
        for row, tokens in zip(active, drawn, strict=True):
            emit(row, tokens, started)
    return [GenerationResult(row.emitted, row.stats) for row in rows]


def prefill(row: BatchRow, chunk: int) -> None:
    """The row's prompt into its cache, and the first token drawn and emitted."""
    started = time.perf_counter()
    row.stats.prompt_tokens = row.prompt_ids.numel()
    row.stats.stages = [row.stage.stats]
    logits = row.stage.prefill(row.prompt_ids, chunk)  # [V]
    row.drawn = draw(logits[None], row.sampling, row.generator)[0]
    row.stats.prefill_s = time.perf_counter() - started
    emit(row, row.drawn.tolist(), time.perf_counter())


def step(rows: list[BatchRow]) -> None:
    """One pass of ``rows``' last drawn tokens, and each row's next token drawn from its logits."""
    stage_stats = [row.stage.stats for row in rows]
    started = time.perf_counter()
    logits = rows[0].stage.model.forward_batch([SequencePass(row.drawn, row.stage.cache) for row in rows])
    seconds = time.perf_counter() - started  # on CUDA: until the pass is queued
    for row, row_logits, stats in zip(rows, logits, stage_stats, strict=True):
        row.drawn = draw(row_logits, row.sampling, row.generator)[0]
        stats.forward_calls += 1
        stats.tokens_processed += 1
        stats.time_s += seconds
        stats.kv_bytes_read += row.stage.cache.read_bytes()


def emit(row: BatchRow, drawn: list[int], started: float) -> None:
    """Emit the row's ``drawn`` token unless its stop rule ends it first; commit its cache
    (``started``: when its decoding began)."""
    kept, reason = row.stop.cut(row.emitted, drawn)
    row.emitted += kept
    row.stage.commit(row.length)  # every token but the one just drawn is in the cache: final
    if row.on_tokens:
        row.on_tokens(kept)
    if reason:
        row.stats.stop_reason = reason
        row.stats.new_tokens = len(row.emitted)
        row.stats.decode_s = time.perf_counter() - started
