"""From a validated config to runnable stages: devices, dtypes, models, tokenizers, caches."""

from __future__ import annotations

import importlib.util
import logging
import shutil
import threading
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cache.full import FullCache
from cascade import fused, kernels, panels
from cascade.attention import resolve_kernels
from cascade.checkpoint import LoadedModel, load_checkpoint, stretch_factor
from cascade.cost_store import costs_identity, keep_stats, kept_stats
from cascade.errors import CascadeError
from cascade.graphs import MAX_GRAPH_TOKENS, Capture, cuda_graph
from cascade.huge_pages import move_to_huge_pages
from cascade.lookup import LookupStage
from cascade.model import CausalLM, PassOptions
from cascade.models import checkpoint_path, default_model
from cascade.pass_costs import carries
from cascade.pipeline import GenerationResult, Pipeline, StopRule, TokenCallback
from cascade.prompt_cache import PromptCache, model_key
from cascade.quantise import quantisation, quantise
from cascade.schedule import SCHEDULES, Schedule
from cascade.stage import Stage
from cascade.stats import StageStats
from cascade.stop_strings import StopStrings
from cascade.translated_stage import TranslatedStage
from cascade.translation import Translation
from cascade.tree import TokenTree
from cascade.vocabulary import frequent_tokens
from configs.schema import ModelConfig, PipelineConfig, SamplingConfig, StageConfig

logger = logging.getLogger(__name__)


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """``auto``: bfloat16 on CUDA and on CPUs whose short passes read bf16 weights at memory speed
    (AVX512-BF16, or cascade's AVX2 kernels, which widen bf16 in registers: half the bytes of
    float32), else float32."""
    if name == "auto":
        fast_bf16 = device.type == "cuda" or kernels.cpu_has_avx512_bf16() or kernels.weight_kernel_available()
        return torch.bfloat16 if fast_bf16 else torch.float32
    return getattr(torch, name)


MIN_REUSED_FILL = 0.5
"""A request restarts the last one's caches only if its sequence fills at least this share of
them. A static (graphed) pass reads the whole slot buffer under its mask, except through
flash-attn's kernel and ``flex``'s causal passes, so a short request in a long request's caches
would pay every pass for keys it does not hold (a 7-token SDPA pass took 9.4 ms over 16K slots on
an H100, 51.8 ms over 120K), and would keep memory it does not use."""


@dataclass(frozen=True)
class CacheRequest:
    """What one generation asks of its stages' caches."""

    stages: tuple[StageConfig, ...]
    capacity: int
    """Tokens of the whole sequence: prompt, new tokens and a round of speculation."""
    room: int
    """Tokens after the prompt (new tokens and a round of speculation)."""
    max_pending: int
    """Most tokens written between two commits (a lagging stage's catch-up chunk + one round)."""

    def holds(self, other: CacheRequest) -> bool:
        """Caches built for this request can serve ``other``: the same stages, no longer a
        sequence, no more room after the prompt (a retrieval cache's slots are its budget + room),
        and a sequence at least ``MIN_REUSED_FILL`` of this one."""
        return (self.stages, self.max_pending) == (other.stages, other.max_pending) and (
            other.capacity <= self.capacity <= other.capacity / MIN_REUSED_FILL and self.room >= other.room
        )


@dataclass
class Runtime:
    """Loaded models for one config; ``pipeline_for`` gives each request stages with caches."""

    config: PipelineConfig
    target: LoadedModel
    draft: LoadedModel | None
    prompt_caches: dict[str, PromptCache] = field(default_factory=dict)
    """Per model role, where its stages store and load the prefilled prompts their caches hold whole."""
    capture: Capture | None = None
    """How stages capture their short passes as graphs (None: all passes run eagerly)."""
    stages: list[Stage] = field(default_factory=list)
    """The last request's stages, kept for the next request their caches hold."""
    built_for: CacheRequest | None = None
    """The request ``stages`` were built for."""
    costs_timed_at: int | None = None
    """Prompt tokens of the last request, whose pass costs ``stages``' stats hold (``cascade.pass_costs``)."""
    translation: Translation | None = None
    """The tokens a draft with another tokenizer shares with the target (``draft.cross_tokenizer``)."""

    @property
    def tokenizer(self):
        return self.target.tokenizer

    @property
    def models(self) -> dict[str, CausalLM]:
        """The loaded models by role ("target", and "draft" where the config has one)."""
        return {"target": self.target.model, **({"draft": self.draft.model} if self.draft else {})}

    def context_limit(self) -> int:
        limit = self.target.model.spec.max_context
        return min(limit, self.config.max_context) if self.config.max_context else limit

    def check_request(self, prompt_tokens: int, max_new_tokens: int, log_skips: bool = True) -> PipelineConfig:
        """The config this request runs (optional stages that cannot serve it dropped, and said so
        unless not ``log_skips``), or an error."""
        if prompt_tokens == 0:
            raise CascadeError("the prompt is empty: give some text with --prompt or --prompt-file")
        kept = []
        for index, stage in enumerate(self.config.stages):
            try:
                stage.cache.check_prompt(prompt_tokens)
            except ValueError as exc:
                if not stage.optional:
                    raise CascadeError(f"stages.{index}.cache: {exc}") from None
                if log_skips:
                    logger.info(
                        f"cascade: stage {index} ({stage.model}/{stage.cache.kind}) skipped for this prompt: {exc}"
                    )
                continue
            kept.append(stage)
            if log_skips:
                self._check_draft_positions(index, stage, prompt_tokens + max_new_tokens)
        limit, total = self.context_limit(), prompt_tokens + max_new_tokens
        if total > limit:
            raise CascadeError(
                f"prompt ({prompt_tokens} tokens) + max-new-tokens ({max_new_tokens}) = {total} exceeds the "
                f"context limit of {limit} tokens; shorten the prompt, lower --max-new-tokens, or "
                f"{self._room_for(total)}"
            )
        return self.config.model_copy(update={"stages": kept})

    def _check_draft_positions(self, index: int, stage: StageConfig, total: int) -> None:
        """Warn when draft stage ``index`` would read positions past the draft's own context for a
        sequence of ``total`` tokens (at least: a draft across tokenizers may spell it in more): there
        its proposals are seldom accepted and the cost model bypasses it. The output is the target's
        either way."""
        if stage.model != "draft" or self.draft is None:
            return
        limit, positions = self.draft.model.spec.max_context, stage.cache.rotary_positions(total)
        if positions <= limit:
            return
        scaling = self.config.draft.rope_scaling
        factor = (scaling.factor if scaling else 1) * stretch_factor(positions, limit)
        within, setting = stage.cache.within_positions(limit)
        logger.warning(
            f"cascade: stage {index} (draft/{stage.cache.kind}) reads at least {positions} positions, past "
            f"the draft's {limit}-token context, where it seldom agrees with the target (the output is the "
            f"target's either way); give it {within} (--set stages.{index}.cache.{setting}), or stretch the draft "
            f"(--set draft.rope_scaling.kind=yarn --set draft.rope_scaling.factor={factor:g})"
        )

    def _room_for(self, total: int) -> str:
        """How to make the context limit hold ``total`` tokens: the setting that binds, raised."""
        model_limit = self.target.model.spec.max_context
        if total <= model_limit:
            return f"raise --set max_context (now {self.config.max_context}) to at least {total}"
        scaling = self.config.target.rope_scaling
        factor = (scaling.factor if scaling else 1) * stretch_factor(total, model_limit)
        return (
            f"stretch the target's context with --set target.rope_scaling.kind=yarn "
            f"--set target.rope_scaling.factor={factor:g}"
        )

    def pipeline_for(self, prompt_tokens: int, max_new_tokens: int, sampling: SamplingConfig | None = None) -> Pipeline:
        """Stages with caches sized for this request (checked against the context limit): the
        last request's, restarted, where their caches hold this one too (so are their graphs), and
        starting from its pass costs where ``carry_pass_costs`` and the prompts' lengths allow.
        ``sampling`` replaces the config's for this request."""
        config, request = self.cache_request(prompt_tokens, max_new_tokens)
        schedules = schedules_for(config)
        last = self.last_stats(config, request, prompt_tokens)
        if self.built_for is None or not self.built_for.holds(request):
            self.stages = []  # the old caches go before the new ones are allocated
            self.stages = self.build_stages(config, request, schedules)
            self.built_for = request
        for stage, schedule, stats in zip(self.stages, schedules, last, strict=True):
            stage.restart(schedule, stats)
        self.costs_timed_at = prompt_tokens
        return Pipeline(self.stages, sampling or config.sampling, config.prefill_chunk)

    def last_stats(self, config: PipelineConfig, request: CacheRequest, prompt_tokens: int) -> list[StageStats | None]:
        """Each stage's stats from the last request, where this one starts from their pass costs
        (``carry_pass_costs``, the same stages, prompts of about the same length), else those kept
        on disk for these stages and this length (``pass_costs_dir``), else Nones."""
        nothing = [None] * len(config.stages)
        if not config.carry_pass_costs:
            return nothing
        same_stages = self.built_for is not None and self.built_for.stages == request.stages
        if same_stages and carries(self.costs_timed_at, prompt_tokens):
            return [stage.stats for stage in self.stages]
        if config.pass_costs_dir is None:
            return nothing
        identity = costs_identity(config, request.stages)
        names = [stage_name(index, stage) for index, stage in enumerate(config.stages)]
        return kept_stats(Path(config.pass_costs_dir), identity, names, prompt_tokens) or nothing

    def keep_costs(self, prompt_tokens: int) -> None:
        """Keep the last request's pass costs on disk for later processes (``pass_costs_dir``), where
        a stage proposed or timed anything."""
        config = self.config
        if not (config.carry_pass_costs and config.pass_costs_dir and self.built_for):
            return
        stats = [stage.stats for stage in self.stages]
        if any(one.plain_samples or one.proposal_samples for one in stats[:-1]):
            identity = costs_identity(config, self.built_for.stages)
            keep_stats(Path(config.pass_costs_dir), identity, prompt_tokens, stats)

    def cache_request(self, prompt_tokens: int, max_new_tokens: int) -> tuple[PipelineConfig, CacheRequest]:
        """The config this request runs (``check_request``) and what it asks of its caches."""
        config = self.check_request(prompt_tokens, max_new_tokens)
        speculation = sum(stage.speculative_tokens for stage in config.stages[:-1])
        request = CacheRequest(
            tuple(config.stages),
            prompt_tokens + max_new_tokens + speculation,
            max_new_tokens + speculation,
            config.prefill_chunk + speculation + 1,
        )
        return config, request

    def build_stages(
        self,
        config: PipelineConfig,
        request: CacheRequest,
        schedules: list[Schedule | None],
        models: dict[str, CausalLM] | None = None,
    ) -> list[Stage]:
        """New stages (and caches) for ``request``, with ``schedules`` per stage (None for the last),
        running ``models`` by role (default: the runtime's, passes captured as graphs where it
        captures them; given models run every pass eagerly)."""
        models = models or self.models
        capture = self.capture if models.get("target") is self.target.model else None
        last = len(config.stages) - 1
        stages: dict[int, Stage] = {}
        for index in range(last, -1, -1):  # sources (full-cache stages) come after their readers
            stage = config.stages[index]
            if stage.model == "lookup":
                device = self.target.model.device
                stages[index] = LookupStage(stage_name(index, stage), stage.lookup.sizes, device, schedules[index])
                continue
            model = models[stage.model]
            source = config.source_of(index)
            translated = stage.model == "draft" and self.translation is not None
            spelled = TRANSLATED_TOKENS if translated else 1  # draft tokens per target token, at most
            stages[index] = Stage(
                stage_name(index, stage),
                model,
                stage.cache,
                model.cache_layout(request.capacity * spelled, request.max_pending * spelled),
                schedule=schedules[index],
                source=None if source is None else stages[source],
                prompt_cache=self.prompt_caches.get(stage.model),
                capture=capture,
                tree=stage.tree and TokenTree.best_first(stage.tree.rank_acceptance, stage.tree.nodes, stage.gamma),
                dynamic_tree=stage.tree is not None and stage.tree.dynamic,
                stop_below=stage.stop_below,
            )
            if translated:
                stages[index] = TranslatedStage(stages[index], self.translation)
        return [stages[i] for i in range(last + 1)]

    def stop_rule(self, max_new_tokens: int, stop_at_eos: bool = True, **extra) -> StopRule:
        """Stop after ``max_new_tokens``, at the target's EOS unless not ``stop_at_eos``, and as
        ``extra`` (StopRule's stop strings and cancel event) says."""
        eos = frozenset(self.target.eos_token_ids) if stop_at_eos else frozenset()
        return StopRule(eos, max_new_tokens, **extra)

    def generate(
        self,
        prompt_ids: list[int],
        max_new_tokens: int | None = None,
        on_tokens: TokenCallback | None = None,
        stop_at_eos: bool = True,
        sampling: SamplingConfig | None = None,
        seed: int | None = None,
        stop_strings: StopStrings | None = None,
        cancelled: threading.Event | None = None,
    ) -> GenerationResult:
        """Generate after ``prompt_ids`` (checked first) on ``pipeline_for``'s stages, with the
        config's sampling and seed unless ``sampling`` / ``seed`` replace them, until
        ``stop_rule``'s rule ends it (``stop_at_eos=False`` makes exactly ``max_new_tokens``, for
        measurements, unless a stop string or ``cancelled`` ends it first)."""
        max_new_tokens = max_new_tokens or self.config.max_new_tokens
        device = self.target.model.device
        pipeline = self.pipeline_for(len(prompt_ids), max_new_tokens, sampling)
        generator = torch.Generator(device=device).manual_seed(self.config.seed if seed is None else seed)
        stop = self.stop_rule(max_new_tokens, stop_at_eos, stop_strings=stop_strings, cancelled=cancelled)
        result = pipeline.generate(torch.tensor(prompt_ids, device=device), stop, generator, on_tokens=on_tokens)
        self.keep_costs(len(prompt_ids))
        return result


def stage_name(index: int, stage: StageConfig) -> str:
    """How stage ``index`` is named in stats: its position, model and cache."""
    return f"{index}:lookup" if stage.model == "lookup" else f"{index}:{stage.model}/{stage.cache.kind}"


def schedules_for(config: PipelineConfig) -> list[Schedule | None]:
    """Fresh gamma schedules of the config's stages (None for the last, which proposes nothing)."""
    return [SCHEDULES[stage.schedule](stage.gamma) for stage in config.stages[:-1]] + [None]


TRANSLATED_TOKENS = 2
"""How many times the target's token count a cross-tokenizer draft's cache holds: its tokenizer may
spell the same text in more tokens (SmolLM2's tokenizer spells what Qwen2.5's does in 1.04-1.11x
as many: lcet10, plrabn12, requests' sessions.py)."""

PREFILL_CHUNKS = {"cpu": 1024, "cuda": 4096}
"""``prefill_chunk`` where the config leaves it null, by device type (see ``PipelineConfig``)."""


def build_runtime(config: PipelineConfig) -> Runtime:
    device = pick_device()
    if config.prefill_chunk is None:
        config = config.model_copy(update={"prefill_chunk": PREFILL_CHUNKS[device.type]})
    target_path = model_path(config.target, "target")
    uses_draft = any(stage.model == "draft" for stage in config.stages)
    draft_path = model_path(config.draft, "draft", target_path) if uses_draft or config.draft.path is not None else None
    # after the models are found: the dtype and a process's first pass options build the CPU kernels (minutes, once)
    dtype = resolve_dtype(config.dtype, device)
    options = pass_options(config.kernels, config.attention, device, dtype)
    target = read_model(target_path, config.target, dtype, device, options)
    prepare_weights(target, config.target, "target", dtype, device)
    draft, translation = None, None
    if draft_path is not None:
        draft = read_model(draft_path, config.draft, dtype, device, options)
        proposable = None
        if config.draft.cross_tokenizer:
            translation = Translation.between(draft.tokenizer, target.tokenizer, target.model.spec.vocab_size)
            translation.on(device)
            proposable = translation.draft_ids
        else:
            check_same_vocabulary(target, draft)
        prepare_weights(draft, config.draft, "draft", dtype, device, proposable)
    for loaded in (target, draft):
        if loaded is not None and options.fused_tokens:
            warm_up(loaded.model)
    models = {"target": (target, config.target), "draft": (draft, config.draft)}
    prompt_caches = {
        role: prompt_cache(config, loaded, model_config)
        for role, (loaded, model_config) in models.items()
        if loaded and config.prompt_cache.dir
    }
    capture = cuda_graph if device.type == "cuda" and config.cuda_graphs else None
    return Runtime(config, target, draft, prompt_caches, capture, translation=translation)


def warm_up(model: CausalLM) -> None:
    """Run a few fused passes on a throwaway cache, so that compiling the fused kernels (seconds,
    once per process) happens at load and is never timed as a step of a generation (the cost
    model would take it for the verifier's step cost): one-token passes and, where wider passes
    run fused, two-token ones (one compiled graph serves every width above one). The cache is
    larger than what it holds, as real ones are, or the kernels would be specialised to a fully
    used buffer's strides. Where Inductor cannot build them (no compiler or headers for Triton's
    launcher, say), the model runs its passes eagerly and the log says why."""
    cache = FullCache(model.cache_layout(capacity=16))
    try:
        for width in (1, 2) if model.fused_tokens > 1 else (1,):
            for _ in range(3):
                model(torch.zeros(1, width, dtype=torch.long, device=model.device), cache, num_logits=width)
                cache.commit(cache.length)
    except Exception as error:  # Inductor's and Triton's build failures come in many exception types
        model.run_eagerly()
        first_line = next(iter(str(error).splitlines()), "")
        logger.warning(
            f"compiling the fused kernels failed ({type(error).__name__}: {first_line}); "
            "short passes run eagerly (kernels: eager)"
        )


def prompt_cache(config: PipelineConfig, loaded: LoadedModel, model_config: ModelConfig) -> PromptCache:
    """The store of ``loaded``'s prefilled prompts, keyed by everything that decides them."""
    model = loaded.model
    settings = {
        "dtype": str(model.dtype),
        "device": model.device.type,
        "fused_tokens": model.fused_tokens,
        "attention": model.attention,
        "rope_scaling": model_config.rope_scaling.model_dump() if model_config.rope_scaling else None,
        "quantise": quantisation(model),
        **({"int4_group": model_config.int4_group} if model_config.int4_group != 32 else {}),  # (as below)
        "frequent_tokens": model_config.frequent_tokens,  # the stored last logits are the kept tokens'
        **({"cross_tokenizer": True} if model_config.cross_tokenizer else {}),  # (keys stored before stay)
    }
    return PromptCache(
        Path(config.prompt_cache.dir).expanduser(),
        model_key(loaded.path, settings),
        int(config.prompt_cache.max_gb * 2**30),
    )


def pass_options(kernels: str, attention: str, device: torch.device, dtype: torch.dtype) -> PassOptions:
    """The pass options of models run with the config's ``kernels`` and ``attention`` here."""
    fused_tokens = fused_tokens_for(device, dtype) if kernels == "compiled" else 0
    return PassOptions(fused_tokens, resolve_kernels(attention, device))


def fused_tokens_for(device: torch.device, dtype: torch.dtype) -> int:
    """The longest pass the compiled kernels of ``cascade.fused`` take on ``device`` (0 where
    Inductor cannot build them): on CUDA (Triton) every pass the graphs capture,
    ``MAX_GRAPH_TOKENS``; on CPU (C++) as many for bf16 weights where cascade's weight kernel runs
    (a pass of a few tokens then reads each weight once), else one token."""
    if device.type == "cuda":
        if importlib.util.find_spec("triton") is None:
            logger.warning("Triton is not installed: short passes run eagerly (kernels: eager)")
            return 0
        return MAX_GRAPH_TOKENS
    if device.type != "cpu":
        return 0
    if not has_cxx_compiler():
        logger.warning("no C++ compiler found: one-token passes run eagerly (kernels: eager), about half as fast")
        return 0
    return MAX_GRAPH_TOKENS if dtype == torch.bfloat16 and fused.use_cpu_kernels() else 1


def model_path(config: ModelConfig, role: str, target: Path | None = None) -> Path:
    """``config``'s checkpoint directory, or the role's default (for a draft: the default for
    ``target``), fetched if it is not provisioned yet."""
    return checkpoint_path(config.path) if config.path else default_model(role, target=target)


def read_model(
    path: Path, config: ModelConfig, dtype: torch.dtype, device: torch.device, options: PassOptions
) -> LoadedModel:
    """The checkpoint at ``path`` as stored: ``prepare_weights`` then makes its weights what
    ``config`` asks."""
    scaling = config.rope_scaling.model_dump() if config.rope_scaling else None
    return load_checkpoint(path, dtype, device, scaling, options)


def prepare_weights(
    loaded: LoadedModel,
    config: ModelConfig,
    role: str,
    dtype: torch.dtype,
    device: torch.device,
    proposable: torch.Tensor | None = None,
) -> None:
    """The output projection cut to the tokens the model may propose (its ``frequent_tokens``, of
    the ``proposable`` ones [K] if given: a cross-tokenizer draft's shared tokens), int8 or 4-bit weights if
    the config asks, bf16 ones packed in panels where cascade's AVX2 kernel takes them (``cascade.panels``),
    and the weights moved into huge pages."""
    kept = None if config.frequent_tokens is None else frequent_output(loaded, config.frequent_tokens, role)
    if proposable is not None:
        proposable = proposable.to(loaded.model.device)
        kept = proposable if kept is None else kept[torch.isin(kept, proposable)]
    if kept is not None:
        loaded.model.keep_output_tokens(kept)
    bits = weight_bits(config.quantise, dtype, device)
    if bits is not None:
        quantise(loaded.model, bits, config.int4_group)
    if panels.applies(loaded.model):
        panels.pack_panels(loaded.model)
    move_to_huge_pages(loaded.model)


def frequent_output(loaded: LoadedModel, count: int, role: str) -> torch.Tensor:
    """The ``count`` most frequent tokens of ``loaded``'s vocabulary (``frequent_tokens``) [count]."""
    vocab_size = loaded.model.spec.vocab_size
    if count > vocab_size:
        raise CascadeError(
            f"{role}.frequent_tokens: {count} is more than the {vocab_size} tokens of {loaded.path}; "
            f"use at most {vocab_size}, or null to keep every token"
        )
    return frequent_tokens(loaded.tokenizer, vocab_size, count).to(loaded.model.device)


def weight_bits(setting: str, dtype: torch.dtype, device: torch.device) -> int | None:
    """The weight width (8 or 4 bits) a model whose config says ``quantise: setting`` gets here, None
    for its weights as loaded."""
    if setting == "auto":
        return 8 if device.type == "cpu" and dtype == torch.bfloat16 and kernels.quantised_kernels_available() else None
    return {"int8": 8, "int4": 4}.get(setting)


def check_same_vocabulary(target: LoadedModel, draft: LoadedModel) -> None:
    """Speculation compares token ids, so both models must map ids to the same strings."""
    target_vocab, draft_vocab = target.tokenizer.get_vocab(), draft.tokenizer.get_vocab()
    if target_vocab == draft_vocab and target.model.spec.vocab_size == draft.model.spec.vocab_size:
        return
    differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()), key=lambda item: item[1])
    example = f"; e.g. {differing[0][0]!r} -> id {differing[0][1]} in only one of them" if differing else ""
    raise CascadeError(
        f"the draft ({draft.path}, {len(draft_vocab)} tokens, {draft.model.spec.vocab_size} logits) "
        f"and the target ({target.path}, {len(target_vocab)} tokens, "
        f"{target.model.spec.vocab_size} logits) have different vocabularies{example}; "
        "use a draft with the target's tokenizer, or set draft.cross_tokenizer: true to draft among "
        "the tokens both share"
    )


def has_cxx_compiler() -> bool:
    return shutil.which("c++") is not None or shutil.which("g++") is not None
