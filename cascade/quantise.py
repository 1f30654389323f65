"""Int8 weights for a draft: half the bytes a pass reads, verified by the bf16 target.

A draft's proposals only decide how many tokens a round keeps, never which (the target verifies
each one), so a draft may run on rounded weights and the output stays the target's own. Each
projection's weight becomes int8 per output row, symmetric (scale = the row's largest magnitude /
127), as QuantSpec drafts with the target's own quantised weights. The embedding stays as loaded
(a pass reads one row of it); a tied output projection is quantised apart from it.

The int8 weight is kept packed for cascade's int8 kernel (``rows_times_int8.cpp``, which also
quantises the activations, per 64 inputs): the fused passes of ``cascade.fused`` go through it on a
CPU with AMX-INT8 or AVX512-VNNI. Everything else (prefill chunks, eager passes, other devices) unpacks the weight
and takes the dense product with unquantised activations (``dense_int8_product``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # the model's fused passes import this module
    from cascade.model import CausalLM

BLOCK_OUTPUTS, BLOCK_INPUTS = 16, 64
"""Output rows and inputs of one packed weight block (the int8 kernel's tile operand)."""


def pack(weight: torch.Tensor) -> torch.Tensor:
    """int8 weight [O, I] -> blocks [O' / 16, I' / 64, 16, 64], O and I padded with zeros to O', I':
    each block holds inputs 4k..4k+3 of its 16 output rows in its row k."""
    outputs, inputs = weight.shape
    padded = F.pad(weight, (0, -inputs % BLOCK_INPUTS, 0, -outputs % BLOCK_OUTPUTS))  # [O', I']
    blocks = padded.view(
        padded.shape[0] // BLOCK_OUTPUTS, BLOCK_OUTPUTS, padded.shape[1] // BLOCK_INPUTS, BLOCK_INPUTS // 4, 4
    )  # [O'/16, 16 outputs, I'/64, 16 quads, 4]
    return blocks.permute(0, 2, 3, 1, 4).reshape(blocks.shape[0], blocks.shape[2], BLOCK_INPUTS // 4, -1).contiguous()


def unpack(packed: torch.Tensor, outputs: int, inputs: int) -> torch.Tensor:
    """``pack``'s inverse: [O' / 16, I' / 64, 16, 64] -> int8 [O, I]."""
    blocks = packed.view(*packed.shape[:3], BLOCK_OUTPUTS, 4)  # [O'/16, I'/64, 16 quads, 16 outputs, 4]
    return blocks.permute(0, 3, 1, 2, 4).reshape(packed.shape[0] * BLOCK_OUTPUTS, -1)[:outputs, :inputs]


class Int8Linear(nn.Module):
    """``nn.Linear`` with an int8 weight, packed, and a float32 scale per output row [O]."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        weight = linear.weight.detach().float()  # [O, I]
        scales = (weight.abs().amax(dim=1) / 127).clamp(min=torch.finfo(torch.float32).tiny)  # [O]
        self.in_features = weight.shape[1]
        self.register_buffer("weight", pack(torch.round(weight / scales[:, None]).to(torch.int8)))
        self.register_buffer("scales", scales)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = dense_int8_product(x.reshape(-1, x.shape[-1]), self.weight, self.scales).to(x.dtype)  # [N, O]
        out = out.reshape(*x.shape[:-1], -1)
        return out if self.bias is None else out + self.bias


def dense_int8_product(rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """rows [N, I] times a packed int8 weight with scales [O] -> [N, O] in float32, unpacked."""
    weight = unpack(packed, scales.shape[0], rows.shape[1]).to(rows.dtype)  # [O, I]
    return F.linear(rows, weight).float() * scales


def quantise_int8(model: CausalLM) -> CausalLM:
    """Replace ``model``'s projections (the output projection included) with ``Int8Linear`` in place."""
    for block in model.layers:
        attn, mlp = block.self_attn, block.mlp
        attn.qkv_proj, attn.o_proj = Int8Linear(attn.qkv_proj), Int8Linear(attn.o_proj)
        mlp.gate_up_proj, mlp.down_proj = Int8Linear(mlp.gate_up_proj), Int8Linear(mlp.down_proj)
    model.lm_head = Int8Linear(model.lm_head)
    return model


def is_quantised(model: CausalLM) -> bool:
    return isinstance(model.lm_head, Int8Linear)


def projection(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A projection's (weight, per-row scales), the scales None for an unquantised one."""
    return (linear.weight, linear.scales) if isinstance(linear, Int8Linear) else (linear.weight, None)
