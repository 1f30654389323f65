"""bf16 weights packed in panels for cascade's AVX2 weight kernel: [O, I] -> [O / 16, I, 16].

Without a bf16 product instruction (AVX2 CPUs: Zen 1-3, Intel before Sapphire Rapids), a pass of a
few tokens widens every weight to float32 in registers. In panels, each input's 16 output values sit
side by side: the kernel broadcasts each input of up to 6 activation rows against one 256-bit load of
a panel, so a verification pass holds 12 sums in registers and widens each weight once (the [O, I]
order widens each weight for every 3 rows and spends a load on every multiply-add). On a 2-core Zen 2,
products of 4-9 rows over the Qwen2.5-Coder 1.5B's matrices took 0.7-0.85x as long, one-row ones
0.6-0.8x (``rows_times_weight_avx2.cpp``). Every output's sum is one float32 multiply-add chain over the
inputs in order, whatever the pass's width: a verification pass equals the decode steps it replaces.

``pack_panels`` packs a loaded model's bf16 projections whose output count is a multiple of 16 (the
embedding, where it is the output projection's weight, reads the same panels), where the AVX2 kernel
takes the model's short passes. Passes the kernel does not take (prefill chunks, eager passes) multiply
by the weight widened back to [I, O] in float32, as ``model.Linear`` widens it on such CPUs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from cascade import kernels

if TYPE_CHECKING:
    from cascade.model import CausalLM

PANEL_OUTPUTS = 16
"""Outputs per panel: one 256-bit load of bf16 values."""


def pack(weight: torch.Tensor) -> torch.Tensor:
    """Weight [O, I], O a multiple of 16 -> panels [O / 16, I, 16]: panel p's row i holds input i's
    weights of outputs 16p..16p+15."""
    outputs, inputs = weight.shape
    return weight.view(outputs // PANEL_OUTPUTS, PANEL_OUTPUTS, inputs).transpose(1, 2).contiguous()


def unpack(panels: torch.Tensor) -> torch.Tensor:
    """``pack``'s inverse: [O / 16, I, 16] -> [O, I]."""
    return panels.transpose(1, 2).reshape(-1, panels.shape[1])


def widened_transpose(panels: torch.Tensor) -> torch.Tensor:
    """Panels [O / 16, I, 16] -> the weight's transpose [I, O] in float32, in one copy."""
    count, inputs, width = panels.shape
    out = torch.empty((inputs, count, width), dtype=torch.float32, device=panels.device)
    return out.copy_(panels.transpose(0, 1)).view(inputs, count * width)


class PanelLinear(nn.Module):
    """``nn.Linear`` with its bf16 weight packed in panels (``pack``): short passes go through
    cascade's kernels (``cascade.fused``), the rest through ``forward``."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.weight = nn.Parameter(pack(linear.weight.detach()), requires_grad=False)
        self.bias = linear.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [..., I] -> [..., O]: a float32 product with the widened weight, rounded to x's dtype."""
        out = widened_product(x.reshape(-1, self.in_features), self.weight, self.bias)  # [N, O]
        return out.to(x.dtype).reshape(*x.shape[:-1], self.out_features)


def widened_product(rows: torch.Tensor, panels: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """rows [N, I] times the weight in ``panels`` (+ bias) -> [N, O] float32."""
    weight = widened_transpose(panels)  # [I, O]
    return rows.float() @ weight if bias is None else torch.addmm(bias.float(), rows.float(), weight)


class PanelEmbedding(nn.Module):
    """An embedding that reads its rows from the output projection's panels (a tied model)."""

    def __init__(self, panels: nn.Parameter) -> None:
        super().__init__()
        self.weight = panels

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        """token_ids [...] -> rows [..., C]."""
        return self.weight[token_ids // PANEL_OUTPUTS, :, token_ids % PANEL_OUTPUTS]


def applies(model: CausalLM) -> bool:
    """Whether ``model``'s short passes run on cascade's AVX2 weight kernel (bf16, CPU, passes of
    several tokens fused: ``fused.use_cpu_kernels`` took the kernels), which takes panels."""
    fused = model.fused_tokens > 1 and model.dtype == torch.bfloat16 and model.device.type == "cpu"
    return fused and kernels.weight_kernel_available() and "avx2" in kernels.compiled_features()


def pack_panels(model: CausalLM) -> CausalLM:
    """Pack ``model``'s bf16 projections (those of O a multiple of 16; not quantised ones) in panels,
    in place; a tied embedding reads the output projection's panels."""
    tied = model.lm_head.weight is model.embed_tokens.weight
    model.replace_projections(packed)
    if tied and isinstance(model.lm_head, PanelLinear):
        model.embed_tokens = PanelEmbedding(model.lm_head.weight)
    return model


def packed(linear: nn.Module) -> nn.Module:
    """``linear`` in panels where it is a bf16 ``Linear`` of O a multiple of 16, else itself."""
    fits = isinstance(linear, nn.Linear) and linear.out_features % PANEL_OUTPUTS == 0
    return PanelLinear(linear) if fits and linear.weight.dtype == torch.bfloat16 else linear


def dense_weight(linear: nn.Module) -> torch.Tensor:
    """A bf16 projection's weight [O, I], packed in panels or not."""
    return unpack(linear.weight) if isinstance(linear, PanelLinear) else linear.weight
