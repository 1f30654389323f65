"""The generation loop over N stages; returns tokens and stats and prints nothing."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from cascade.errors import CascadeError
from cascade.sampling import next_token
from cascade.stage import Stage
from cascade.stats import GenerationStats
from configs.schema import SamplingConfig

TokenCallback = Callable[[list[int]], None]


@dataclass
class GenerationResult:
    token_ids: list[int]
    """Generated tokens only (the prompt excluded), ending with EOS if it was produced."""
    stats: GenerationStats


@dataclass(frozen=True)
class StopRule:
    eos_token_ids: frozenset[int]
    max_new_tokens: int

    def cut(self, emitted: list[int], new: list[int]) -> tuple[list[int], str | None]:
        """The prefix of ``new`` autoregressive decoding would still emit, and why it stops (if it does)."""
        room = self.max_new_tokens - len(emitted)
        for index, token in enumerate(new[:room]):
            if token in self.eos_token_ids:
                return new[: index + 1], "eos"
        if len(new) >= room:
            return new[:room], "max_new_tokens"
        return new, None


class Pipeline:
    def __init__(self, stages: list[Stage], sampling: SamplingConfig, prefill_chunk: int) -> None:
        if len(stages) != 1:
            raise CascadeError(
                f"this build runs single-stage pipelines; the config has {len(stages)} stages "
                "(multi-stage speculation is not implemented yet)"
            )
        self.stages = stages
        self.sampling = sampling
        self.prefill_chunk = prefill_chunk

    @property
    def target(self) -> Stage:
        return self.stages[-1]

    def generate(
        self,
        prompt_ids: torch.Tensor,
        stop: StopRule,
        generator: torch.Generator | None = None,
        on_tokens: TokenCallback | None = None,
    ) -> GenerationResult:
        """Generate after prompt_ids [T]; ``on_tokens`` receives each run of emitted tokens."""
        stats = GenerationStats(prompt_tokens=prompt_ids.numel(), stages=[s.stats for s in self.stages])
        started = time.perf_counter()
        logits = self.target.prefill(prompt_ids, self.prefill_chunk)  # [V]
        emitted: list[int] = []
        while True:
            token = next_token(logits, self.sampling, generator)  # [] int64
            kept, stats.stop_reason = stop.cut(emitted, [int(token)])
            emitted += kept
            if on_tokens:
                on_tokens(kept)
            if len(emitted) == 1:
                stats.prefill_s = time.perf_counter() - started
                started = time.perf_counter()
            if stats.stop_reason:
                break
            logits = self.target.forward(token.reshape(1), num_logits=1)[0]
        self.target.cache.commit(self.target.cache.length)
        stats.decode_s = time.perf_counter() - started
        stats.new_tokens = len(emitted)
        return GenerationResult(emitted, stats)
