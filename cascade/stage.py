"""A stage: one model under one cache policy, with its gamma schedule and its own counters."""

from __future__ import annotations

from collections.abc import Iterator

import torch

from cache import build_policy
from cache.base import CacheLayout, CachePolicy, TreePass
from cache.config import CachePolicyConfig
from cascade.clock import Clock
from cascade.graphs import Capture, PassGraphs
from cascade.model import CausalLM
from cascade.pass_costs import fresh_stats
from cascade.profiling import labelled
from cascade.prompt_cache import PromptCache
from cascade.quantise import is_quantised
from cascade.schedule import Schedule
from cascade.stats import StageStats
from cascade.tree import TokenTree


def device_ids(tokens: list[int], device: torch.device) -> torch.Tensor:
    """Token ids the host holds -> [T] int64 on ``device``, copied without waiting for the device."""
    return torch.tensor(tokens, dtype=torch.long).to(device, non_blocking=True)


class Stage:
    def __init__(
        self,
        name: str,
        model: CausalLM,
        cache_config: CachePolicyConfig,
        layout: CacheLayout,
        *,
        schedule: Schedule | None = None,
        source: Stage | None = None,
        prompt_cache: PromptCache | None = None,
        capture: Capture | None = None,
        tree: TokenTree | None = None,
        dynamic_tree: bool = False,
        stop_below: float | None = None,
    ) -> None:
        """``schedule``: how many tokens this stage proposes per round (None for the last stage).
        ``source``: the full-cache stage of the same model whose prompt KV this stage's policy
        reads; such a stage gets its cache when the source has prefilled, and no prefill of its own.
        ``prompt_cache``: where this stage loads and stores its prefilled prompts (those its
        policy holds whole, as a full cache does: ``holds_every_prompt_token``).
        ``capture``: how short passes are captured as graphs (None: every pass runs eagerly).
        ``tree``: the token tree this stage proposes (at most gamma levels of it), if it does;
        ``dynamic_tree``: its levels' widths, filled by this stage's path probabilities each round.
        ``stop_below``: the confidence under which this stage ends a round's proposals early."""
        self.name = name
        self.model = model
        self.cache_config = cache_config
        self.layout = layout
        self.source = source
        self.prompt_cache = prompt_cache
        self.capture = capture
        self.tree = tree
        self.dynamic_tree = dynamic_tree
        self.stop_below = stop_below
        self.cache: CachePolicy | None = None
        self.graphs: PassGraphs | None = None
        if source is None:
            self._use_cache(build_policy(cache_config, layout))
        self.restart(schedule)

    def restart(self, schedule: Schedule | None, last: StageStats | None = None) -> None:
        """Fresh counters (starting from the pass costs in the ``last`` generation's stats, where
        given: see ``cascade.pass_costs``), clock and ``schedule`` for the next generation; the cache
        (emptied by the next prefill) and its graphs are kept."""
        self.schedule = schedule
        self.stats = fresh_stats(self.name, schedule, last)
        self.clock = Clock(self.device)
        """Times this stage's passes; its spans are settled by the pipeline between rounds."""

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def captured_passes(self) -> int:
        """Pass shapes this stage holds as captured graphs."""
        return len(self.graphs.graphs) if self.graphs is not None else 0

    @property
    def length(self) -> int:
        """Sequence tokens whose K/V this stage holds (or has dropped by policy)."""
        return self.cache.length

    def prefill(self, prompt_ids: torch.Tensor, chunk: int) -> torch.Tensor | None:
        """Write prompt_ids [T] into the emptied cache -> last position's logits [V] (None for a
        stage that reads its source's prompt KV instead): the longest prefix the prompt cache
        holds is loaded from it (every token and the logits, if it holds the whole prompt), the
        rest computed ``chunk`` tokens per pass (and stored there)."""
        if self.source is not None:
            self._read_source()
            return None
        self.cache.restart()
        started = self.clock.mark()
        store = self.prompt_cache if self.cache_config.holds_every_prompt_token(prompt_ids.numel()) else None
        reused, logits = store.load(prompt_ids, chunk, self.cache) if store else (0, None)
        self.stats.prefill_loaded = logits is not None
        self.stats.prefill_reused = reused
        if logits is None:
            with labelled(f"{self.name} prefill"):
                logits = self._prefill(prompt_ids, chunk, reused)
            if store:
                store.save(prompt_ids, chunk, self.cache, logits)
        self.clock.add(self.stats, "prefill_s", started, self.clock.mark())
        return logits

    def _read_source(self) -> None:
        """Read the prompt the source has just prefilled: into a new cache, or the kept one."""
        if self.cache is None:
            self._use_cache(build_policy(self.cache_config, self.layout, self.source.cache))
        else:
            self.cache.restart()

    def _use_cache(self, cache: CachePolicy) -> None:
        self.cache = cache
        if self.capture is not None and cache.static_passes:
            self.graphs = PassGraphs(self.model, cache, self.capture)

    def _prefill(self, prompt_ids: torch.Tensor, chunk: int, start: int = 0) -> torch.Tensor:
        """Feed the prompt from ``start`` (a multiple of ``chunk``, the tokens before it in the
        cache) ``chunk`` tokens per pass, skipping what the policy lets a prefill leave out
        (``CachePolicy.unfed_prompt``) -> the last position's logits [V]."""
        unfed = self.cache.unfed_prompt(prompt_ids.numel())
        if start:
            assert not unfed, "a policy that skips prompt tokens stores no prefix"
            return self._feed_prompt(prompt_ids[start:], chunk)
        self._feed_prompt(prompt_ids[: unfed.start], chunk)
        self.cache.skip(len(unfed))
        return self._feed_prompt(prompt_ids[unfed.stop :], chunk)

    def _feed_prompt(self, prompt_ids: torch.Tensor, chunk: int) -> torch.Tensor | None:
        """Chunking bounds the attention working set at [chunk, T] instead of [T, T]; each chunk is
        committed, so policies that evict on commit never hold more than one chunk uncommitted.
        Returns the last position's logits [V] (None for no tokens); the last pass keeps its last
        token's queries for the policies that read this cache (``CachePolicy.keep_last_queries``)."""
        logits = None
        for start in range(0, prompt_ids.numel(), chunk):
            if start + chunk >= prompt_ids.numel():
                self.cache.keep_last_queries()
            logits = self.model(prompt_ids[None, start : start + chunk], self.cache, num_logits=1)
            self.cache.commit(self.cache.length)
        return None if logits is None else logits[0, -1]

    def extend(
        self, context: list[int], num_logits: int, proposed: torch.Tensor | None = None, tree: TreePass | None = None
    ) -> torch.Tensor:
        """Feed the tokens of ``context`` this stage has not seen, then the ``proposed`` ids [G]
        (on the model's device; the nodes of ``tree`` if given) -> logits [N, V] of the last N.
        What the cache can take from its source instead (``CachePolicy.adopt``) is not fed."""
        self.cache.adopt(len(context) - 1)  # the last token is fed: its logits are asked for
        self._feed_ahead(context, 0 if proposed is None else proposed.numel())
        unseen = device_ids(context[self.cache.length :], self.device)  # [T]
        return self.feed(unseen if proposed is None else torch.cat([unseen, proposed]), num_logits, tree)

    def _feed_ahead(self, context: list[int], proposed: int) -> None:
        """A quantised model's pass wider than its compiled kernels take unpacks every weight (a probe of
        the Qwen2.5 0.5B draft after 32 bypassed tokens at 8K: 0.6-0.7 s against 25 ms a step):
        feed the unseen tokens of ``context`` that would widen the next pass (of them and ``proposed``
        more) past the kernels, the kernels' width at a time."""
        width = self.model.fused_tokens
        if width <= 1 or not is_quantised(self.model):
            return
        for end in self._pass_ends(context, width, keep=max(width - proposed, 1)):
            self.feed(device_ids(context[self.cache.length : end], self.device), 1)

    def _pass_ends(self, context: list[int], chunk: int, keep: int) -> Iterator[int]:
        """Where each pass ends that feeds the tokens of ``context`` this stage has not seen, ``chunk``
        at a time, until ``keep`` of them are left (read as the caller's passes extend the cache)."""
        while self.cache.length < len(context) - keep:
            yield min(len(context) - keep, self.cache.length + chunk)

    def feed(self, token_ids: torch.Tensor, num_logits: int, tree: TreePass | None = None) -> torch.Tensor:
        """Run token_ids [T] (on the model's device) after what the cache holds -> logits [N, V]
        of the last N; ``tree``: the last of them are token-tree nodes. Nothing here waits for the
        device, so passes queue up behind each other."""
        started = self.clock.mark()
        with labelled(self.name):
            if self.graphs is not None:
                logits = self.graphs(token_ids[None, :], num_logits, tree)[0]  # [N, V]
            else:
                logits = self.model(token_ids[None, :], self.cache, num_logits, tree)[0]
        self.clock.add(self.stats, "time_s", started, self.clock.mark())
        self.stats.forward_calls += 1
        self.stats.tokens_processed += token_ids.numel()
        self.stats.kv_bytes_read += self.cache.read_bytes()
        return logits

    def catch_up(self, context: list[int], chunk: int) -> None:
        """Feed the final tokens of ``context`` this stage skipped, all but the last, ``chunk`` per
        pass, committing each: a stage the cost model bypassed for long then fits its pending room."""
        self.cache.adopt(len(context) - 1)
        for end in self._pass_ends(context, chunk, keep=1):
            self.extend(context[:end], 1)
            self.cache.commit(end)

    def keep_path(self, start: int, path: list[int]) -> None:
        """Keep, of the token-tree nodes fed after the first ``start`` tokens, the accepted ``path``."""
        self.cache.keep_path(start, path)

    def truncate(self, length: int) -> None:
        """Forget tokens past ``length`` of the sequence (those were rejected or cut)."""
        self.cache.rollback(min(self.cache.length, length))

    def commit(self, length: int) -> None:
        """The first ``length`` sequence tokens are final: forget anything after, keep the rest."""
        self.truncate(length)
        self.cache.commit(self.cache.length)
