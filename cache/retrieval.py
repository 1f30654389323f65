"""``retrieval`` (TriForce): the prompt's KV in chunks, the chunks the current query needs, kept
within a token budget, plus every token generated after the prompt.

The prompt is split into chunks of ``chunk_size`` tokens. Per layer and per KV head the chunks
are scored against the query and the best ``budget / chunk_size`` are gathered into this
policy's own small buffer: the first chunk always (attention sinks), the prompt's last partial
chunk always (it is the most recent context), the rest by score. The keys are read from the
``source`` full cache of the same model, so the prompt is never held twice.

Chunks are scored (``scoring``, see ``cache.chunk_scoring``) per KV head, all heads of a group
then reading the same chunks. TriForce selects them once per prompt, with each layer's query of
the prompt's last token as the full cache's prefill computed it (``first_selection: prompt``): the
selection is made when this cache takes the prompt, before any pass of its stage, so none of them
selects. They can also be first selected by the stage's first pass, and re-selected every N
committed tokens, when the stage's acceptance drops, or before every pass (Quest's query-aware
sparsity: each proposal reads the chunks its own input token's query picks). When chunks are
re-selected on a schedule, what the scoring reads of them is summarized once per prompt, and a
selecting pass has static shapes: it is captured as a graph like any other short pass (a one-off
selecting pass runs eagerly).

Tokens generated after the prompt are appended. Each stage writes the K/V it computes itself,
with attention over its sparse cache; once the full-cache stage above has verified a token and
it is committed, this policy replaces its own K/V of that token with the source's, computed with
full attention (``exact_generated``, as TriForce copies the full cache's new tokens into its
retrieval cache). Only committed tokens are replaced, so what this stage proposes at a position
never depends on anything after it.

Only the first query of a pass that selects counts. Its token is one the stage has already
decided; the pass's later tokens may be proposals the stage is verifying, and a selection that
looked at them would make the stage's distribution at a position depend on the tokens proposed
after it, which breaks the lossless guarantee of every stage above.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import BaseModel, ConfigDict, Field, model_validator

from cache.base import AttentionView, CacheLayout, CachePolicy
from cache.chunk_scoring import Scoring, score_chunks, score_prompt, summarize_chunks
from cache.config import CachePolicyConfig
from cache.full import FullCache
from cache.registry import register_policy
from cache.slots import SlotCache
from cascade.errors import CascadeError
from cascade.profiling import labelled


class EveryRefresh(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
    every: int = Field(ge=1)
    """Re-select the chunks after this many committed tokens."""


class OnDropRefresh(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)
    on_drop: float = Field(gt=0.0, lt=1.0)
    """Re-select when the acceptance rate of this stage's proposals since the last selection
    falls below this."""
    min_proposals: int = Field(32, ge=1)
    """Proposals since the last selection before that rate is judged."""


class RetrievalCacheConfig(CachePolicyConfig):
    """Chunk retrieval within a token budget: the target reads B tokens of KV, not the context."""

    kind: Literal["retrieval"] = "retrieval"
    """Policy selector."""
    budget: int = Field(4096, ge=2)
    """Prompt tokens kept (sink chunk, selected chunks and the prompt's partial last chunk)."""
    chunk_size: int = Field(8, ge=1)
    """Tokens per chunk, the unit that is scored and kept or dropped."""
    refresh: Literal["never", "every_pass"] | EveryRefresh | OnDropRefresh = "never"
    """When chunks are re-selected: never (TriForce), before every forward pass, every N committed
    tokens, or on an acceptance drop."""
    recent: int = Field(0, ge=0)
    """Prompt tokens at its end always kept (in whole chunks, part of the budget), like the sink
    chunk; 0 leaves them to the scores (TriForce)."""
    exact_generated: bool = True
    """Committed generated tokens take the full cache's K/V (TriForce); false keeps this stage's
    own, computed with attention over the retrieved chunks only."""
    scoring: Scoring = "mean_key"
    """How a chunk is ranked against the selecting query: ``mean_key``, the group's summed query
    against its mean key (TriForce: one product per chunk); ``bound``, the most any of its keys
    can score, from its per-dimension key range (Quest: two products per chunk); ``attention``,
    the attention probability its tokens receive from the group's queries (one product per prompt
    token, as much per selection as a full-cache step's attention); ``sparq``, that attention from
    the ``query_dims`` largest query dimensions (SparQ: reads that share of the keys, held a second
    time laid out by dimension)."""
    query_dims: int = Field(16, ge=1)
    """Query dimensions (of each head's) ``sparq`` scoring reads the keys along."""
    first_selection: Literal["prompt", "first_pass"] = "prompt"
    """What first selects a new prompt's chunks: ``prompt``, each layer's query of the prompt's last
    token as the full cache's prefill computed it (TriForce), so no pass of this stage selects until
    a refresh does and every pass can be captured as a graph; ``first_pass``, the first query of
    this stage's first pass (also where the source holds no such queries, e.g. a prompt written
    into it by hand). ``refresh: every_pass`` selects at every pass either way."""

    @model_validator(mode="after")
    def _budget_in_whole_chunks(self) -> RetrievalCacheConfig:
        if self.budget % self.chunk_size:
            raise ValueError(f"budget ({self.budget}) must be a multiple of chunk_size ({self.chunk_size})")
        if self.budget // self.chunk_size < 2:
            raise ValueError(
                f"budget ({self.budget}) must hold at least 2 chunks of chunk_size ({self.chunk_size}): "
                "the sink chunk and one more"
            )
        if self.recent > self.budget - 2 * self.chunk_size:
            raise ValueError(
                f"recent ({self.recent}) must leave room in the budget ({self.budget}) for the sink "
                f"chunk and one chosen chunk of {self.chunk_size}"
            )
        return self


@register_policy(RetrievalCacheConfig)
class RetrievalCache(SlotCache):
    reads_source = True

    def __init__(self, layout: CacheLayout, config: RetrievalCacheConfig, source: CachePolicy | None = None) -> None:
        if not isinstance(source, FullCache):
            raise ValueError("the retrieval cache reads the prompt from a full cache of the same model")
        if config.scoring == "sparq" and config.query_dims > layout.head_dim:
            raise CascadeError(
                f"retrieval cache: query_dims ({config.query_dims}) must be at most the model's "
                f"head_dim ({layout.head_dim}) for sparq scoring; set query_dims to "
                f"{layout.head_dim} or less"
            )
        super().__init__(layout, config.budget + layout.capacity - source.committed, source)
        self.config = config
        self._prompts_taken = 0
        """Prompts held so far: a selecting pass's graph reads the summaries of one of them."""
        self._take_prompt()

    def restart(self) -> None:
        """Start over on the prompt the source now holds (it was prefilled again): chunks are
        selected afresh. The slots hold the new kept prompt and what follows while the prompt
        leaves at least as much room after it as the first one did."""
        super().restart()
        self._take_prompt()

    def _take_prompt(self) -> None:
        """Hold the source's committed tokens as the prompt, chunks to be selected on the next pass."""
        self.prompt_length = self.length = self.committed = self.source.committed
        self.kept = kept_prompt_tokens(self.prompt_length, self.config.budget, self.config.chunk_size)
        """Prompt tokens held (the same for every layer and head); the rest are ``dropped``."""
        self.dropped = self.prompt_length - self.kept
        self.selections = 0
        """How many times chunks were (re-)selected."""
        self._select_pending, self._selecting = True, False
        self._committed_at_selection = self.committed
        self._proposed_since_selection = self._accepted_since_selection = 0
        self.exact_until = self.prompt_length
        """Sequence tokens before this hold the source's K/V (the prompt's kept part included)."""
        self._prompts_taken += 1
        repeated = self.config.refresh != "never" and self.config.scoring != "attention"
        self._summaries = [self._summarize(layer) for layer in range(self.layout.num_layers)] if repeated else None
        """Per layer, what the scoring reads of the prompt's chunks, for selections that repeat
        (attention scoring reads the keys themselves)."""
        self._copies = [self._layer_copies(layer) for layer in range(self.layout.num_layers)]
        if self._prompt_queries_select:
            with labelled("select chunks"):
                for layer, queries in enumerate(self.source.last_queries):  # [H, D] each
                    self._select(layer, queries[:, None])
            self._select_pending = False
            self.selections += 1

    @property
    def _prompt_queries_select(self) -> bool:
        """Whether the prompt's last queries make the first selection (``first_selection``)."""
        held = self.source.last_queries_at == self.prompt_length - 1
        return held and self.config.first_selection == "prompt" and self.config.refresh != "every_pass"

    def _layer_copies(self, layer: int) -> tuple[list[tuple[int, torch.Tensor, torch.Tensor]], list[tuple]]:
        """Layer ``layer``'s views a selection copies between, made once per prompt (a selection
        then indexes no tensor per head, which on a GPU costs the host more than the copies):
        per KV head, for the keys and the values, (head, the source's whole chunks as rows [C, size
        D], this buffer's chosen chunks as rows [chosen, size D]); and for each, the prompt's partial
        last chunk as (this buffer's slots, the source's) [H_kv, tail, D]."""
        size, prompt = self.config.chunk_size, self.prompt_length
        whole_chunks, tail, chosen = self._chunk_counts
        row = size * self.layout.head_dim
        chunks, tails = [], []
        for own, source in ((self.keys, self.source.keys), (self.values, self.source.values)):
            for head in range(self.layout.num_kv_heads):
                rows = source[layer, 0, head, : whole_chunks * size].view(whole_chunks, row)  # [C, size D]
                chunks.append((head, rows, own[layer, 0, head, : chosen * size].view(chosen, row)))
            tails.append((own[layer, 0, :, chosen * size : self.kept], source[layer, 0, :, prompt - tail : prompt]))
        return chunks, tails

    @property
    def _chunk_counts(self) -> tuple[int, int, int]:
        """The prompt's whole chunks, the tokens of its partial last one, and the chunks a selection keeps."""
        whole_chunks, tail = divmod(self.prompt_length, self.config.chunk_size)
        return whole_chunks, tail, (self.kept - tail) // self.config.chunk_size

    @property
    def _chunked_prompt(self) -> int:
        """Prompt tokens in whole chunks: those that are scored."""
        return self.prompt_length - self.prompt_length % self.config.chunk_size

    def _prompt_keys(self, layer: int) -> torch.Tensor:
        return self.source.keys[layer, 0, :, : self._chunked_prompt]  # [H_kv, C*size, D]

    def _summarize(self, layer: int) -> tuple[torch.Tensor, ...]:
        return summarize_chunks(self._prompt_keys(layer), self.config.chunk_size, self.config.scoring)

    @property
    def graph_ready(self) -> bool:
        """A selection repeated on a schedule is captured with its pass; a one-off one runs eagerly."""
        scheduled = self.config.refresh == "every_pass" or isinstance(self.config.refresh, EveryRefresh)
        return not self._select_pending or scheduled

    @property
    def pass_variant(self) -> tuple[str, int] | None:
        """A selecting pass runs more than the usual one, over this prompt's summaries."""
        return ("select", self._prompts_taken) if self._selecting else None

    def request_refresh(self) -> None:
        """Re-select the chunks on the next forward pass."""
        self._select_pending = True

    def observe_acceptance(self, proposed: int, accepted: int) -> None:
        refresh = self.config.refresh
        if not isinstance(refresh, OnDropRefresh):
            return
        self._proposed_since_selection += proposed
        self._accepted_since_selection += accepted
        if self._proposed_since_selection >= refresh.min_proposals:
            if self._accepted_since_selection < refresh.on_drop * self._proposed_since_selection:
                self.request_refresh()

    def commit(self, length: int) -> None:
        super().commit(length)
        if self.config.exact_generated:
            self._take_verified(length)
        refresh = self.config.refresh
        if isinstance(refresh, EveryRefresh) and length - self._committed_at_selection >= refresh.every:
            self._select_pending = True

    def allocate(self, num_new: int) -> torch.Tensor:
        """Also decides, on the host, whether this pass selects chunks (its first query will)."""
        self._selecting = self._select_pending or self.config.refresh == "every_pass"
        self._select_pending = False
        if self._selecting:
            self._committed_at_selection = self.committed
            self._proposed_since_selection = self._accepted_since_selection = 0
            self.selections += 1
        return self._allocate_slots(num_new)  # [T] absolute positions

    def adopt(self, length: int) -> int:
        """With ``exact_generated``, tokens the source has committed are taken from it whole, without
        a pass: their K/V would replace this cache's own at commit anyway. A stage the cost model
        bypassed for a while so resumes with one pass of one token, not a pass over all it skipped."""
        end = min(length, self.source.committed)
        if not self.config.exact_generated or self.length != self.committed or end <= self.length:
            return self.length
        self._check_room(end - self.length)
        self.length = end
        self.commit(end)
        return self.length

    def _take_verified(self, length: int) -> None:
        """Copy the source's K/V of the committed tokens it holds that this cache computed itself."""
        end = min(length, self.source.length)
        if end <= self.exact_until:
            return
        own = slice(self.exact_until - self.dropped, end - self.dropped)
        for mine, source in ((self.keys, self.source.keys), (self.values, self.source.values)):
            mine[:, :, :, own] = source[:, :, :, self.exact_until : end]  # [L, B, H_kv, new, D]
        self.exact_until = end

    def plain_pass(self) -> tuple[torch.Tensor, torch.Tensor, int] | None:
        return None if self._selecting else self._plain_slots()

    def update(self, layer: int, keys, values, query) -> AttentionView:
        if self._selecting:
            with labelled("select chunks"):
                self._select(layer, query[0, :, :1])  # [H, 1, D]: the pass's first token (see module docstring)
        return super().update(layer, keys, values, query)

    def _select(self, layer: int, first_query: torch.Tensor) -> None:
        """Gather this layer's best chunks (per KV head) for first_query [H, 1, D] from the source
        into the buffer."""
        size = self.config.chunk_size
        whole_chunks, _, chosen = self._chunk_counts
        scoring, query_dims = self.config.scoring, self.config.query_dims
        if self._summaries:
            scores = score_chunks(first_query, self._summaries[layer], size, scoring, query_dims)  # [H_kv, C]
        else:
            scores = score_prompt(first_query, self._prompt_keys(layer), size, scoring, query_dims)
        scores[:, 0] = float("inf")  # the sink chunk is always kept
        scores[:, whole_chunks - math.ceil(self.config.recent / size) :] = float("inf")  # and the recent ones
        best = scores.topk(chosen, dim=1).indices.sort(dim=1).values.unbind()  # H_kv x [chosen]
        chunk_copies, tail_copies = self._copies[layer]
        for head, rows, chosen_rows in chunk_copies:  # whole chunks as rows: a row copy each, not a gather per value
            torch.index_select(rows, 0, best[head], out=chosen_rows)
        for own_tail, source_tail in tail_copies:
            own_tail.copy_(source_tail)

    def memory_bytes(self) -> int:
        return super().memory_bytes() + self._summary_bytes()

    def selection_read_bytes(self) -> int:
        """Bytes one selection reads: what its scoring reads of every layer (the chunk summaries,
        or the prompt's keys for ``attention``) and the K/V of the kept prompt tokens it copies."""
        prompt_keys = self._chunked_prompt * self.layout.bytes_per_token // 2  # unsummarized: every scored key
        if self._summaries is None:
            scored = prompt_keys
        elif self.config.scoring == "sparq":  # query_dims rows of the keys laid out by dimension
            scored = self._summary_bytes() * self.config.query_dims // self.layout.head_dim
        else:
            scored = self._summary_bytes()
        return scored + self.kept * self.layout.bytes_per_token

    def _summary_bytes(self) -> int:
        return sum(part.nbytes for summary in self._summaries or () for part in summary)


def kept_prompt_tokens(prompt: int, budget: int, chunk_size: int) -> int:
    """Sink chunk + selected chunks + the partial last chunk, within the budget."""
    whole_chunks, tail = divmod(prompt, chunk_size)
    chosen = min(budget // chunk_size - (1 if tail else 0), whole_chunks)
    return chosen * chunk_size + tail
