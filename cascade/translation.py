"""Drafting across tokenizers by token-level intersection (TLI; Timor et al., 2025, "Accelerating
LLM Inference with Lossless Speculative Decoding Algorithms for Heterogeneous Vocabularies").

A draft whose tokenizer differs from the target's proposes only the tokens both vocabularies hold:
the same byte string in each (added tokens such as ``<|im_end|>``: the same text). Its
distribution restricted to them and renormalised is a distribution over target tokens, so the
verifier's ordinary rejection sampling keeps the output exactly the target's, greedy or sampled,
and each proposal is one draft token and one target token (acceptance counts both alike).

What the draft reads: the prompt as its own tokenizer encodes the prompt's text; after it, per
token of the sequence, its own id where the token is shared, else its BPE of the token's bytes
(one or more draft tokens: a token cut inside a UTF-8 character is still read byte for byte).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from tokenizers.decoders import ByteLevel
from transformers import PreTrainedTokenizerBase
from transformers.convert_slow_tokenizer import bytes_to_unicode

from cascade.errors import CascadeError

MIN_SHARED_SHARE = 0.25
"""The least share of the draft's vocabulary the target's must also hold: below it the draft could
propose too little of what it would say (every byte-level pair shares the 256 byte tokens)."""

UNICODE_TO_BYTE = {character: byte for byte, character in bytes_to_unicode().items()}
"""Byte-level BPE writes each byte as one printable character (GPT-2's table): character -> byte."""


@dataclass
class Translation:
    """The tokens a draft and its target share, and how the target's sequence reads in draft tokens."""

    draft_ids: torch.Tensor
    """[K] int64: the shared tokens' draft ids."""
    target_ids: torch.Tensor
    """[K] int64: the same tokens' target ids."""
    target_logits: int
    """Logits of a target pass (its vocabulary, padding included)."""
    draft_tokenizer: PreTrainedTokenizerBase | None
    target_tokenizer: PreTrainedTokenizerBase | None
    spelled: dict[int, list[int]] = field(default_factory=dict)
    """Target id -> the draft tokens it reads as, for the target tokens the draft lacks (filled as met)."""

    def __post_init__(self) -> None:
        self.draft_of = dict(zip(self.target_ids.tolist(), self.draft_ids.tolist(), strict=True))
        """Target id -> draft id, for the shared tokens."""
        self.target_to_draft = torch.full((self.target_logits,), -1, dtype=torch.int64)  # [V_target]
        self.target_to_draft[self.target_ids] = self.draft_ids

    @classmethod
    def between(
        cls, draft: PreTrainedTokenizerBase, target: PreTrainedTokenizerBase, target_logits: int
    ) -> Translation:
        """The shared tokens of two byte-level BPE tokenizers; a clear error where that is not what
        they are or they share too little."""
        draft_keys, target_keys = token_keys(draft, "draft"), token_keys(target, "target")
        by_key = {key: token_id for token_id, key in target_keys.items() if token_id < target_logits}
        pairs = sorted((draft_id, by_key[key]) for draft_id, key in draft_keys.items() if key in by_key)
        share = len(pairs) / max(len(draft_keys), 1)
        if share < MIN_SHARED_SHARE:
            raise CascadeError(
                f"the draft's tokenizer shares {len(pairs)} of its {len(draft_keys)} tokens with the "
                f"target's ({share:.0%}); drafting across tokenizers needs at least "
                f"{MIN_SHARED_SHARE:.0%} (a draft proposes only tokens both hold): choose a draft "
                "whose tokenizer is closer to the target's"
            )
        draft_ids, target_ids = zip(*pairs, strict=True)
        return cls(torch.tensor(draft_ids), torch.tensor(target_ids), target_logits, draft, target)

    def prompt(self, prompt_ids: list[int]) -> list[int]:
        """The draft's tokens of the prompt: its own encoding of the prompt's text."""
        text = self.target_tokenizer.decode(prompt_ids, skip_special_tokens=False)
        return self.draft_tokenizer.encode(text, add_special_tokens=False)

    def draft_tokens(self, target_id: int) -> list[int]:
        """The draft tokens target token ``target_id`` reads as."""
        if target_id in self.draft_of:
            return [self.draft_of[target_id]]
        if target_id not in self.spelled:
            self.spelled[target_id] = self._spell(target_id)
        return self.spelled[target_id]

    def _spell(self, target_id: int) -> list[int]:
        """A target token the draft lacks, in draft tokens: an added token's text as the draft encodes
        it, any other token's bytes through the draft's BPE (exactly those bytes, no more)."""
        added = self.target_tokenizer.added_tokens_decoder.get(target_id)
        if added is not None:
            return self.draft_tokenizer.encode(added.content, add_special_tokens=False)
        piece = self.target_tokenizer.convert_ids_to_tokens(target_id)
        return [token.id for token in self.draft_tokenizer.backend_tokenizer.model.tokenize(piece)]

    def on(self, device: torch.device) -> None:
        """Keep the id tables on ``device``, where the draft's logits and proposals are."""
        self.draft_ids, self.target_ids = self.draft_ids.to(device), self.target_ids.to(device)
        self.target_to_draft = self.target_to_draft.to(device)

    def to_target(self, logits: torch.Tensor) -> torch.Tensor:
        """Draft logits [N, V_draft] -> target logits [N, V_target]: the shared tokens' own, -inf
        for the rest (a draw from them is a draw among the shared tokens)."""
        every = logits.new_full((logits.shape[0], self.target_logits), float("-inf"))
        return every.index_copy_(1, self.target_ids, logits.index_select(1, self.draft_ids))


def token_keys(tokenizer: PreTrainedTokenizerBase, role: str) -> dict[int, bytes | str]:
    """Every token's id -> what it stands for: its bytes, or an added token's text (a str)."""
    decoder = tokenizer.backend_tokenizer.decoder if tokenizer.is_fast else None
    if not isinstance(decoder, ByteLevel):
        raise CascadeError(
            f"drafting across tokenizers takes byte-level BPE tokenizers (GPT-2, Llama 3, SmolLM, "
            f"Qwen, ...); the {role}'s decodes with {type(decoder).__name__ if decoder else 'a slow tokenizer'}"
        )
    added = {token_id: token.content for token_id, token in tokenizer.added_tokens_decoder.items()}
    keys: dict[int, bytes | str] = dict(added)
    for piece, token_id in tokenizer.get_vocab().items():
        if token_id not in added and all(character in UNICODE_TO_BYTE for character in piece):
            keys[token_id] = bytes(UNICODE_TO_BYTE[character] for character in piece)
    return keys
