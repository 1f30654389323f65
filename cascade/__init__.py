"""cascade: lossless long-context generation with a hierarchical speculate-verify cascade.

``from cascade import LLM`` loads a preset's models (``cascade.llm``); the package itself imports
nothing heavy until then."""

from __future__ import annotations

from typing import TYPE_CHECKING

__version__ = "0.1.0"
__all__ = ["LLM", "Completion", "Stream", "__version__"]

if TYPE_CHECKING:
    from cascade.completion import Completion, Stream
    from cascade.llm import LLM


def __getattr__(name: str):
    if name == "LLM":
        from cascade.llm import LLM

        return LLM
    if name in ("Completion", "Stream"):
        from cascade import completion

        return getattr(completion, name)
    raise AttributeError(f"module 'cascade' has no attribute {name!r}")
