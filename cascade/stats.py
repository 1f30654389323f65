"""Counters a generation run fills in; the pipeline records them, callers decide what to print."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass
class StageStats:
    name: str
    forward_calls: int = 0
    tokens_processed: int = 0
    time_s: float = 0.0
    kv_bytes_read: int = 0
    """KV bytes the stage's decode steps read (prefill excluded)."""


@dataclass
class GenerationStats:
    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    """Prompt processing plus choosing the first new token (time to first token)."""
    decode_s: float = 0.0
    """Every step after the first new token: new_tokens - 1 of them."""
    stop_reason: str = ""
    """"eos" or "max_new_tokens"."""
    stages: list[StageStats] = field(default_factory=list)

    @property
    def tokens_per_s(self) -> float:
        return (self.new_tokens - 1) / self.decode_s if self.decode_s > 0 else 0.0

    @property
    def ms_per_token(self) -> float:
        return 1000 / self.tokens_per_s if self.tokens_per_s else 0.0

    def to_dict(self) -> dict:
        data = asdict(self)
        data["tokens_per_s"] = self.tokens_per_s
        data["ms_per_token"] = self.ms_per_token
        return data
