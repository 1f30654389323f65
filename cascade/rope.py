"""Rotary position embedding; frequencies (default, linear, YaRN, llama3) come from transformers."""

from __future__ import annotations

import torch
from transformers import PreTrainedConfig
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS


def rope_frequencies(config: PreTrainedConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies [D/2] and the cos/sin scale (YaRN's mscale; 1.0 otherwise)."""
    rope_type = config.rope_parameters.get("rope_type", "default")
    if rope_type == "default":
        from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding  # 4 s to import: when used

        return LlamaRotaryEmbedding.compute_default_rope_parameters(config)
    return ROPE_INIT_FUNCTIONS[rope_type](config)


class Rotary:
    """Frequencies stay float32 whatever the model's dtype (a bf16 copy would shift positions)."""

    def __init__(self, inv_freq: torch.Tensor, scale: float, device: torch.device) -> None:
        self.inv_freq = inv_freq.to(device=device, dtype=torch.float32)  # [D/2]
        self.scale = scale

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin for ``positions`` [T], each [T, D], computed in float32 then cast."""
        angles = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        angles = torch.cat((angles, angles), dim=-1)  # [T, D]
        return (angles.cos() * self.scale).to(dtype), (angles.sin() * self.scale).to(dtype)

    def shift(self, x: torch.Tensor, offset: int) -> torch.Tensor:
        """Move rotated keys x [..., S, D] by ``offset`` positions (no YaRN scale: already applied).

        Rotations compose, so a key rotated for position p becomes the key for p + offset;
        computed in float32 and cast back to x's dtype.
        """
        angles = offset * self.inv_freq  # [D/2]
        angles = torch.cat((angles, angles))  # [D]
        return apply_rotary(x.float(), angles.cos(), angles.sin()).to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [B, H, T, D] by cos/sin [T, D] (half-split convention of the Llama family)."""
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin
