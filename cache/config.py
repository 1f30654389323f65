"""Base class of every cache policy's config: strict, documented, and able to check a request."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class CachePolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    @classmethod
    def at_budget(cls, budget: int) -> CachePolicyConfig:
        """This policy holding ``budget`` tokens of KV: ablations compare policies at equal cost."""
        if "budget" not in cls.model_fields:
            raise ValueError(
                f"{cls.model_fields['kind'].default} caches have no token budget; these kinds have "
                f"one: {', '.join(budgeted_kinds())}"
            )
        return cls(budget=budget)

    def as_settings(self) -> dict:
        """``kind`` and the fields that differ from their defaults: a config that dotted settings
        can refine further (``refresh.every=16`` over a default ``refresh: never``)."""
        return {"kind": self.kind, **self.model_dump(exclude_defaults=True)}

    def rotary_positions(self, sequence_tokens: int) -> int:
        """How many rotary positions a model under this policy reads for a sequence of
        ``sequence_tokens`` tokens (at least: a round's pending tokens may add a few): the sequence's
        own positions, unless a policy places its tokens at their slots."""
        return sequence_tokens

    def within_positions(self, positions: int) -> tuple[str, str]:
        """How to make this policy read at most ``positions`` positions: (what that gives the
        stage, the cache setting that does it). Any policy: place tokens at their slots."""
        return "positions within its cache", "kind=streaming"

    def holds_every_prompt_token(self, prompt_tokens: int) -> bool:
        """Whether this policy's prefill of a ``prompt_tokens``-token prompt leaves every token's K/V
        at its own position, as a full cache's does: a stored prefill (the prompt cache) then serves it."""
        return False

    def check_prompt(self, prompt_tokens: int) -> None:
        """Raise ValueError (with what is allowed) if this policy cannot serve such a prompt.

        Policies with a token ``budget`` must be given a prompt longer than it: otherwise they
        keep everything and degenerate to the full cache.
        """
        budget = getattr(self, "budget", None)
        if budget is not None and budget >= prompt_tokens:
            raise ValueError(
                f"{self.kind} budget ({budget}) is not smaller than the prompt ({prompt_tokens} tokens): "
                "it would keep everything and degenerate to the full cache; use kind: full or a smaller budget"
            )


def budgeted_kinds() -> list[str]:
    """The registered kinds that can hold a given number of tokens (``at_budget``)."""
    from cache.registry import POLICIES  # the registry imports this module

    return sorted(
        kind
        for kind, entry in POLICIES.items()
        if "budget" in entry.config.model_fields or "at_budget" in vars(entry.config)
    )


def budget_for(share: float, prompt_tokens: int, granule: int = 16) -> int:
    """``share`` of a prompt's tokens as a token budget: a multiple of ``granule`` (whole chunks of
    every chunk size a retrieval cache is run with; the default, of its default 8), at least one."""
    return max(granule, round(share * prompt_tokens / granule) * granule)
