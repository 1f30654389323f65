"""Pydantic schemas for pipeline configs: validated once at the boundary, trusted afterwards."""

from __future__ import annotations

from typing import Annotated, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from cache import POLICIES


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)


CacheConfig = Annotated[
    Union[tuple(entry.config for entry in POLICIES.values())],  # noqa: UP007 (built at import)
    Field(discriminator="kind"),
]


class RopeScalingConfig(Strict):
    kind: Literal["yarn", "linear"] = "yarn"
    """Position-interpolation method that stretches the model's native context."""
    factor: float = Field(2.0, gt=1.0, le=64.0)
    """New context = native context x factor."""


class ModelConfig(Strict):
    path: str | None = None
    """Checkpoint directory, or the name of a provisioned catalog model (e.g. qwen2.5-coder-1.5b-instruct);
    null means the default model provisioned for this role."""
    rope_scaling: RopeScalingConfig | None = None
    """Override the checkpoint's rope scaling (e.g. YaRN to run SmolLM2 beyond 8K tokens)."""
    quantise: Literal["none", "int8", "int4", "auto"] = "none"
    """Draft only: int8 projections, per output channel (half the bytes a bf16 pass reads), or int4:
    4-bit levels with a scale and a low per 32 inputs (5 bits a weight, as llama.cpp's Q4_K sub-blocks).
    The target verifies every token, so the output is still the target's own; naming the target's own
    checkpoint as the draft makes a quantised self-draft. auto: int8 where cascade's quantised kernels
    run (bf16 on a CPU with AVX512-VNNI or AVX2), elsewhere the weights as loaded (unpacking quantised weights for
    every product would be slower than bf16)."""
    int4_group: int = Field(32, ge=32, le=4096, multiple_of=32)
    """Draft only, with quantise int4: the inputs of a weight row that share one scale and low, a
    multiple of 32. Coarser groups are stored as groups of 32 that repeat theirs (the same bytes and
    speed), to measure what a coarser quantisation costs in acceptance: a checkpoint dequantised from
    a 4-bit GGUF (both Qwen2.5-Coder models) keeps nearly its own weights in groups of 32."""
    frequent_tokens: int | None = Field(None, ge=256)
    """Draft only: keep the output projection's rows of this many tokens alone, the most frequent
    in the Python standard library's source (special tokens first), as FR-Spec does. A proposal
    then reads fewer weights (Qwen2.5's 151,936-row projection is a quarter of its 0.5B model) and
    proposes only among these tokens; the target verifies every token, so the output is unchanged.
    null keeps every token."""
    cross_tokenizer: bool = False
    """Draft only: the draft's tokenizer differs from the target's (both byte-level BPE, sharing at
    least a quarter of the draft's tokens). It then proposes among the tokens both vocabularies
    hold (token-level intersection): lossless greedy and sampled; it must be the first stage, and
    proposes chains, not token trees. Off: a draft with another vocabulary is refused."""

    @model_validator(mode="after")
    def _int4_groups_need_int4(self) -> ModelConfig:
        if self.int4_group != 32 and self.quantise != "int4":
            raise ValueError(
                f"int4_group {self.int4_group} groups int4 weights, but quantise is {self.quantise!r}; "
                "set quantise: int4, or leave int4_group at 32"
            )
        return self


MIN_TEMPERATURE = 1e-4
"""Smallest sampling temperature: below it sampling is greedy in effect, and logits divided by it
overflow float32 (from about 1e-37), which no distribution survives."""


class SamplingConfig(Strict):
    temperature: float = Field(0.0, ge=0.0, le=100.0)
    """0 is greedy decoding; otherwise logits are divided by it before sampling (at least 1e-4)."""
    top_k: int = Field(0, ge=0)
    """Keep only the k most likely tokens; 0 keeps all."""
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Keep the smallest set of tokens whose probability reaches top_p; 1.0 keeps all."""

    @field_validator("temperature")
    @classmethod
    def _greedy_or_sampled(cls, temperature: float) -> float:
        if 0.0 < temperature < MIN_TEMPERATURE:
            raise ValueError(
                f"must be 0 (greedy) or at least {MIN_TEMPERATURE} (below that, sampling is "
                f"greedy in effect and logits / temperature overflow float32); got {temperature}"
            )
        return temperature


class TreeConfig(Strict):
    nodes: int = Field(16, ge=1, le=63)
    """Most token-tree nodes this stage proposes per round; the verifying pass reads them all and
    one more token. Its depth is at most the round's gamma."""
    rank_acceptance: list[float] = Field(default_factory=lambda: [0.67, 0.12, 0.06, 0.04], min_length=1)
    """How often the verifier's token is this stage's most likely, second most likely, ... token;
    shapes the tree. The default is what a retrieval cache of 4096 tokens selecting every round
    measured at 120K tokens (rounded; a run's stats report its own as ``rank_acceptance``)."""
    dynamic: bool = False
    """Keep each level's width but choose its nodes every round as the most likely continuations by
    this stage's path probabilities (EAGLE-2), instead of the fixed ranks of the shape."""

    @model_validator(mode="after")
    def _shares(self) -> TreeConfig:
        shares = self.rank_acceptance
        if not all(0 < share <= 1 for share in shares) or sum(shares) > 1 + 1e-6:
            raise ValueError(f"rank_acceptance must be shares in (0, 1] summing to at most 1; got {shares}")
        if any(later > earlier for earlier, later in zip(shares, shares[1:], strict=False)):
            raise ValueError(f"rank_acceptance must not increase with the rank; got {shares}")
        return self


class LookupConfig(Strict):
    """The n-grams a ``model: lookup`` stage matches (prompt lookup decoding): the sequence's last n
    tokens for the longest n in [min_ngram, max_ngram] that occurred before."""

    min_ngram: int = Field(2, ge=1, le=16)
    """The shortest suffix matched (1 proposes after any repeated token: more proposals, fewer kept)."""
    max_ngram: int = Field(4, ge=1, le=16)
    """The longest suffix matched, tried first."""

    @model_validator(mode="after")
    def _ordered(self) -> LookupConfig:
        if self.min_ngram > self.max_ngram:
            raise ValueError(f"min_ngram ({self.min_ngram}) must not exceed max_ngram ({self.max_ngram})")
        return self

    @property
    def sizes(self) -> range:
        return range(self.min_ngram, self.max_ngram + 1)


class StageConfig(Strict):
    model: Literal["target", "draft", "lookup"] = "target"
    """Which model this stage runs; stages naming the same model share its weights. lookup: no model,
    the first stage proposes what followed the latest earlier occurrence of the sequence's last
    tokens in the prompt and output (prompt lookup decoding; settings under ``lookup``, no cache)."""
    cache: CacheConfig = Field(default_factory=lambda: POLICIES["full"].config())
    """KV cache policy of this stage, selected by ``kind``."""
    gamma: int = Field(4, ge=1, le=64)
    """Tokens this stage proposes to the stage above it per round (the most, for adaptive
    schedules); unused by the last stage."""
    optional: bool = False
    """Drop this stage for a prompt its cache cannot serve (e.g. one within a retrieval budget,
    where it would degenerate to the full cache) instead of refusing the request."""
    schedule: Literal["fixed", "heuristic", "cost_model"] = "fixed"
    """How gamma is chosen each round: fixed; +2/-1 after full/partial acceptance (transformers'
    heuristic); or the cost model from measured acceptance and cost, which may bypass the stage."""
    tree: TreeConfig | None = None
    """Propose a token tree instead of a single continuation (only the first stage, which decodes
    by itself, and not under h2o or topk_oracle caches); null: one continuation of gamma tokens."""
    stop_below: float | None = Field(None, gt=0, lt=1)
    """End a round's proposals early, after the first token drafted while the most likely next token
    had less than this probability (the stage's own next-token distribution, as it draws from it;
    the softmax of its logits when greedy): confident runs go up to gamma, doubtful ones are verified
    at once (dynamic draft length, as transformers' ``assistant_confidence_threshold``). A token tree
    stops growing after the first level all of whose nodes were drawn below doubtful ones. Only the
    first stage; it decides from the stage's own distributions alone, so the output is unchanged.
    null: always gamma tokens (a tree: all its levels)."""

    lookup: LookupConfig = LookupConfig()
    """The n-grams a ``model: lookup`` stage matches (only that stage takes these settings)."""

    @model_validator(mode="after")
    def _lookup_settings_fit(self) -> StageConfig:
        if self.model == "lookup" and "cache" in self.model_fields_set:
            raise ValueError("a lookup stage (model: lookup) keeps no KV cache: remove its cache settings")
        if self.model != "lookup" and "lookup" in self.model_fields_set:
            raise ValueError(f"lookup settings are a model: lookup stage's; this stage runs the {self.model}")
        return self

    @property
    def speculative_tokens(self) -> int:
        """Most tokens a round this stage proposes adds to the caches above it."""
        return (self.tree.nodes if self.tree else self.gamma) + 1


class LongDocumentsConfig(Strict):
    strategy: Literal["truncate", "map_reduce"] = "truncate"
    """What ``cascade.summarize`` does with a document longer than the usable context: keep its head
    and tail and say how much was dropped, or summarize chunks of it and then their summaries."""
    head_share: float = Field(0.5, gt=0.0, lt=1.0)
    """truncate: share of the kept tokens taken from the document's head; the rest is its tail."""
    chunk_tokens: int | None = Field(None, ge=64)
    """map_reduce: document tokens per chunk; null fills the usable context."""


class PromptCacheConfig(Strict):
    dir: str | None = None
    """Directory where stages store the prefilled prompts their caches hold whole (full caches;
    streaming ones while the prompt fits their window) and load them when the same prompt comes
    again with the same model and settings (bitwise the same K/V); null: always prefill."""
    max_gb: float = Field(16.0, gt=0.0)
    """Beyond this size the least recently used stored prompts are deleted (SmolLM2 in bf16:
    about 23 MB per thousand prompt tokens)."""


class PipelineConfig(Strict):
    stages: list[StageConfig] = Field(min_length=1)
    """Cheapest first; the last stage is the full-cache target that decides every token."""
    target: ModelConfig = ModelConfig()
    """The model whose output is reproduced exactly."""
    draft: ModelConfig = ModelConfig()
    """The small model used by stages with ``model: draft``."""
    sampling: SamplingConfig = SamplingConfig()
    """Applied identically to every stage's logits."""
    max_new_tokens: int = Field(256, ge=1, le=1_000_000)
    """Generation stops after this many new tokens (or at end-of-sequence)."""
    max_context: int | None = Field(None, ge=2)
    """Cap on prompt + new tokens; null means the target model's own context limit."""
    prefill_chunk: int | None = Field(None, ge=16, le=65536)
    """Prompt tokens per prefill forward pass: bounds the attention working set of long prompts,
    and is the step at which a stored prompt's prefix is reused (a prompt sharing N tokens with a
    stored one loads the whole passes within them and prefills the rest). null: 1024 on CPU (as
    fast as 4096 there, and a later prompt reuses more of a stored one), 4096 on CUDA (where an
    eager pass costs its kernel launches whatever its length: an H200 prefilled 16K tokens of
    SmolLM2 at 212K tokens/s in passes of 4096, at 57K in passes of 1024)."""
    dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """Weights and KV dtype; auto picks bfloat16 on CUDA and on CPUs where cascade's kernels build
    (AVX-512 BF16, or AVX2 with FMA), else float32."""
    seed: int = Field(0, ge=0, le=2**64 - 1)
    """Seed of the sampling random generator."""
    kernels: Literal["compiled", "eager"] = "compiled"
    """compiled runs short passes through torch.compile'd kernels: on CPU one-token passes (decode
    steps, proposals), about 1.5-2x faster (needs a C++ compiler); on CUDA passes of up to 16
    tokens, verification included, as a few fused Triton kernels per layer instead of some twenty
    (needs Triton). Without a compiler it falls back to eager and says so. Models compile them as
    they load (seconds, cached on disk). eager runs plain PyTorch ops."""
    attention: Literal["auto", "cpu", "sdpa", "cuda", "flash", "flex"] = "auto"
    """Attention kernels: cpu (tuned for CPU passes), sdpa (PyTorch's scaled_dot_product_attention),
    cuda (few-query passes as matrix products spread over the whole GPU, the rest SDPA), flash
    (flash-attn; CUDA and bf16/fp16 only), flex (PyTorch's FlexAttention for graphed passes, compiled
    per pass shape, the rest as cuda or cpu; for CUDA, runs anywhere). auto: flash on CUDA when
    flash-attn is installed, else cuda on CUDA, cpu on CPU."""
    cuda_graphs: bool = True
    """On CUDA, replay decode, proposal and verification passes (up to 16 tokens) as CUDA graphs,
    captured per pass shape on first use; ignored on CPU."""
    carry_pass_costs: bool = True
    """Each request starts its cost model from the pass costs the runtime's previous request timed,
    where the prompts' lengths are within 1.25x of each other (``cascade.pass_costs``): no plain
    steps timed first, no ladder of warm-up gammas; the acceptance is measured afresh. false times
    every request from nothing (a one-off run's figures)."""
    pass_costs_dir: str | None = None
    """Where each request's pass costs are kept for later processes on this machine
    (``cascade.cost_store``): a runtime's first request starts from the costs a run of the same
    models and stages timed here on a prompt within 1.25x of its length, as ``carry_pass_costs``
    carries them within a runtime (which must be on). null keeps none; ``cascade.generate``,
    ``cascade.serve``, summarization jobs and ``cascade.LLM`` keep them in ``$CASCADE_HOME/pass-costs``
    (or ``$CASCADE_PASS_COSTS``) unless this names another directory."""
    long_documents: LongDocumentsConfig = LongDocumentsConfig()
    """How summarization jobs treat documents longer than the usable context."""
    prompt_cache: PromptCacheConfig = PromptCacheConfig()
    """Reuse of prefilled prompts across generations and processes (off unless ``dir`` is set)."""

    @model_validator(mode="after")
    def _last_stage_is_exact(self) -> PipelineConfig:
        last = self.stages[-1]
        if last.model != "target" or last.cache.kind != "full":
            raise ValueError(
                "the last stage must be the target with a full cache (it decides every token); "
                f"got model={last.model!r}, cache.kind={last.cache.kind!r}"
            )
        return self

    @model_validator(mode="after")
    def _target_is_unquantised(self) -> PipelineConfig:
        if self.target.quantise != "none":
            raise ValueError(
                f"target.quantise: {self.target.quantise!r} would change the output cascade reproduces (the "
                "target's own); quantise a draft instead (draft.quantise, with draft.path = the target's "
                "checkpoint for a quantised self-draft)"
            )
        return self

    @model_validator(mode="after")
    def _target_keeps_every_token(self) -> PipelineConfig:
        if self.target.frequent_tokens is not None:
            raise ValueError(
                f"target.frequent_tokens: {self.target.frequent_tokens} would leave the target unable to "
                "emit the other tokens, and it decides every token; set it on the draft (draft.frequent_tokens)"
            )
        return self

    @model_validator(mode="after")
    def _sources_exist(self) -> PipelineConfig:
        for index, stage in enumerate(self.stages):
            if POLICIES[stage.cache.kind].policy.reads_source and self.source_of(index) is None:
                raise ValueError(
                    f"stages.{index}: a {stage.cache.kind} cache reads the prompt's KV from a full-cache "
                    f"stage of the same model ({stage.model}), and there is none; add one above it"
                )
        return self

    @model_validator(mode="after")
    def _trees_fit(self) -> PipelineConfig:
        for index, stage in enumerate(self.stages):
            if stage.tree is None:
                continue
            if index != 0 or len(self.stages) == 1:
                raise ValueError(
                    f"stages.{index}.tree: only the first stage of two or more proposes token "
                    "trees (it decodes by itself); set tree: null here"
                )
            if not POLICIES[stage.cache.kind].policy.tree_passes:
                trees = ", ".join(kind for kind, entry in POLICIES.items() if entry.policy.tree_passes)
                raise ValueError(
                    f"stages.{index}.tree: a {stage.cache.kind} cache cannot run token-tree "
                    f"passes; use one of {trees}, or tree: null"
                )
        return self

    @model_validator(mode="after")
    def _lookup_is_lowest(self) -> PipelineConfig:
        for index, stage in enumerate(self.stages):
            if stage.model == "lookup" and (index != 0 or len(self.stages) == 1 or stage.tree or stage.stop_below):
                raise ValueError(
                    f"stages.{index}: a lookup stage (model: lookup) proposes as the first stage of two or more, "
                    "one continuation a round (tree: null, stop_below: null)"
                )
        return self

    @model_validator(mode="after")
    def _early_stops_fit(self) -> PipelineConfig:
        for index, stage in enumerate(self.stages):
            if stage.stop_below is not None and (index != 0 or len(self.stages) == 1):
                raise ValueError(
                    f"stages.{index}.stop_below: only the first stage of two or more ends its proposals "
                    "early (it decodes by itself); set stop_below: null here"
                )
        return self

    @model_validator(mode="after")
    def _cross_tokenizer_draft_is_lowest(self) -> PipelineConfig:
        if self.target.cross_tokenizer:
            raise ValueError("target.cross_tokenizer: the target's tokenizer is the one; set it on the draft")
        if not self.draft.cross_tokenizer:
            return self
        for index, stage in enumerate(self.stages):
            if stage.model == "draft" and (index != 0 or stage.tree is not None):
                raise ValueError(
                    f"stages.{index}: a draft with another tokenizer (draft.cross_tokenizer) drafts as the "
                    "first stage, in chains (tree: null): its proposals are verified in the target's tokens"
                )
        return self

    def source_of(self, index: int) -> int | None:
        """The full-cache stage of the same model whose KV stage ``index``'s policy reads, if any."""
        stage = self.stages[index]
        if not POLICIES[stage.cache.kind].policy.reads_source:
            return None
        for other in range(len(self.stages) - 1, index, -1):
            candidate = self.stages[other]
            if candidate.model == stage.model and candidate.cache.kind == "full":
                return other
        return None
