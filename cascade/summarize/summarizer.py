"""Summarize one document with an LLM, within its context: whole, truncated, or map-reduced."""

from __future__ import annotations

from dataclasses import dataclass, field

from cascade.errors import CascadeError
from cascade.llm import LLM
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


class Summarizer:
    def __init__(self, llm: LLM, template: str, max_new_tokens: int) -> None:
        self.llm = llm
        self.template = template
        self.max_new_tokens = max_new_tokens
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

    def summarize(self, text: str) -> Summary:
        ids = self.prompts.encode(text)
        stats = SummaryStats()
        room = self.room(self.template)
        if len(ids) <= room:
            return Summary(self.generate(self.template, ids, stats), stats)
        if self.long_documents.strategy == "truncate":
            return self.truncated(ids, room, stats)
        return self.map_reduced(ids, stats)

    def generate(self, template: str, document_ids: list[int], stats: SummaryStats) -> str:
        prompt_ids = self.prompts.ids(template, document_ids)
        completion = self.llm.run(self.llm.prepare(prompt_ids, max_new_tokens=self.max_new_tokens))
        stats.add(completion.stats)
        return completion.text.strip()

    def truncated(self, ids: list[int], room: int, stats: SummaryStats) -> Summary:
        head = max(1, round(room * self.long_documents.head_share))
        kept = ids[:head] + ids[len(ids) - (room - head) :]  # [room] head, then tail
        stats.dropped_tokens = len(ids) - room
        note = (
            f"truncated: kept the first {head} and last {room - head} of {len(ids)} tokens, "
            f"dropped {stats.dropped_tokens} ({stats.dropped_tokens / len(ids):.0%})"
        )
        return Summary(self.generate(self.template, kept, stats), stats, note)

    def map_reduced(self, ids: list[int], stats: SummaryStats, depth: int = 0) -> Summary:
        chunk = min(self.long_documents.chunk_tokens or self.room(PART_TEMPLATE), self.room(PART_TEMPLATE))
        parts = [self.generate(PART_TEMPLATE, ids[start : start + chunk], stats) for start in range(0, len(ids), chunk)]
        combined = self.prompts.encode("\n\n".join(f"Part {i + 1}: {part}" for i, part in enumerate(parts)))
        note = f"map-reduce: {len(parts)} parts of up to {chunk} tokens" + (f" (level {depth + 1})" if depth else "")
        if len(combined) > self.room(COMBINE_TEMPLATE):
            if len(combined) >= len(ids):
                raise CascadeError("the part summaries are no shorter than the document; lower --max-new-tokens")
            inner = self.map_reduced(combined, stats, depth + 1)
            return Summary(inner.text, stats, f"{note}; {inner.note}")
        return Summary(self.generate(COMBINE_TEMPLATE, combined, stats), stats, note)
