"""Stop strings: a generation ends at the token whose text completes one of some strings."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from transformers import StopStringCriteria

from cascade.errors import CascadeError

MAX_STOP_STRINGS = 16
"""As many stop strings as a request may give (OpenAI's API allows four; vLLM any number)."""


def check_stop_strings(strings: Sequence[str]) -> tuple[str, ...]:
    """``strings`` as a tuple, or an error saying what is wrong with them."""
    if isinstance(strings, str):
        strings = [strings]
    if len(strings) > MAX_STOP_STRINGS:
        raise CascadeError(f"stop: {len(strings)} stop strings given; at most {MAX_STOP_STRINGS} are allowed")
    for string in strings:
        if not isinstance(string, str) or not string:
            raise CascadeError(f"stop: every stop string must be non-empty text; got {string!r}")
    return tuple(strings)


class StopStrings:
    """Where generated tokens first complete one of ``strings`` in their text, and the text before it.

    Matching is transformers' ``StopStringCriteria`` (it knows which tokens can end a stop string,
    overhanging either end of it, from the vocabulary); it reads only the last tokens, as many as
    the longest string has characters."""

    def __init__(self, tokenizer, strings: Sequence[str]) -> None:
        self.strings = check_stop_strings(strings)
        self._criteria = StopStringCriteria(tokenizer, self.strings)
        self._tail = self._criteria.maximum_token_len

    def completed(self, emitted: list[int], new: list[int]) -> bool:
        """Whether the text of ``emitted + new`` ends in a completed stop string (``new`` non-empty)."""
        tail = (emitted[-self._tail :] + new)[-self._tail :]
        return bool(self._criteria(torch.tensor([tail]), None)[0])

    def first(self, text: str, start: int = 0) -> int | None:
        """Where the earliest stop string in ``text[start:]`` begins (an index of ``text``), if any."""
        found = [index for string in self.strings if (index := text.find(string, start)) >= 0]
        return min(found, default=None)

    @property
    def longest(self) -> int:
        return max(len(string) for string in self.strings)
