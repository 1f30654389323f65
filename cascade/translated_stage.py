"""The lowest stage when its model's tokenizer differs from the target's (``draft.cross_tokenizer``):
the pipeline's stage interface in target ids around a ``Stage`` that runs in draft ids.

Its logits come back in the target's vocabulary, -inf but for the tokens both share
(``cascade.translation``), so the pipeline draws and verifies its proposals as any stage's. The
sequence it holds is the target's, spelled in draft tokens: ``sequence`` lists them and ``ends``
where each target token after the prompt ends among them. Proposals it draws itself are fed as
they are drawn, one draft token each, and spelled in ``sequence`` once the pipeline's context holds
them, so a length in target tokens always maps to one in draft tokens.
"""

from __future__ import annotations

from bisect import bisect_right

import torch

from cascade.schedule import Schedule
from cascade.stage import Stage, device_ids
from cascade.stats import StageStats
from cascade.translation import Translation


class TranslatedStage:
    tree = None  # token trees are not drawn across tokenizers
    dynamic_tree = False
    source = None

    def __init__(self, inner: Stage, translation: Translation) -> None:
        self.inner = inner
        self.translation = translation
        self.prompt_length = 0
        """Target tokens of the prompt."""
        self.prompt_draft_length = 0
        """Draft tokens of the prompt."""
        self.sequence: list[int] = []
        """Draft tokens of the prompt and of the target tokens after it spelled so far."""
        self.ends: list[int] = []
        """Per target token after the prompt: the length of ``sequence`` through its draft tokens."""

    name = property(lambda self: self.inner.name)
    model = property(lambda self: self.inner.model)
    stats = property(lambda self: self.inner.stats)
    schedule = property(lambda self: self.inner.schedule)
    clock = property(lambda self: self.inner.clock)
    cache = property(lambda self: self.inner.cache)
    device = property(lambda self: self.inner.device)
    captured_passes = property(lambda self: self.inner.captured_passes)
    stop_below = property(lambda self: self.inner.stop_below)

    def restart(self, schedule: Schedule | None, last: StageStats | None = None) -> None:
        self.inner.restart(schedule, last)

    @property
    def length(self) -> int:
        """Target tokens whose draft tokens the cache holds (the stage's own fed proposals included)."""
        held, spelled = self.inner.length, self.prompt_length + len(self.ends)
        if held >= len(self.sequence):
            return spelled + held - len(self.sequence)
        if held < self.prompt_draft_length:
            return 0  # the prompt is not all held
        return self.prompt_length + bisect_right(self.ends, held)

    def prefill(self, prompt_ids: torch.Tensor, chunk: int) -> torch.Tensor | None:
        self.prompt_length = prompt_ids.numel()
        self.sequence, self.ends = self.translation.prompt(prompt_ids.tolist()), []
        self.prompt_draft_length = len(self.sequence)
        return self.inner.prefill(device_ids(self.sequence, self.device), chunk)

    def extend(self, context: list[int], num_logits: int, proposed=None, tree=None) -> torch.Tensor:
        """Logits [N, V_target] after ``context``; the lowest stage is fed no proposals to verify."""
        assert proposed is None and tree is None, "a stage drafting across tokenizers proposes only"
        self._spell(context)
        return self.translation.to_target(self.inner.extend(self.sequence, num_logits))

    def feed(self, token_ids: torch.Tensor, num_logits: int, tree=None) -> torch.Tensor:
        """Its own proposals [T] (target ids, every one shared) -> logits [N, V_target]."""
        draft_ids = self.translation.target_to_draft[token_ids]  # [T]
        return self.translation.to_target(self.inner.feed(draft_ids, num_logits))

    def catch_up(self, context: list[int], chunk: int) -> None:
        self._spell(context)
        self.inner.catch_up(self.sequence, chunk)

    def truncate(self, length: int) -> None:
        self.inner.truncate(self._draft_length(length))

    def commit(self, length: int) -> None:
        self.inner.commit(self._draft_length(length))

    def keep_path(self, start: int, path: list[int]) -> None:
        raise NotImplementedError("token trees are not drawn across tokenizers")

    def _spell(self, context: list[int]) -> None:
        """Spell the target tokens of ``context`` not yet in ``sequence``."""
        for token in context[self.prompt_length + len(self.ends) :]:
            self.sequence += self.translation.draft_tokens(token)
            self.ends.append(len(self.sequence))

    def _draft_length(self, length: int) -> int:
        """Draft tokens of the first ``length`` target tokens, forgetting the spellings past them;
        tokens past those spelled are the stage's own proposals, one draft token each."""
        spelled = self.prompt_length + len(self.ends)
        if length >= spelled:
            return len(self.sequence) + length - spelled
        del self.ends[max(length - self.prompt_length, 0) :]
        del self.sequence[self.ends[-1] if self.ends else self.prompt_draft_length :]
        return len(self.sequence)
