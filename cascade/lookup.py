"""The lowest stage without a model (``model: lookup``): prompt lookup decoding.

It proposes the tokens that followed the latest earlier occurrence of the sequence's last n tokens
(the longest n in the configured range that occurred before), from the prompt and the tokens
generated so far: a summary quoting its document, code repeating its own names, a passage that
recurs. A proposal is a single continuation, so under sampling its distribution is one-hot at each
proposed token and the verifier's residual rejection sampling keeps the output exactly the
verifier's (the pipeline builds that one-hot where it verifies). Where nothing recurs it proposes
nothing and the verifier takes a plain step. A lookup costs microseconds, so the cost model weighs
only what the verifier's wider pass costs against the tokens it keeps.
"""

from __future__ import annotations

import torch

from cascade.clock import Clock
from cascade.pass_costs import fresh_stats
from cascade.schedule import Schedule
from cascade.stats import StageStats


class NgramIndex:
    """Where each n-gram (n in ``sizes``) of a growing token sequence ends, rolled back with it."""

    def __init__(self, sizes: range) -> None:
        self.sizes = sizes
        self.tokens: list[int] = []
        self.ends: dict[tuple[int, ...], list[int]] = {}
        """n-gram -> the lengths of ``tokens`` at which it ends, in increasing order."""

    def extend(self, tokens: list[int]) -> None:
        for token in tokens:
            self.tokens.append(token)
            for n in self._sizes_held():
                self.ends.setdefault(tuple(self.tokens[-n:]), []).append(len(self.tokens))

    def truncate(self, length: int) -> None:
        """Forget the tokens past ``length`` and the n-grams ending among them."""
        while len(self.tokens) > length:
            for n in self._sizes_held():
                key = tuple(self.tokens[-n:])
                ends = self.ends[key]
                ends.pop()  # the last end of every n-gram ending here is here
                if not ends:
                    del self.ends[key]
            self.tokens.pop()

    def continuation(self, count: int) -> list[int]:
        """Up to ``count`` tokens that followed the latest earlier occurrence of the sequence's last
        n tokens, for the longest n that occurred before ([] if none did)."""
        for n in reversed(self._sizes_held()):
            ends = self.ends[tuple(self.tokens[-n:])]
            if len(ends) > 1:  # the last end is the sequence's own
                return self.tokens[ends[-2] : ends[-2] + count]
        return []

    def _sizes_held(self) -> range:
        return range(self.sizes.start, min(self.sizes.stop, len(self.tokens) + 1))


class LookupStage:
    """The pipeline's lowest stage, proposing by ``NgramIndex`` instead of a model's passes."""

    model = None
    cache = None
    source = None
    tree = None
    dynamic_tree = False
    stop_below = None
    captured_passes = 0

    def __init__(self, name: str, sizes: range, device: torch.device, schedule: Schedule | None) -> None:
        self.name = name
        self.device = device
        self.index = NgramIndex(sizes)
        self.restart(schedule)

    def restart(self, schedule: Schedule | None, last: StageStats | None = None) -> None:
        self.schedule = schedule
        self.stats = fresh_stats(self.name, schedule, last)
        self.clock = Clock(self.device)

    @property
    def length(self) -> int:
        return len(self.index.tokens)

    def prefill(self, prompt_ids: torch.Tensor, chunk: int) -> None:
        self.index = NgramIndex(self.index.sizes)
        self.index.extend(prompt_ids.tolist())

    def proposal(self, context: list[int], count: int) -> list[int]:
        """Up to ``count`` tokens to propose after ``context`` (which extends what the index holds)."""
        self.index.extend(context[self.length :])
        return self.index.continuation(count)

    def catch_up(self, context: list[int], chunk: int) -> None:
        self.index.extend(context[self.length :])

    def truncate(self, length: int) -> None:
        self.index.truncate(length)

    def commit(self, length: int) -> None:
        self.index.truncate(length)
