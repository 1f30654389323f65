"""Summarize one document with an LLM, within its context: whole, truncated, or map-reduced."""

from __future__ import annotations

from dataclasses import dataclass, field

from cascade.errors import CascadeError
from cascade.llm import LLM, Request
from cascade.summarize.prompts import COMBINE_TEMPLATE, PART_TEMPLATE, PromptBuilder


@dataclass
class SummaryStats:
    """Totals over every generation a document took (one, or the parts and the combination)."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    generations: int = 0
    dropped_tokens: int = 0
    """Document tokens a truncation left out."""
    proposed: dict[str, int] = field(default_factory=dict)
    accepted: dict[str, int] = field(default_factory=dict)

    def add(self, stats: dict) -> None:
        """Count one generation's ``Completion.stats``."""
        self.prompt_tokens += stats["prompt_tokens"]
        self.new_tokens += stats["new_tokens"]
        self.prefill_s += stats["prefill_s"]
        self.decode_s += stats["decode_s"]
        self.generations += 1
        for stage in stats["stages"][:-1]:
            self.proposed[stage["name"]] = self.proposed.get(stage["name"], 0) + stage["proposed"]
            self.accepted[stage["name"]] = self.accepted.get(stage["name"], 0) + stage["accepted"]

    def to_dict(self) -> dict:
        decoded = self.new_tokens - self.generations  # each generation's first token comes with its prefill
        return {
            "prompt_tokens": self.prompt_tokens,
            "new_tokens": self.new_tokens,
            "tokens_per_s": round(decoded / self.decode_s, 3) if self.decode_s > 0 else 0.0,
            "prefill_s": round(self.prefill_s, 3),
            "decode_s": round(self.decode_s, 3),
            "generations": self.generations,
            "dropped_tokens": self.dropped_tokens,
            "acceptance": {
                name: round(self.accepted[name] / count, 4) if count else None for name, count in self.proposed.items()
            },
        }


@dataclass
class Summary:
    text: str
    stats: SummaryStats
    note: str = ""
    """What was done to fit the document (truncation, map-reduce), if anything."""


@dataclass
class SinglePrompt:
    """A document summarized by one generation (whole, or truncated to fit)."""

    request: Request
    """Its prompt, checked (``LLM.prepare``)."""
    stats: SummaryStats
    note: str = ""


class Summarizer:
    def __init__(self, llm: LLM, template: str, max_new_tokens: int, batch_size: int = 1) -> None:
        self.llm = llm
        self.template = template
        self.max_new_tokens = max_new_tokens
        self.batch_size = batch_size
        """Generations decoded together (``LLM.run_batch``: every preset, where the CPU kernels share passes)."""
        self.long_documents = llm.config.long_documents
        self.prompts = PromptBuilder(llm.tokenizer)

    def room(self, template: str) -> int:
        """Document tokens that fit with ``template`` and the new tokens in the context."""
        limit = self.llm.runtime.context_limit()
        room = limit - self.max_new_tokens - self.prompts.overhead(template)
        if room < 1:
            raise CascadeError(
                f"max-new-tokens ({self.max_new_tokens}) and the template "
                f"({self.prompts.overhead(template)} tokens) leave no room for a document in "
                f"the {limit}-token context; lower --max-new-tokens"
            )
        return room

    def summarize_many(self, texts: list[str]) -> list[Summary | CascadeError]:
        """Each text's summary, or the error that left it without one, in order: the documents that
        fit (whole or truncated) decoded together, those map-reduced one after another (each one's
        parts together)."""
        results: list[Summary | CascadeError | None] = [None] * len(texts)
        single: dict[int, SinglePrompt] = {}
        for index, text in enumerate(texts):
            try:
                ids = self.prompts.encode(text)
                plan = self.single_prompt(ids)
                if plan is None:
                    results[index] = self.map_reduced(ids, SummaryStats())
                else:
                    single[index] = plan
            except CascadeError as exc:
                results[index] = exc
        summaries = self.generate_many(
            [plan.request for plan in single.values()], [plan.stats for plan in single.values()]
        )
        for (index, plan), text in zip(single.items(), summaries, strict=True):
            results[index] = Summary(text, plan.stats, plan.note)
        return results

    def single_prompt(self, ids: list[int]) -> SinglePrompt | None:
        """The one prompt that summarizes document ``ids`` (whole, or truncated by the config's
        long-document strategy), or None where it is to be map-reduced."""
        stats = SummaryStats()
        room = self.room(self.template)
        if len(ids) <= room:
            return SinglePrompt(self.request(self.template, ids), stats)
        if self.long_documents.strategy != "truncate":
            return None
        head = max(1, round(room * self.long_documents.head_share))
        kept = ids[:head] + ids[len(ids) - (room - head) :]  # [room] head, then tail
        stats.dropped_tokens = len(ids) - room
        note = (
            f"truncated: kept the first {head} and last {room - head} of {len(ids)} tokens, "
            f"dropped {stats.dropped_tokens} ({stats.dropped_tokens / len(ids):.0%})"
        )
        return SinglePrompt(self.request(self.template, kept), stats, note)

    def request(self, template: str, document_ids: list[int]) -> Request:
        """The generation that summarizes ``document_ids`` with ``template``, checked."""
        return self.llm.prepare(self.prompts.ids(template, document_ids), max_new_tokens=self.max_new_tokens)

    def generate_many(self, requests: list[Request], stats: list[SummaryStats]) -> list[str]:
        """Each request's completion text (``batch_size`` decoded together), counted in its ``stats``."""
        completions = self.llm.run_batch(requests, self.batch_size) if requests else []
        for completion, counted in zip(completions, stats, strict=True):
            counted.add(completion.stats)
        return [completion.text.strip() for completion in completions]

    def map_reduced(self, ids: list[int], stats: SummaryStats, depth: int = 0) -> Summary:
        chunk = min(self.long_documents.chunk_tokens or self.room(PART_TEMPLATE), self.room(PART_TEMPLATE))
        pieces = [self.request(PART_TEMPLATE, ids[start : start + chunk]) for start in range(0, len(ids), chunk)]
        parts = self.generate_many(pieces, [stats] * len(pieces))
        combined = self.prompts.encode("\n\n".join(f"Part {i + 1}: {part}" for i, part in enumerate(parts)))
        note = f"map-reduce: {len(parts)} parts of up to {chunk} tokens" + (f" (level {depth + 1})" if depth else "")
        if len(combined) > self.room(COMBINE_TEMPLATE):
            if len(combined) >= len(ids):
                raise CascadeError("the part summaries are no shorter than the document; lower --max-new-tokens")
            inner = self.map_reduced(combined, stats, depth + 1)
            return Summary(inner.text, stats, f"{note}; {inner.note}")
        [text] = self.generate_many([self.request(COMBINE_TEMPLATE, combined)], [stats])
        return Summary(text, stats, note)
