"""Several generations of any preset at once, each exactly what it would be alone.

Each sequence runs a pipeline of its own (its stages and caches, gamma schedules, generator and stop
rule) as a greenlet, and the sequences take turns in the one thread that drives the batch: in its
turn a sequence runs until it hands over its next model pass (``SharedModel``) or finishes. Once
every unfinished sequence has handed one over, the batch runs the passes of one model (the draft's
while any sequence waits on it, else the target's) in one ``CausalLM.forward_batch``, where those
its CPU kernels take share each read of its weights. The sequences whose passes ran take their
logits in their next turn; the others wait with theirs. So a sequence whose proposals end sooner (a
smaller gamma, a proposal ended in doubt, a bypassed draft) waits for the others' before the target
runs: the batch verifies together, and no tick reads both models' weights for different sequences.
So a sequence whose proposal has reached its gamma while others still draft may propose more in
their ticks at no cost in time (``Pipeline.draft_runs_anyway``): it asks in its turn, and once every
sequence has taken its turn the batch tells it whether the draft runs (adaptive schedules take the
offer where the token pays for its place in the verification, ``Schedule.extends``; a fixed gamma
never does). Qwen2.5-Coder 0.5B drafting for 1.5B at 8K, batch 4 on a 2-core Xeon with AMX: a row that
agreed on 0.74 of its proposals chose gamma 2 while another's chose 6-8, so it verified 31 times
where the other verified 19, and the batch ran at 0.91x batched autoregressive decoding. When a
sequence finishes, the others' pass costs (timed in the larger batch) are dropped
(``Pipeline.forget_pass_costs``): the last row of that batch, left alone, kept its draft bypassed
on verifications timed at batch 4 and stepped alone for 27 of its 49 passes.
A row of a shared pass computes what the sequence's own pass would, bit for bit, so every sequence
proposes, accepts (a ragged number of tokens per round), rolls back, selects its chunks, bypasses a
stage and stops as it would alone; a sequence that finishes leaves the batch. Its timings are the
batch's: a pass takes as long as the ticks from its handing over to its logits, waits included,
which is what its cost model should weigh. (Greenlets, not threads: torch work from several threads
would start an OpenMP team per thread, and a team whose region has ended spins on the cores the
next one needs: a SmolLM2 step at 8K took 26 ms against 18 ms.)

Autoregressive decoding has a tighter loop of its own (``cascade.batch``).
"""

from __future__ import annotations

import threading
from contextlib import AbstractContextManager
from dataclasses import dataclass

import torch
from greenlet import greenlet

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

    @property
    def ran(self) -> bool:
        return self.logits is not None or self.error is not None


class Sequence:
    """One generation of the batch: its pipeline, run as a greenlet that the thread driving the
    batch switches to for each of its turns."""

    def __init__(self, request: BatchRequest, device: torch.device) -> None:
        self.request = request
        self.device = device
        self.pipeline: Pipeline | None = None
        """Set once its stages are built (their models hand passes over to this sequence)."""
        self.handed: HandedPass | None = None
        self.result: GenerationResult | None = None
        self.error: Exception | None = None
        self.done = threading.Event()
        """Set once ``result`` or ``error`` is."""
        self.prefilled = False
        """Its prompt is in its caches and its first token emitted; its decoding has not begun."""
        self.asking = False
        """It waits in its turn to learn whether this tick runs the draft for other sequences."""
        self.draft_runs = False
        """The answer, once the others have taken their turns."""
        self._greenlet: greenlet | None = None

    @property
    def finished(self) -> bool:
        return self.done.is_set()

    @property
    def waiting(self) -> bool:
        """It has handed over a pass that the batch has not run yet."""
        return self.handed is not None and not self.handed.ran

    def take_turn(self) -> None:
        """In the thread driving the batch: run the sequence until it hands over its next pass, has
        prefilled (then it hands over none) or finishes (its first turn starts it)."""
        if self._greenlet is None:
            self._greenlet = greenlet(self._generate)
        self._greenlet.switch()

    def answer(self, draft_runs: bool) -> None:
        """In the thread driving the batch: tell the sequence that ``asking`` whether this tick runs
        the draft, and let it go on until it hands over its next pass or finishes."""
        self.draft_runs = draft_runs
        self._greenlet.switch()

    def draft_runs_anyway(self) -> bool:
        """In the sequence's turn (``Pipeline.draft_runs_anyway``): whether this tick runs the draft's
        passes for other sequences, told once they have all taken their turns."""
        self.asking = True
        self._greenlet.parent.switch()
        self.asking = False
        return self.draft_runs

    def hand_over(self, model: CausalLM, sequence: SequencePass) -> torch.Tensor:
        """In the sequence's turn: wait for the batch to run this pass -> its logits [N, V]."""
        self.handed = HandedPass(model, sequence)
        self._greenlet.parent.switch()
        handed, self.handed = self.handed, None
        if handed.error is not None:
            raise handed.error
        return handed.logits

    def _generate(self) -> None:
        request = self.request
        try:
            generator = torch.Generator(device=self.device).manual_seed(request.seed)
            prompt_ids = torch.tensor(request.prompt_ids, device=self.device)
            self.result = self.pipeline.generate(prompt_ids, request.stop, generator, self._emitted)
        except Exception as exc:  # this sequence's failure; the others go on
            self.error = exc
        finally:
            self.done.set()

    def _emitted(self, tokens: list[int]) -> None:
        """The pipeline emitted ``tokens``; after the first, the sequence pauses until its next turn,
        so that its decoding (and its decode time) begins after the other sequences' prefill."""
        if self.request.on_tokens is not None:
            self.request.on_tokens(tokens)
        if not self.prefilled:
            self.prefilled = True
            self._greenlet.parent.switch()


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
    """``requests`` generated together on ``runtime``'s preset -> each one's result, in order: every
    sequence prefills (its prefill chunks, too wide to share, run one by one), then they decode
    together, so no decode pass waits behind another's prefill and each one's decode time is the
    batch's decoding. Refused up front if their caches would not fit in memory; a sequence that
    fails raises its error after the others have finished."""
    asked = [runtime.cache_request(len(request.prompt_ids), request.stop.max_new_tokens) for request in requests]
    device = runtime.target.model.device
    needed = sum(kv_bytes_bound(runtime, *request) for request in asked)
    check_memory(needed, f"a batch of {len(requests)} sequences", device)
    sequences = [
        sequence_for(runtime, request, *cache_request) for request, cache_request in zip(requests, asked, strict=True)
    ]
    draft = runtime.models.get("draft")
    while prefilling := [sequence for sequence in sequences if not (sequence.prefilled or sequence.finished)]:
        tick(prefilling, draft)
    running = [sequence for sequence in sequences if not sequence.finished]
    while running:
        running = tick(running, draft)
    failed = next((sequence.error for sequence in sequences if sequence.error is not None), None)
    if failed is not None:
        raise failed
    return [sequence.result for sequence in sequences]


def tick(running: list[Sequence], draft: CausalLM | None) -> list[Sequence]:
    """The turn of every running sequence not waiting on a pass, then the waiting passes: the
    ``draft`` model's while any waits on it (they are the cheap ones, and a round's proposals come
    before its verification), else the others -> the sequences still running."""
    for sequence in running:
        if not sequence.waiting:
            sequence.take_turn()
    draft_runs = draft is not None and any(sequence.waiting and sequence.handed.model is draft for sequence in running)
    for sequence in running:
        if sequence.asking:
            sequence.answer(draft_runs)
    if (left := [sequence for sequence in running if not sequence.finished]) and len(left) < len(running):
        for sequence in left:  # their passes will cost what a smaller batch's do
            sequence.pipeline.forget_pass_costs()
    running = left
    waiting = [sequence.handed for sequence in running if sequence.waiting]
    if waiting:
        run_passes([one for one in waiting if one.model is draft] or waiting)
    return running


class JoiningBatch:
    """Generations asked for from several threads (a server's concurrent requests) join the batch
    that is running: a sequence starts at the next tick, at most ``max_sequences`` run at once (the
    later ones wait their turn in arrival order), and each leaves when it stops. The ticks run in a
    thread of their own, each while holding ``turn`` (the LLM's lock on its models)."""

    def __init__(self, runtime: Runtime, turn: AbstractContextManager, max_sequences: int) -> None:
        self.runtime = runtime
        self.turn = turn
        self.max_sequences = max_sequences
        self._arrived: list[Sequence] = []
        self._draft = runtime.models.get("draft")
        self._condition = threading.Condition()
        threading.Thread(target=self._drive, name="cascade-batch", daemon=True).start()

    def generate(self, request: BatchRequest) -> GenerationResult:
        """Generate ``request`` in the running batch (checked first: a request whose caches would not
        fit in the memory available now is refused) -> its result, once it has stopped."""
        config, asked = self.runtime.cache_request(len(request.prompt_ids), request.stop.max_new_tokens)
        needed = kv_bytes_bound(self.runtime, config, asked)
        check_memory(needed, "a generation joining the running batch", self.runtime.target.model.device)
        sequence = sequence_for(self.runtime, request, config, asked)
        with self._condition:
            self._arrived.append(sequence)
            self._condition.notify()
        sequence.done.wait()
        if sequence.error is not None:
            raise sequence.error
        return sequence.result

    def _drive(self) -> None:
        running: list[Sequence] = []
        while True:
            with self._condition:
                if not running:
                    self._condition.wait_for(lambda: self._arrived)
                room = self.max_sequences - len(running)
                joining, self._arrived = self._arrived[:room], self._arrived[room:]
            with self.turn:
                running = tick(running + joining, self._draft)


def kv_bytes_bound(runtime: Runtime, config: PipelineConfig, asked: CacheRequest) -> int:
    """At most the bytes of KV cache one sequence's stages hold: each as much as a full cache (a
    compact one holds less; a draft across tokenizers may spell the sequence in twice the tokens)."""
    spelled = {"target": 1, "draft": 1 if runtime.translation is None else TRANSLATED_TOKENS}
    layouts = {role: model.cache_layout(1) for role, model in runtime.models.items()}
    return sum(
        asked.capacity * spelled[stage.model] * layouts[stage.model].bytes_per_token
        for stage in config.stages
        if stage.model != "lookup"  # it keeps no KV
    )


def sequence_for(runtime: Runtime, request: BatchRequest, config: PipelineConfig, asked: CacheRequest) -> Sequence:
    """A sequence with stages of its own, whose models hand their passes over to the batch."""
    sequence = Sequence(request, runtime.target.model.device)
    models = {role: SharedModel(model, sequence) for role, model in runtime.models.items()}
    stages = runtime.build_stages(config, asked, schedules_for(config), models)
    sequence.pipeline = Pipeline(stages, request.sampling, config.prefill_chunk)
    sequence.pipeline.draft_runs_anyway = sequence.draft_runs_anyway
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
