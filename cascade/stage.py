"""A stage: one model under one cache policy, with its own counters."""

from __future__ import annotations

import time

import torch

from cache.base import CachePolicy
from cascade.model import CausalLM
from cascade.stats import StageStats


class Stage:
    def __init__(self, name: str, model: CausalLM, cache: CachePolicy) -> None:
        self.name = name
        self.model = model
        self.cache = cache
        self.stats = StageStats(name)

    def forward(self, token_ids: torch.Tensor, num_logits: int) -> torch.Tensor:
        """Run token_ids [T] through the model at the cache's current end -> logits [N, V]."""
        started = time.perf_counter()
        logits = self.model(token_ids[None, :], self.cache, num_logits)[0]  # [N, V]
        self.stats.time_s += time.perf_counter() - started
        self.stats.forward_calls += 1
        self.stats.tokens_processed += token_ids.numel()
        self.stats.kv_bytes_read += self.cache.read_bytes()
        return logits

    def prefill(self, prompt_ids: torch.Tensor, chunk: int) -> torch.Tensor:
        """Write prompt_ids [T] into the cache ``chunk`` tokens per pass -> last position's logits [V].

        Chunking bounds the attention working set at [chunk, T] instead of [T, T]; each chunk is
        committed, so policies that evict on commit never hold more than one chunk uncommitted.
        """
        started = time.perf_counter()
        for start in range(0, prompt_ids.numel(), chunk):
            logits = self.model(prompt_ids[None, start : start + chunk], self.cache, num_logits=1)
            self.cache.commit(self.cache.length)
            self.stats.forward_calls += 1
        self.stats.time_s += time.perf_counter() - started
        self.stats.tokens_processed += prompt_ids.numel()
        return logits[0, -1]  # [V]
