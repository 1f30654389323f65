"""Distillation data: the target's top-k next-token distribution over corpus text and its own continuations.

Each shard is a file of draft-sized windows (``tokens`` [N, W]) with the target's ``top_ids`` and
``top_logprobs`` [N, W, K] at every position. The target reads a longer chunk than the draft's window
(corpus chunks of ``chunk_tokens``), so its labels carry the context the draft will not see, as in
speculative decoding. Shards are written whole (temporary name, then rename) and a rerun skips the
ones present, so an interrupted labelling resumes where it stopped.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import torch

from cascade import atomic
from cascade.data import CORPORA, document_text

HELD_OUT = ("lcet10", "worked")
"""Documents the draft never trains on: its agreement and acceptance are measured on them."""


@dataclass(frozen=True)
class TeacherPlan:
    window: int = 256
    """Tokens the draft reads per training sequence (its streaming cache's size)."""
    chunk_tokens: int = 2048
    """Tokens the target reads per corpus chunk; the chunk is cut into draft windows."""
    tokens_per_corpus: int = 80_000
    """Corpus tokens labelled per corpus (chunks drawn at random, without repeats)."""
    continuation_prompts: int = 160
    """Prompts (draft windows of corpus text) the target continues, for text in its own style."""
    continuation_tokens: int = 128
    continuation_temperatures: tuple[float, ...] = (0.0, 0.6)
    top_k: int = 32
    batch_chunks: int = 4
    seed: int = 0


def training_documents() -> dict[str, list[str]]:
    """Corpus name -> its documents, held-out ones excluded."""
    return {name: [doc for doc in corpus.documents if doc not in HELD_OUT] for name, corpus in CORPORA.items()}


def corpus_chunks(tokenize: Callable[[str], list[int]], plan: TeacherPlan) -> list[list[int]]:
    """Up to ``tokens_per_corpus`` tokens from each corpus, as random whole chunks of ``chunk_tokens``."""
    rng = random.Random(plan.seed)
    chunks = []
    for documents in training_documents().values():
        candidates = []
        for name in documents:
            ids = tokenize(document_text(name))
            candidates += [ids[i : i + plan.chunk_tokens] for i in range(0, len(ids), plan.chunk_tokens)]
        candidates = [chunk for chunk in candidates if len(chunk) >= plan.window]
        rng.shuffle(candidates)
        budget = plan.tokens_per_corpus
        for chunk in candidates:
            if budget <= 0:
                break
            chunks.append(chunk)
            budget -= len(chunk)
    return chunks


def continuation_prompts(chunks: list[list[int]], plan: TeacherPlan) -> list[list[int]]:
    """``continuation_prompts`` windows of corpus text, each ``window - continuation_tokens`` long."""
    rng = random.Random(plan.seed + 1)
    length = plan.window - plan.continuation_tokens
    picked = rng.sample(chunks, min(plan.continuation_prompts, len(chunks)))
    return [chunk[start : start + length] for chunk in picked for start in [rng.randrange(0, len(chunk) - length + 1)]]


@torch.no_grad()
def label(target, chunk: torch.Tensor, plan: TeacherPlan) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Target top-k of ``chunk`` [B, T]: ids, log-probabilities [B, T, K] and final hidden states [B, T, D]."""
    out = target(chunk, output_hidden_states=True)
    logprobs = torch.log_softmax(out.logits.float(), dim=-1)  # [B, T, V]
    top = logprobs.topk(plan.top_k, dim=-1)
    return top.indices.int(), top.values.half(), out.hidden_states[-1].float()


def windows(tensor: torch.Tensor, window: int) -> torch.Tensor:
    """[B, T, ...] -> [B * (T // window), window, ...]: consecutive draft windows (a remainder dropped)."""
    count = tensor.shape[1] // window
    return tensor[:, : count * window].reshape(tensor.shape[0] * count, window, *tensor.shape[2:])


@torch.no_grad()
def continue_text(target, prompts: torch.Tensor, plan: TeacherPlan, temperature: float, seed: int) -> torch.Tensor:
    """[B, P] prompts -> [B, P + continuation_tokens]: the target's own continuations (no early EOS)."""
    torch.manual_seed(seed)
    sampling = (
        dict(do_sample=True, temperature=temperature, top_k=0, top_p=1.0) if temperature else {"do_sample": False}
    )
    return target.generate(
        prompts,
        attention_mask=torch.ones_like(prompts),
        max_new_tokens=plan.continuation_tokens,
        min_new_tokens=plan.continuation_tokens,
        **sampling,
    )


@dataclass(frozen=True)
class ShardJob:
    name: str
    make_tokens: Callable[[], torch.Tensor]
    """[B, T] token ids to label (generated lazily: continuations are the expensive part)."""


def shard_jobs(target, chunks: list[list[int]], plan: TeacherPlan) -> Iterator[ShardJob]:
    """Corpus shards (equal-length chunks batched), then one continuation shard per batch and temperature."""
    full = [chunk for chunk in chunks if len(chunk) == plan.chunk_tokens]
    for index in range(0, len(full), plan.batch_chunks):
        batch = torch.tensor(full[index : index + plan.batch_chunks])
        yield ShardJob(f"corpus-{index // plan.batch_chunks:05d}", lambda batch=batch: batch)
    prompts = continuation_prompts(chunks, plan)
    per_batch = plan.batch_chunks * plan.chunk_tokens // plan.window
    for t_index, temperature in enumerate(plan.continuation_temperatures):
        for index in range(0, len(prompts), per_batch):
            batch = torch.tensor(prompts[index : index + per_batch])
            seed = plan.seed + 1000 * t_index + index
            yield ShardJob(
                f"continuation-t{temperature:g}-{index // per_batch:05d}",
                lambda batch=batch, temperature=temperature, seed=seed: continue_text(
                    target, batch, plan, temperature, seed
                ),
            )


def write_shard(path: Path, tokens: torch.Tensor, target, plan: TeacherPlan) -> torch.Tensor:
    """Label ``tokens`` [B, T] and save its draft windows to ``path``; returns the hidden states [B, T, D]."""
    top_ids, top_logprobs, hidden = label(target, tokens, plan)
    shard = {
        "tokens": windows(tokens.int(), plan.window),
        "top_ids": windows(top_ids, plan.window),
        "top_logprobs": windows(top_logprobs, plan.window),
    }
    with atomic.replacing(path) as partial:
        torch.save(shard, partial)
    return hidden


def load_shards(directory: Path) -> dict[str, torch.Tensor]:
    """Every shard in ``directory`` concatenated: tokens [N, W], top_ids / top_logprobs [N, W, K]."""
    shards = [torch.load(path) for path in sorted(directory.glob("*.pt")) if path.name != HIDDEN_SAMPLE]
    if not shards:
        raise FileNotFoundError(f"no teacher shards in {directory}; label some first")
    return {key: torch.cat([shard[key] for shard in shards]) for key in shards[0]}


HIDDEN_SAMPLE = "hidden-sample.pt"
"""Final hidden states of the first corpus shard: the basis for the draft's embedding."""


def label_all(
    target, tokenize: Callable[[str], list[int]], out: Path, plan: TeacherPlan, progress: Callable[[str, int], None]
) -> None:
    """Write every shard of ``plan`` missing from ``out``; ``progress(name, tokens)`` after each."""
    out.mkdir(parents=True, exist_ok=True)
    for job in shard_jobs(target, corpus_chunks(tokenize, plan), plan):
        path = out / f"{job.name}.pt"
        if path.exists():
            progress(job.name, 0)
            continue
        tokens = job.make_tokens()
        hidden = write_shard(path, tokens, target, plan)
        if not (out / HIDDEN_SAMPLE).exists():
            torch.save(hidden.reshape(-1, hidden.shape[-1]).half(), out / HIDDEN_SAMPLE)
        progress(job.name, tokens.numel())
