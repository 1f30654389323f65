"""``from cascade import LLM``: a preset's models loaded once, then generate, stream and chat from Python."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from cascade.batch import BatchRequest, generate_batch
from cascade.completion import FINISH_REASONS, Completion, IncrementalText, Stream, TextCallback
from cascade.errors import CascadeError
from cascade.home import pass_costs_dir, prompt_cache_dir
from cascade.lockstep import JoiningBatch, generate_together
from cascade.pipeline import GenerationResult, TokenCallback
from cascade.runtime import Runtime, build_runtime
from cascade.stop_strings import StopStrings
from configs import PipelineConfig, SamplingConfig, StageConfig, load_config

Prompt = str | Sequence[int]
"""Text (encoded with the target's tokenizer) or token ids."""
Messages = Sequence[Mapping[str, Any]]
"""A chat: ``{"role": ..., "content": ...}`` dicts, put into the target's chat template."""

CHAT_ROLES = ("system", "user", "assistant", "tool")

logger = logging.getLogger(__name__)

BatchGenerator = Callable[[Runtime, list[BatchRequest]], list[GenerationResult]]
"""``cascade.batch.generate_batch`` or ``cascade.lockstep.generate_together``."""


@dataclass(frozen=True)
class Request:
    """One generation, checked and encoded (``LLM.prepare``)."""

    prompt_ids: list[int]
    max_new_tokens: int
    sampling: SamplingConfig
    seed: int
    stop_strings: StopStrings | None
    ignore_eos: bool = False
    """Make exactly ``max_new_tokens`` (measurements), unless a stop string ends it first."""


class LLM:
    """A preset's models, loaded once; its generations run one at a time, in the order they ask.

    ``LLM(preset, target, draft, dtype, config=FILE, **overrides)``: ``preset`` names one of
    ``configs/presets`` (default ``self-spec``) or ``config`` gives a YAML file; ``target`` and
    ``draft`` are catalog names (``python -m cascade.models list``) or checkpoint directories;
    ``overrides`` are the CLI's ``--set`` settings, dotted (``**{"stages.0.gamma": 4}``) or with
    ``__`` for the dots (``sampling__temperature=0.7``). A bad setting raises ``ValueError`` with the
    CLI's message. Prompts are reused (``reuse_prompts``): a prompt that begins as an earlier one did
    (a document asked another question) prefills only what follows the shared passes, from the
    prompt cache (``prompt_cache.dir``, by default ``$CASCADE_HOME/prompt-cache``), and the passes'
    costs are kept for later processes (``pass_costs_dir``, by default ``$CASCADE_HOME/pass-costs``).

    >>> llm = LLM("speculative", target="qwen2.5-coder-1.5b-instruct")
    >>> llm.generate("def quicksort(items):", max_new_tokens=64).text
    """

    def __init__(
        self,
        preset: str | None = None,
        target: str | Path | None = None,
        draft: str | Path | None = None,
        dtype: str | None = None,
        *,
        config: str | Path | None = None,
        reuse_prompts: bool = True,
        **overrides: Any,
    ) -> None:
        settings = {key.replace("__", "."): value for key, value in overrides.items()}
        models = {"target.path": target, "draft.path": draft, "dtype": dtype}
        settings |= {key: str(value) for key, value in models.items() if value is not None}
        name, pipeline_config = load_config(preset, Path(config) if config else None, (), settings)
        pipeline_config = with_kept_pass_costs(pipeline_config)
        self._load(name, with_prompt_cache(pipeline_config) if reuse_prompts else pipeline_config)

    @classmethod
    def from_config(cls, config: PipelineConfig, name: str = "config") -> LLM:
        """An LLM for a validated config (``configs.load_config``'s), called ``name``."""
        llm = cls.__new__(cls)
        llm._load(name, config)
        return llm

    def _load(self, name: str, config: PipelineConfig, runtime: Runtime | None = None) -> None:
        """Run ``config`` on ``runtime`` (its models already loaded), else on models loaded for it."""
        self.name = name
        self.config = config
        self.runtime = runtime or build_runtime(config)
        self._turn = FifoLock()
        self._joining: JoiningBatch | None = None

    @property
    def tokenizer(self):
        return self.runtime.tokenizer

    def on_stages(self, stages: list[StageConfig], name: str) -> LLM:
        """An LLM that runs ``stages`` on this one's loaded models and prompt caches (their weights
        are not loaded again: the same memory), called ``name``."""
        loaded = self.runtime
        config = loaded.config.model_copy(update={"stages": stages})
        twin = LLM.__new__(LLM)
        twin._load(name, config, Runtime(config, loaded.target, loaded.draft, loaded.prompt_caches, loaded.capture))
        return twin

    def generate(
        self, prompt: Prompt | Sequence[Prompt], *, batch_size: int | None = None, **params: Any
    ) -> Completion | list[Completion]:
        """Complete ``prompt``, or each of a list of prompts (a list of Completions, in order).

        ``params``: ``max_new_tokens``, ``temperature``, ``top_p``, ``top_k``, ``seed`` (each
        defaulting to the config's), ``stop`` (strings that end the generation where its text
        completes one; the text stops before it) and ``ignore_eos`` (go on past end-of-sequence).
        A list is decoded as batches of ``batch_size`` prompts (all of them by default; see
        ``run_batch``); a prompt of it that cannot run (empty, too long, bad ids) gets a Completion
        with ``finish_reason`` ``error`` saying why, and the others run. Settings that are wrong for
        every prompt raise."""
        if is_prompt_list(prompt):
            return self._generate_list(prompt, batch_size, params)
        return self.run(self.prepare(prompt, **params))

    def _generate_list(self, prompts: Sequence[Prompt], batch_size: int | None, params: dict) -> list[Completion]:
        self.prepare([0], **params)  # the settings every prompt shares, checked once: they raise
        requests: list[Request | Completion] = []
        for prompt in prompts:
            try:
                requests.append(self.prepare(prompt, **params))
            except CascadeError as exc:
                requests.append(Completion.failed(str(exc)))
        done = iter(self.run_batch([r for r in requests if isinstance(r, Request)], batch_size))
        return [next(done) if isinstance(r, Request) else r for r in requests]

    def stream(self, prompt: Prompt, **params: Any) -> Stream:
        """Generate in the background; iterate the Stream for text deltas as tokens are accepted."""
        return self._stream(self.prepare(prompt, **params))

    def chat(self, messages: Messages, **params: Any) -> Completion:
        """The assistant's reply to ``messages``, through the target's chat template."""
        return self.run(self.prepare(messages, chat=True, **params))

    def stream_chat(self, messages: Messages, **params: Any) -> Stream:
        """``chat``, streamed as ``stream`` does."""
        return self._stream(self.prepare(messages, chat=True, **params))

    def _stream(self, request: Request) -> Stream:
        return Stream(lambda on_text, cancelled: self.run(request, on_text, cancelled))

    def prepare(
        self,
        prompt: Prompt | Messages,
        *,
        chat: bool = False,
        max_new_tokens: int | None = None,
        temperature: float | None = None,
        top_p: float | None = None,
        top_k: int | None = None,
        seed: int | None = None,
        stop: str | Sequence[str] | None = None,
        ignore_eos: bool = False,
    ) -> Request:
        """``prompt`` encoded and every parameter checked (a ``ValueError`` says what is wrong)."""
        prompt_ids = self.encode_chat(prompt) if chat else self.encode(prompt)
        max_new_tokens = self.config.max_new_tokens if max_new_tokens is None else max_new_tokens
        if not isinstance(max_new_tokens, int) or max_new_tokens < 1:
            raise CascadeError(f"max_new_tokens: must be a whole number of at least 1; got {max_new_tokens!r}")
        given = {"temperature": temperature, "top_p": top_p, "top_k": top_k}
        sampling = checked_sampling(self.config.sampling, {k: v for k, v in given.items() if v is not None})
        seed = self.config.seed if seed is None else seed
        if not isinstance(seed, int) or not 0 <= seed < 2**64:
            raise CascadeError(f"seed: must be a whole number from 0 to 2**64 - 1; got {seed!r}")
        stop_strings = StopStrings(self.tokenizer, stop) if stop else None
        self.runtime.check_request(len(prompt_ids), max_new_tokens, log_skips=False)  # logged as it runs
        return Request(prompt_ids, max_new_tokens, sampling, seed, stop_strings, ignore_eos)

    def join_concurrent(self, max_sequences: int) -> None:
        """From now on a generation asked for (``run``, from any thread) while others run joins their
        batch (``cascade.lockstep.JoiningBatch``), at most ``max_sequences`` at once; 1: each waits for
        the ones before it (the default). Each still gets the tokens it would alone."""
        if not isinstance(max_sequences, int) or max_sequences < 1:
            raise CascadeError(f"max_sequences: must be a whole number of at least 1; got {max_sequences!r}")
        if max_sequences > 1 and not self.runtime.target.model.shares_passes:
            logger.warning("joined generations share no passes here (no CPU kernels): they only take turns")
        self._joining = JoiningBatch(self.runtime, self._turn, max_sequences) if max_sequences > 1 else None

    def run(
        self, request: Request, on_text: TextCallback | None = None, cancelled: threading.Event | None = None
    ) -> Completion:
        """Generate ``request`` (after the generations that asked first, or in their batch after
        ``join_concurrent``); ``on_text`` receives each text delta; setting ``cancelled`` stops the
        generation after its current round."""
        text = IncrementalText(self.tokenizer, request.stop_strings)

        def on_tokens(tokens: list[int]) -> None:
            if (delta := text.add(tokens)) and on_text:
                on_text(delta)

        if self._joining is not None:
            result = self._joining.generate(self._batch_request(request, on_tokens, cancelled))
        else:
            with self._turn:
                result = self.runtime.generate(
                    request.prompt_ids,
                    request.max_new_tokens,
                    on_tokens,
                    stop_at_eos=not request.ignore_eos,
                    sampling=request.sampling,
                    seed=request.seed,
                    stop_strings=request.stop_strings,
                    cancelled=cancelled,
                )
        if (delta := text.finish()) and on_text:
            on_text(delta)
        return completion_of(request, text, result)

    def run_batch(self, requests: Sequence[Request], batch_size: int | None = None) -> list[Completion]:
        """Generate ``requests`` -> their Completions, in order, ``batch_size`` of them at a time (all
        by default) together: autoregressively, each step one pass of every unfinished one
        (``cascade.batch``); speculating, each runs its own pipeline and the passes they run at the
        same time share each read of a model's weights (``cascade.lockstep``), where the target's
        passes can (cascade's CPU kernels; elsewhere one request after another). Each gets the tokens
        it would alone."""
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise CascadeError(f"batch_size: must be a whole number of at least 1; got {batch_size!r}")
        speculating = len(self.runtime.config.stages) > 1
        if speculating and not self.runtime.target.model.shares_passes:
            return [self.run(request) for request in requests]
        size = batch_size or max(len(requests), 1)
        generate = generate_together if speculating else generate_batch
        return [
            done
            for first in range(0, len(requests), size)
            for done in self._decode_together(requests[first : first + size], generate)
        ]

    def _decode_together(self, requests: Sequence[Request], generate: BatchGenerator) -> list[Completion]:
        texts = [IncrementalText(self.tokenizer, request.stop_strings) for request in requests]
        batch = [self._batch_request(request, text.add) for request, text in zip(requests, texts, strict=True)]
        with self._turn:
            results = generate(self.runtime, batch)
        for text in texts:
            text.finish()
        return [completion_of(*done) for done in zip(requests, texts, results, strict=True)]

    def _batch_request(
        self, request: Request, on_tokens: TokenCallback, cancelled: threading.Event | None = None
    ) -> BatchRequest:
        stop = self.runtime.stop_rule(
            request.max_new_tokens, not request.ignore_eos, stop_strings=request.stop_strings, cancelled=cancelled
        )
        return BatchRequest(request.prompt_ids, stop, request.sampling, request.seed, on_tokens)

    def encode(self, prompt: Prompt) -> list[int]:
        """Token ids of ``prompt`` (text, or ids checked against the vocabulary)."""
        if isinstance(prompt, str):
            if not prompt.strip():
                raise CascadeError("the prompt is empty: give some text")
            return self.tokenizer.encode(prompt)
        ids = list(prompt)
        vocab_size = self.runtime.target.model.spec.vocab_size
        if not ids:
            raise CascadeError("the prompt is empty: give some text or token ids")
        if not all(isinstance(token, int) and 0 <= token < vocab_size for token in ids):
            bad = next(t for t in ids if not (isinstance(t, int) and 0 <= t < vocab_size))
            raise CascadeError(f"the prompt's token ids must be whole numbers from 0 to {vocab_size - 1}; got {bad!r}")
        return ids

    def encode_chat(self, messages: Messages) -> list[int]:
        """Token ids of ``messages`` in the target's chat template, ending where the assistant's reply begins."""
        if not self.tokenizer.chat_template:
            raise CascadeError(f"the target ({self.runtime.target.path}) has no chat template; give a plain prompt")
        if isinstance(messages, str | bytes) or not messages:
            raise CascadeError('a chat is a non-empty list of {"role": ..., "content": ...} messages')
        for index, message in enumerate(messages):
            if not isinstance(message, Mapping) or message.get("role") not in CHAT_ROLES:
                raise CascadeError(f"messages[{index}]: needs a role, one of {', '.join(CHAT_ROLES)}; got {message!r}")
            if not isinstance(message.get("content"), str):
                raise CascadeError(f"messages[{index}].content: must be text; got {message.get('content')!r}")
        text = self.tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=False)
        return self.tokenizer.encode(text, add_special_tokens=False)


def completion_of(request: Request, text: IncrementalText, result: GenerationResult) -> Completion:
    """The Completion of ``request``'s finished generation (``text``: its decoded tokens)."""
    reason = FINISH_REASONS[result.stats.stop_reason]
    return Completion(text.text, result.token_ids, request.prompt_ids, reason, result.stats.to_dict())


def with_kept_pass_costs(config: PipelineConfig) -> PipelineConfig:
    """``config`` keeping its requests' pass costs for later processes (``cascade.cost_store``): in its
    ``pass_costs_dir``, else the default one."""
    if config.pass_costs_dir is not None:
        return config
    return config.model_copy(update={"pass_costs_dir": str(pass_costs_dir())})


def with_prompt_cache(config: PipelineConfig) -> PipelineConfig:
    """``config`` storing and reusing prefilled prompts: in its ``prompt_cache.dir``, else the default one."""
    if config.prompt_cache.dir is not None:
        return config
    cache = config.prompt_cache.model_copy(update={"dir": str(prompt_cache_dir())})
    return config.model_copy(update={"prompt_cache": cache})


def is_prompt_list(prompt: Any) -> bool:
    """Whether ``prompt`` is several prompts (texts or id lists) rather than one."""
    return not isinstance(prompt, str) and bool(prompt) and all(not isinstance(p, int) for p in prompt)


def checked_sampling(base: SamplingConfig, given: dict[str, Any]) -> SamplingConfig:
    """``base`` with ``given`` settings, validated as the config's ``sampling`` is."""
    try:
        return SamplingConfig.model_validate(base.model_dump() | given)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors())
        raise CascadeError(problems) from None


class FifoLock:
    """A lock granted in the order it was asked for (``threading.Lock`` promises no order)."""

    def __init__(self) -> None:
        self._condition = threading.Condition()
        self._next_ticket = 0
        self._serving = 0

    def __enter__(self) -> None:
        with self._condition:
            ticket, self._next_ticket = self._next_ticket, self._next_ticket + 1
            self._condition.wait_for(lambda: self._serving == ticket)

    def __exit__(self, *exc_info: object) -> None:
        with self._condition:
            self._serving += 1
            self._condition.notify_all()
