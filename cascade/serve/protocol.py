"""The OpenAI API's request bodies that the server accepts, validated (unknown parameters refused)."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

NEUTRAL = {
    "frequency_penalty": 0,
    "presence_penalty": 0,
    "logit_bias": None,
    "logprobs": None,
    "top_logprobs": None,
    "echo": False,
    "suffix": None,
    "best_of": 1,
    "n": 1,
}
"""OpenAI parameters the server takes only at the value that leaves the model's output as it is:
cascade returns the target's own distribution, one choice per prompt, no log-probabilities."""


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    include_usage: bool = False


class GenerationParameters(BaseModel):
    """What both endpoints share."""

    model_config = ConfigDict(extra="forbid")

    model: str
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    """Not in OpenAI's API; vLLM's and llama.cpp's servers take it too."""
    seed: int | None = Field(None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    n: int | None = None

    @model_validator(mode="after")
    def _only_neutral_extras(self) -> GenerationParameters:
        for name, neutral in NEUTRAL.items():
            value = getattr(self, name, neutral)
            if value is not None and value != neutral and value is not False:
                raise ValueError(
                    f"{name}={value!r} is not supported: cascade returns the target model's own output, "
                    f"one choice per prompt; leave {name} out or give {neutral!r}"
                )
        return self


class CompletionRequest(GenerationParameters):
    """``POST /v1/completions``."""

    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")
    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart]
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        """The message as chat templates take it (``developer`` is OpenAI's newer ``system``)."""
        text = self.content if isinstance(self.content, str) else "".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatRequest(GenerationParameters):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    """OpenAI's newer name for ``max_tokens``."""

    @property
    def new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens
