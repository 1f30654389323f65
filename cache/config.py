"""Base class of every cache policy's config: strict, documented, and able to check a request."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict


class CachePolicyConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    def check_prompt(self, prompt_tokens: int) -> None:
        """Raise ValueError (with what is allowed) if this policy cannot serve such a prompt."""
