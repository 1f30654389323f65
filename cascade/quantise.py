"""Int8 or 4-bit weights for a draft: a half or about 0.3 of the bytes a pass reads, verified by the
bf16 target.

A draft's proposals only decide how many tokens a round keeps, never which (the target verifies
each one), so a draft may run on rounded weights and the output stays the target's own. Each
projection's weight becomes int8 per output row, symmetric (scale = the row's largest magnitude /
127), as QuantSpec drafts with the target's own quantised weights. The embedding stays as loaded
(a pass reads one row of it); a tied output projection is quantised apart from it.

4-bit weights (``Int4Linear``) hold levels 0..15 per input with a float16 scale and low per group of
32 inputs of a row (asymmetric, as llama.cpp's Q4_K sub-blocks: the Qwen2.5 drafts, dequantised from
Q4_K GGUFs, keep nearly their own weights), 5 bits a weight in all. Coarser groups (a multiple of 32
inputs sharing one scale and low) are stored as groups of 32 that repeat it: the same bytes and
kernel, the values a coarser quantisation gives, to see what it costs a draft's acceptance.

The weights are kept packed for cascade's kernels (``rows_times_int8.cpp``, ``rows_times_int4.cpp``,
which also quantise the activations, per 64 inputs): the fused passes of ``cascade.fused`` go through
them on a CPU with AVX512-VNNI or AVX2. Everything else (prefill chunks, eager passes, other devices) unpacks
the weight and takes the dense product with unquantised activations (``dense_quantised_product``).
"""

from __future__ import annotations

import functools
import math
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from cascade import kernels

if TYPE_CHECKING:  # the model's fused passes import this module
    from cascade.model import CausalLM

BLOCK_OUTPUTS, BLOCK_INPUTS = 16, 64
"""Output rows and inputs of one packed weight block (the int8 kernel's tile operand)."""
GROUP_INPUTS = 32
"""Inputs of a 4-bit weight's row that share a scale and a low."""


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
        return quantised_forward(self, x)


def pack_int4(levels: torch.Tensor) -> torch.Tensor:
    """Levels [O, I] in 0..15 -> uint8 [O' / 16, I' / 64, 8, 64], O and I padded with zeros to O', I':
    per block of 16 outputs and 64 inputs, 4 lines per group of 32 inputs, line j holding inputs
    4j..4j+3 of the group of each output in its low nibbles and inputs 16+4j..16+4j+3 in its high ones."""
    outputs, inputs = levels.shape
    padded = F.pad(levels.to(torch.uint8), (0, -inputs % BLOCK_INPUTS, 0, -outputs % BLOCK_OUTPUTS))  # [O', I']
    blocks = padded.view(padded.shape[0] // BLOCK_OUTPUTS, BLOCK_OUTPUTS, -1, 2, 2, 4, 4)
    # blocks [O'/16, 16 outputs, I'/64, group, half, line, 4 inputs]
    lines = blocks.permute(0, 2, 3, 4, 5, 1, 6)  # [O'/16, I'/64, group, half, line, 16 outputs, 4 inputs]
    packed = lines[:, :, :, 0] | (lines[:, :, :, 1] << 4)  # [O'/16, I'/64, group, line, 16, 4]
    return packed.reshape(packed.shape[0], packed.shape[1], 8, 64).contiguous()


def unpack_int4(packed: torch.Tensor, outputs: int, inputs: int) -> torch.Tensor:
    """``pack_int4``'s inverse: uint8 [O' / 16, I' / 64, 8, 64] -> levels [O, I] uint8."""
    lines = packed.view(*packed.shape[:2], 2, 4, BLOCK_OUTPUTS, 4)  # [O'/16, I'/64, group, line, 16, 4]
    halves = torch.stack([lines & 0x0F, lines >> 4], dim=3)  # [O'/16, I'/64, group, half, line, 16, 4]
    levels = halves.permute(0, 5, 1, 2, 3, 4, 6)  # [O'/16, 16, I'/64, group, half, line, 4]
    return levels.reshape(packed.shape[0] * BLOCK_OUTPUTS, -1)[:outputs, :inputs]


class Int4Linear(nn.Module):
    """``nn.Linear`` with 4-bit levels, packed, and per group of 32 inputs of a row a float16 scale
    and low, [I' / 32, 2, O] (each group's scales of every output, then its lows: the kernel loads a
    block's with one instruction each): a weight is scale * level + low, levels spanning each group's range.
    With ``group_inputs`` a multiple of 32, that many inputs (zeros past the row's end) share one
    scale and low, repeated over their groups of 32."""

    def __init__(self, linear: nn.Linear, group_inputs: int = GROUP_INPUTS) -> None:
        super().__init__()
        if group_inputs <= 0 or group_inputs % GROUP_INPUTS:
            raise ValueError(f"int4 groups take a positive multiple of {GROUP_INPUTS} inputs, not {group_inputs}")
        weight = linear.weight.detach().float()  # [O, I]
        padding = -weight.shape[1] % math.lcm(BLOCK_INPUTS, group_inputs)
        groups = F.pad(weight, (0, padding)).view(weight.shape[0], -1, group_inputs)  # [O, G, group_inputs]
        low = groups.amin(dim=-1).half().float()  # [O, G]
        scale = ((groups.amax(dim=-1) - low) / 15).half().float()  # [O, G]
        step = torch.where(scale > 0, scale, 1.0)[..., None]
        levels = torch.round((groups - low[..., None]) / step).clamp(0, 15)  # [O, G, group_inputs]
        self.in_features = weight.shape[1]
        self.register_buffer("weight", pack_int4(levels.view(weight.shape[0], -1)[:, : self.in_features]))
        stored = -(-self.in_features // BLOCK_INPUTS) * BLOCK_INPUTS // GROUP_INPUTS  # groups of 32 packed
        scales = torch.stack([scale, low], dim=-1).repeat_interleave(group_inputs // GROUP_INPUTS, dim=1)
        self.register_buffer("scales", scales[:, :stored].permute(1, 2, 0).half().contiguous())  # [I' / 32, 2, O]
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return quantised_forward(self, x)


QuantisedLinear = Int8Linear | Int4Linear


def quantised_forward(linear: QuantisedLinear, x: torch.Tensor) -> torch.Tensor:
    """x [..., I] -> [..., O] through the unpacked weight (the eager path; short CPU passes take the kernels)."""
    out = dense_quantised_product(x.reshape(-1, x.shape[-1]), linear.weight, linear.scales).to(x.dtype)  # [N, O]
    out = out.reshape(*x.shape[:-1], -1)
    return out if linear.bias is None else out + linear.bias


def int4_scales(scales: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """An ``Int4Linear``'s scales [G, 2, O] -> (scale, low), each [O, G] float16."""
    scale, low = scales.permute(1, 2, 0).unbind(0)
    return scale, low


def dense_quantised_product(rows: torch.Tensor, packed: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """rows [N, I] times a packed int8 (scales [O]) or 4-bit (uint8, scales [G, 2, O]) weight -> [N, O]
    in float32, the weight unpacked; bf16 rows multiply in float32 where bf16 products are emulated
    (rounded to bf16 after, as a bf16 product's output is)."""
    inputs = rows.shape[1]
    dtype = torch.float32 if kernels.bf16_products_emulated(rows) else rows.dtype
    if packed.dtype == torch.uint8:
        scale, low = int4_scales(scales)  # [O, G] each
        levels = unpack_int4(packed, scale.shape[0], scale.shape[1] * GROUP_INPUTS).float()  # [O, G * 32]
        groups = levels.view(*scale.shape, GROUP_INPUTS) * scale[..., None].float() + low[..., None].float()
        weight = groups.flatten(1)[:, :inputs].to(rows.dtype).to(dtype)  # [O, I], bf16 values
        return F.linear(rows.to(dtype), weight).to(rows.dtype).float()
    weight = unpack(packed, scales.shape[0], inputs).to(dtype)  # [O, I]
    return F.linear(rows.to(dtype), weight).to(rows.dtype).float() * scales


def quantise(model: CausalLM, bits: int, group_inputs: int = GROUP_INPUTS) -> CausalLM:
    """Replace ``model``'s projections (the output projection included) with int8 (``bits`` 8) or
    4-bit (4, ``group_inputs`` sharing a scale and low) ones in place."""
    quantised = Int8Linear if bits == 8 else functools.partial(Int4Linear, group_inputs=group_inputs)
    model.replace_projections(quantised)
    return model


def quantisation(model: CausalLM) -> str:
    """How ``model``'s weights are stored: "int8", "int4" or "none"."""
    bits = {Int8Linear: "int8", Int4Linear: "int4"}
    return bits.get(type(model.lm_head), "none")


def is_quantised(model: CausalLM) -> bool:
    return quantisation(model) != "none"


def projection(linear: nn.Module) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A projection's (weight, scales), the scales None for an unquantised one."""
    return (linear.weight, linear.scales) if isinstance(linear, QuantisedLinear) else (linear.weight, None)
