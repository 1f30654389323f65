"""Attention kernels: flash-attn on CUDA when installed, PyTorch SDPA everywhere else."""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

from cache.base import AttentionView

FLASH_ATTN_INSTALLED = importlib.util.find_spec("flash_attn") is not None


def attend(query: torch.Tensor, view: AttentionView, scale: float) -> torch.Tensor:
    """Grouped-query attention of query [B, H, T, D] over the view's keys/values [B, H_kv, S, D].

    Returns [B, H, T, D]. A view without a mask means every query reads every key.
    """
    if FLASH_ATTN_INSTALLED and query.is_cuda and (view.mask is None or view.causal):
        return _flash_attend(query, view, scale)
    return F.scaled_dot_product_attention(
        query, view.keys, view.values, attn_mask=view.mask, scale=scale, enable_gqa=True
    )


def _flash_attend(query: torch.Tensor, view: AttentionView, scale: float) -> torch.Tensor:
    from flash_attn import flash_attn_func

    out = flash_attn_func(  # flash-attn takes [B, T, H, D]; its causal mask is bottom-right aligned
        query.transpose(1, 2),
        view.keys.transpose(1, 2),
        view.values.transpose(1, 2),
        softmax_scale=scale,
        causal=view.causal,
    )
    return out.transpose(1, 2)  # [B, H, T, D]
