"""Several generations of any preset at once, each exactly what it would be alone.

Each sequence runs a pipeline of its own (its stages and caches, gamma schedules, generator and stop
rule) in a thread of its own, and the threads take turns: in its turn a sequence runs until it
hands over its next model pass (``SharedModel``) or finishes. Once every unfinished sequence has
handed one over, the batch runs them: the passes of one model in one ``CausalLM.forward_batch``,
where those its CPU kernels take share each read of its weights. Then each sequence takes its
logits in its next turn. One thread runs at a time and a row of a shared pass computes what the
sequence's own pass would, bit for bit, so every sequence proposes, accepts (a ragged number of
tokens per round), rolls back, selects its chunks, bypasses a stage and stops as it would alone; a
sequence that finishes leaves the batch. Its timings are the batch's: a pass takes as long as the
shared pass it ran in, which is what its cost model should weigh.

Autoregressive decoding has a tighter loop of its own (``cascade.batch``).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass

import torch

from cascade.batch import BatchRequest, check_memory
from cascade.model import CausalLM, SequencePass
from cascade.pipeline import GenerationResult, Pipeline
from cascade.runtime import TRANSLATED_TOKENS, CacheRequest, Runtime, schedules_for
from configs.schema import PipelineConfig


@dataclass
class HandedPass:
    """A pass a sequence handed over, and what running it gave."""

    model: CausalLM
    sequence: SequencePass
    logits: torch.Tensor | None = None
    """[N, V] once run."""
    error: Exception | None = None


class Sequence:
    """One generation of the batch: its pipeline, run in its own thread, one turn at a time."""

    def __init__(self, request: BatchRequest, device: torch.device) -> None:
        self.request = request
        self.pipeline: Pipeline | None = None
        """Set once its stages are built (their models hand passes over to this sequence)."""
        self.device = device
        self.handed: HandedPass | None = None
        self.result: GenerationResult | None = None
        self.error: Exception | None = None
        self.finished = False
        self._turn = threading.Semaphore(0)
        self._paused = threading.Semaphore(0)
        self._thread = threading.Thread(target=self._generate, name="cascade-sequence", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def take_turn(self) -> None:
        """Let the sequence run until it hands over its next pass or finishes."""
        self._turn.release()
        self._paused.acquire()

    def join(self) -> None:
        self._thread.join()

    def hand_over(self, model: CausalLM, sequence: SequencePass) -> torch.Tensor:
        """In the sequence's thread: wait for the batch to run this pass -> its logits [N, V]."""
        self.handed = HandedPass(model, sequence)
        self._paused.release()
        self._turn.acquire()
        handed, self.handed = self.handed, None
        if handed.error is not None:
            raise handed.error
        return handed.logits

    def _generate(self) -> None:
        self._turn.acquire()
        request = self.request
        try:
            generator = torch.Generator(device=self.device).manual_seed(request.seed)
            prompt_ids = torch.tensor(request.prompt_ids, device=self.device)
            self.result = self.pipeline.generate(prompt_ids, request.stop, generator, request.on_tokens)
        except Exception as exc:  # this sequence's failure; the others go on
            self.error = exc
        finally:
            self.finished = True
            self._paused.release()


class SharedModel:
    """Stands in for ``model`` in one sequence's stages: each pass is handed over to the batch.
    Everything else is the model's."""

    def __init__(self, model: CausalLM, sequence: Sequence) -> None:
        self._model = model
        self._sequence = sequence

    def __call__(self, token_ids: torch.Tensor, cache, num_logits: int | None = None, tree=None) -> torch.Tensor:
        """``CausalLM.forward`` of one sequence: token_ids [1, T] -> logits [1, N, V]."""
        return self._sequence.hand_over(self._model, SequencePass(token_ids[0], cache, num_logits, tree))[None]

    def __getattr__(self, name: str):
        return getattr(self._model, name)


def generate_together(runtime: Runtime, requests: list[BatchRequest]) -> list[GenerationResult]:
    """``requests`` generated together on ``runtime``'s preset -> each one's result, in order.
    Refused up front if their caches would not fit in memory; a sequence that fails raises its
    error after the others have finished."""
    asked = [runtime.cache_request(len(request.prompt_ids), request.stop.max_new_tokens) for request in requests]
    device = runtime.target.model.device
    check_memory(sum(kv_bytes_bound(runtime, *request) for request in asked), len(requests), device)
    sequences = [
        sequence_for(runtime, request, *cache_request) for request, cache_request in zip(requests, asked, strict=True)
    ]
    for sequence in sequences:
        sequence.start()
    running = sequences
    while running:
        for sequence in running:
            sequence.take_turn()
        running = [sequence for sequence in running if not sequence.finished]
        run_passes([sequence.handed for sequence in running])
    for sequence in sequences:
        sequence.join()
    failed = next((sequence.error for sequence in sequences if sequence.error is not None), None)
    if failed is not None:
        raise failed
    return [sequence.result for sequence in sequences]


def kv_bytes_bound(runtime: Runtime, config: PipelineConfig, asked: CacheRequest) -> int:
    """At most the bytes of KV cache one sequence's stages hold: each as much as a full cache (a
    compact one holds less; a draft across tokenizers may spell the sequence in twice the tokens)."""
    spelled = {"target": 1, "draft": 1 if runtime.translation is None else TRANSLATED_TOKENS}
    layouts = {role: model.cache_layout(1) for role, model in runtime.models.items()}
    return sum(asked.capacity * spelled[stage.model] * layouts[stage.model].bytes_per_token for stage in config.stages)


def sequence_for(runtime: Runtime, request: BatchRequest, config: PipelineConfig, asked: CacheRequest) -> Sequence:
    """A sequence with stages of its own, whose models hand their passes over to the batch."""
    sequence = Sequence(request, runtime.target.model.device)
    models = {role: SharedModel(model, sequence) for role, model in runtime.models.items()}
    stages = runtime.build_stages(config, asked, schedules_for(config), models)
    sequence.pipeline = Pipeline(stages, request.sampling, config.prefill_chunk)
    return sequence


def run_passes(handed: list[HandedPass]) -> None:
    """Run the handed-over passes, those of one model in one ``forward_batch``; a pass that fails
    gives its error to every sequence of its call."""
    by_model: dict[int, list[HandedPass]] = {}
    for one in handed:
        by_model.setdefault(id(one.model), []).append(one)
    for group in by_model.values():
        try:
            logits = group[0].model.forward_batch([one.sequence for one in group])
        except Exception as exc:
            for one in group:
                one.error = exc
            continue
        for one, sequence_logits in zip(group, logits, strict=True):
            one.logits = sequence_logits
