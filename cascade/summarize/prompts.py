"""Prompt templates: the instruction around a document, wrapped in the target's chat template.

A template is text with one ``{document}`` placeholder (replaced literally: other braces are kept).
"""

from __future__ import annotations

from pathlib import Path

from cascade.errors import CascadeError

PLACEHOLDER = "{document}"
DEFAULT_TEMPLATE = (
    "Read the document, then give its title and author if it states them, and summarize it.\n\nDocument:\n{document}"
)
PART_TEMPLATE = "Summarize this part of a longer document.\n\nPart:\n{document}"
COMBINE_TEMPLATE = (
    "These are summaries of consecutive parts of one document. Give the document's title and "
    "author if they are stated, and summarize the whole document.\n\nSummaries:\n{document}"
)


def read_template(path: Path | None) -> str:
    if path is None:
        return DEFAULT_TEMPLATE
    try:
        template = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CascadeError(f"cannot read the template {path}: {exc}") from None
    if template.count(PLACEHOLDER) != 1:
        raise CascadeError(
            f"the template {path} must contain {PLACEHOLDER} exactly once (found {template.count(PLACEHOLDER)})"
        )
    return template


class PromptBuilder:
    """Token ids of a template filled with a document, as the target's chat template frames it."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer

    def ids(self, template: str, document_ids: list[int]) -> list[int]:
        before, after = template.split(PLACEHOLDER)
        marker = "\x00DOCUMENT\x00"
        framed = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": before + marker + after}], add_generation_prompt=True, tokenize=False
        )
        head, tail = framed.split(marker)
        encode = self.encode
        return encode(head) + document_ids + encode(tail)

    def overhead(self, template: str) -> int:
        """Tokens the template and chat framing add around a document."""
        return len(self.ids(template, []))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)
