"""The draft's shape: a small Llama whose tied embedding lives in the target's output subspace.

At SmolLM2's 49152-token vocabulary the output embedding dominates a small model, so the draft's
hidden size is what sets its cost. Its tied embedding starts as the target's embedding projected
onto the principal directions of the target's final hidden states: the draft starts out able to
express the target's most common output directions, and training takes it from there.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch
from transformers import LlamaConfig, LlamaForCausalLM, PretrainedConfig


@dataclass(frozen=True)
class DraftShape:
    hidden_size: int = 192
    num_layers: int = 5
    num_heads: int = 3
    num_kv_heads: int = 1
    intermediate_size: int = 768
    context_length: int = 2048
    """Positions the draft is trained for; its streaming cache keeps it inside them at any length."""


def draft_config(target: PretrainedConfig, shape: DraftShape) -> LlamaConfig:
    """A Llama config of ``shape`` with the target's vocabulary, special tokens and RoPE base."""
    return LlamaConfig(
        vocab_size=target.vocab_size,
        hidden_size=shape.hidden_size,
        intermediate_size=shape.intermediate_size,
        num_hidden_layers=shape.num_layers,
        num_attention_heads=shape.num_heads,
        num_key_value_heads=shape.num_kv_heads,
        head_dim=shape.hidden_size // shape.num_heads,
        max_position_embeddings=shape.context_length,
        rms_norm_eps=target.rms_norm_eps,
        rope_parameters={"rope_type": "default", "rope_theta": target.rope_parameters["rope_theta"]},
        tie_word_embeddings=True,
        bos_token_id=target.bos_token_id,
        eos_token_id=target.eos_token_id,
        pad_token_id=target.pad_token_id,
        attention_bias=False,
        mlp_bias=False,
    )


def macs_per_token(config: PretrainedConfig) -> int:
    """Multiply-accumulates of one decode step's matmuls (weights only; attention over the cache excluded)."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    attention = config.hidden_size * head_dim * 2 * (config.num_attention_heads + config.num_key_value_heads)
    mlp = 3 * config.hidden_size * config.intermediate_size
    return config.num_hidden_layers * (attention + mlp) + config.vocab_size * config.hidden_size


def hidden_basis(hidden: torch.Tensor, rank: int) -> torch.Tensor:
    """[D, rank]: the top principal directions (uncentred) of target hidden states ``hidden`` [N, D]."""
    second_moment = hidden.double().T @ hidden.double()  # [D, D]
    _, vectors = torch.linalg.eigh(second_moment)  # ascending eigenvalues
    return vectors[:, -rank:].flip(-1).float()


def initialised_draft(
    config: LlamaConfig, target_embedding: torch.Tensor, hidden: torch.Tensor, seed: int
) -> LlamaForCausalLM:
    """A draft whose tied embedding is ``target_embedding`` [V, D] on the basis of ``hidden`` [N, D]."""
    torch.manual_seed(seed)
    draft = LlamaForCausalLM(config)
    basis = hidden_basis(hidden, config.hidden_size)  # [D, d]
    with torch.no_grad():
        draft.model.embed_tokens.weight.copy_(target_embedding.float() @ basis)  # [V, d]
    return draft


def shape_record(shape: DraftShape, config: PretrainedConfig, target: PretrainedConfig) -> dict:
    """The architecture part of the model card."""
    return {
        **asdict(shape),
        "macs_per_token": macs_per_token(config),
        "target_macs_per_token": macs_per_token(target),
        "cost_ratio": round(macs_per_token(config) / macs_per_token(target), 4),
    }
