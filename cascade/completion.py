"""What a generation returns to Python callers: its text as it grows, the finished Completion, a Stream."""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from tokenizers.decoders import DecodeStream

from cascade.stop_strings import StopStrings

FINISH_REASONS = {"eos": "stop", "stop_string": "stop", "max_new_tokens": "length", "cancelled": "cancelled"}
"""A generation's stop reason (``GenerationStats.stop_reason``) as OpenAI's API names it."""

TextCallback = Callable[[str], None]


@dataclass(frozen=True)
class Completion:
    """One finished generation."""

    text: str
    """The new tokens' text, special tokens left out, cut before the first stop string."""
    token_ids: list[int]
    """The new tokens (the prompt's excluded), up to the one that ended the generation."""
    prompt_token_ids: list[int]
    finish_reason: str
    """``stop`` (end of sequence or a stop string), ``length`` (``max_new_tokens``), ``cancelled``,
    or ``error`` (a prompt of a list that could not run: ``error`` says why)."""
    stats: dict[str, Any]
    """``GenerationStats.to_dict()``: timings, and acceptance and costs per stage."""
    error: str | None = None
    """Why a prompt of a list generated nothing (``finish_reason`` ``error``); None otherwise."""

    @classmethod
    def failed(cls, error: str) -> Completion:
        """The completion of a prompt of a list that could not run, and why."""
        return cls("", [], [], "error", {}, error)


class IncrementalText:
    """The text of tokens added a few at a time, released as deltas that never need taking back.

    Tokens are decoded by the tokenizer's own streaming decoder (it holds back bytes of a character
    split across tokens). With stop strings, the last ``longest - 1`` characters wait until the
    next tokens show they do not begin a stop string, and nothing from a stop string on is released."""

    def __init__(self, tokenizer, stop_strings: StopStrings | None) -> None:
        self._tokenizer = tokenizer.backend_tokenizer
        self._decoder = DecodeStream(skip_special_tokens=True)
        self._stop_strings = stop_strings
        self._held = stop_strings.longest - 1 if stop_strings else 0
        self.text = ""
        self._released = 0

    def add(self, tokens: list[int]) -> str:
        """Decode ``tokens``; the text that is now certain to stay."""
        for token in tokens:
            chunk = self._decoder.step(self._tokenizer, token)
            if chunk:
                self.text += chunk
        return self._release(len(self.text) - self._held)

    def finish(self) -> str:
        """Cut the text before its first stop string; what was still held back of it."""
        return self._release(len(self.text), final=True)

    def _release(self, end: int, final: bool = False) -> str:
        if self._stop_strings is not None:
            stop = self._stop_strings.first(self.text, max(0, self._released - self._held))
            if stop is not None:
                end = min(end, stop)
                if final:
                    self.text = self.text[:stop]
        if end <= self._released:
            return ""
        delta, self._released = self.text[self._released : end], end
        return delta


_END = object()


class Stream:
    """A generation running in a background thread, read as its text deltas.

    Iterate it for the deltas (their concatenation is ``completion.text``); ``completion`` is set
    once they end. Leaving the iteration early, ``close()`` or a ``with`` block's end cancels the
    generation (it stops after its current round) and waits for it."""

    def __init__(self, run: Callable[[TextCallback, threading.Event], Completion]) -> None:
        self.completion: Completion | None = None
        self._deltas: queue.SimpleQueue = queue.SimpleQueue()
        self._cancelled = threading.Event()
        self._thread = threading.Thread(target=self._work, args=(run,), name="cascade-stream", daemon=True)
        self._thread.start()

    def _work(self, run: Callable[[TextCallback, threading.Event], Completion]) -> None:
        outcome: object = _END
        try:
            self.completion = run(self._deltas.put, self._cancelled)
        except Exception as error:  # re-raised in the reading thread
            outcome = error
        self._deltas.put(outcome)

    def __iter__(self) -> Iterator[str]:
        try:
            while (item := self._deltas.get()) is not _END:
                if isinstance(item, Exception):
                    raise item
                yield item
        finally:
            self.close()

    def close(self) -> None:
        """Cancel the generation if it still runs, and wait for it to end."""
        self._cancelled.set()
        self._thread.join()

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
