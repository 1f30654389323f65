"""Attention kernels: flash-attn on CUDA when installed, PyTorch SDPA everywhere else."""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F
from einops import rearrange

from cache.base import AttentionView

FLASH_ATTN_INSTALLED = importlib.util.find_spec("flash_attn") is not None

CPU_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
"""PyTorch's CPU flash kernel, which also returns the log-sum-exp that lets two halves merge."""

MATMUL_MAX_QUERIES = 8
"""Up to this many queries per pass (decode steps, verification of up to 7 proposals) attention
runs as plain matrix products per KV head."""
FOLD_MAX_QUERIES = 64
"""Up to this many queries per pass the grouped SDPA layout is used; beyond it (prefill chunks)
repeating the mask per group costs more than it saves."""


def attend(query: torch.Tensor, view: AttentionView, scale: float) -> torch.Tensor:
    """Grouped-query attention of query [B, H, T, D] over the view's keys/values [B, H_kv, S, D].

    Returns [B, H, T, D]. A view without a mask means every query reads every key.
    """
    if FLASH_ATTN_INSTALLED and query.is_cuda and (view.mask is None or view.causal):
        return _flash_attend(query, view, scale)
    num_queries, num_keys = query.shape[2], view.keys.shape[2]
    if num_queries <= MATMUL_MAX_QUERIES and not query.is_cuda:
        return _per_head_matmul(query, view, scale)
    if num_queries <= FOLD_MAX_QUERIES:
        return _grouped_sdpa(query, view, scale)
    if view.causal and num_queries == num_keys:  # a first prefill chunk: skip the upper half
        return F.scaled_dot_product_attention(
            query, view.keys, view.values, is_causal=True, scale=scale, enable_gqa=True
        )
    if view.causal and CPU_FLASH_WITH_LSE is not None and not query.is_cuda:
        return _prefix_plus_causal_block(query, view, scale)
    return F.scaled_dot_product_attention(
        query, view.keys, view.values, attn_mask=view.mask, scale=scale, enable_gqa=True
    )


def _prefix_plus_causal_block(query: torch.Tensor, view: AttentionView, scale: float) -> torch.Tensor:
    """A later prefill chunk: T queries over S keys whose last T are the chunk itself.

    Attention over the S - T earlier keys needs no mask and over the chunk's own keys is square
    causal, so each half runs the mask-free CPU flash kernel (the causal one skips its upper
    triangle) and the halves are merged by their log-sum-exp: 15-20% less time than one masked
    pass at 1-2K queries over 4-8K keys.
    """
    num_queries, group = query.shape[2], query.shape[1] // view.keys.shape[1]
    halves = []
    for keys, values, causal in (
        (view.keys[:, :, :-num_queries], view.values[:, :, :-num_queries], False),
        (view.keys[:, :, -num_queries:], view.values[:, :, -num_queries:], True),
    ):
        keys, values = keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1)  # [B, H, *, D]
        halves.append(CPU_FLASH_WITH_LSE(query, keys, values, is_causal=causal, scale=scale))
    (prefix_out, prefix_lse), (block_out, block_lse) = halves  # [B, H, T, D], [B, H, T] float32
    total_lse = torch.logaddexp(prefix_lse, block_lse)
    merged = (prefix_out.float() * (prefix_lse - total_lse).exp()[..., None]
              + block_out.float() * (block_lse - total_lse).exp()[..., None])
    return merged.to(query.dtype)  # [B, H, T, D]


def _per_head_matmul(query: torch.Tensor, view: AttentionView, scale: float) -> torch.Tensor:
    """A pass of a few queries as two matrix products per KV head: its query group folded with the
    pass's tokens [G*T, D] against its keys, then the weights against its values.

    Reading K and V once dominates, so it runs near memory speed: 2-3x faster than the CPU flash
    kernel over 8K-64K keys. It loops over KV heads because a cache view is a slice of a longer
    buffer, which batched matmul would first copy (3x slower at 16K keys). Scores come out of the
    product in the KV dtype (as in transformers' eager attention); the softmax kernel computes in
    float32 and writes the KV dtype, which for a 7-token verification pass over 32K keys is 2.2x
    faster than a float32 softmax followed by a cast (the [G*T, S] float32 temporary is the cost),
    with the same result. A causal view only hides keys among the pass's own T tokens, so only
    those columns are masked.
    """
    batch, num_kv_heads = view.keys.shape[:2]
    num_queries = query.shape[2]
    groups = rearrange(query * scale, "b (k g) t d -> b k (g t) d", k=num_kv_heads)  # [B, H_kv, G*T, D]
    rows = groups.shape[2]
    columns = slice(-num_queries, None) if view.causal else slice(None)
    mask = None if view.mask is None else view.mask[:, columns].repeat(rows // num_queries, 1)  # [G*T, *]
    out = torch.empty_like(groups)
    for b in range(batch):
        for head in range(num_kv_heads):
            scores = groups[b, head] @ view.keys[b, head].T  # [G*T, S]
            if mask is not None:
                scores[:, columns] += mask
            weights = torch.softmax(scores, dim=-1)  # float32 inside the kernel, out in the KV dtype
            out[b, head] = weights @ view.values[b, head]  # [G*T, D]
    return rearrange(out, "b k (g t) d -> b (k g) t d", t=num_queries)  # [B, H, T, D]


def _grouped_sdpa(query: torch.Tensor, view: AttentionView, scale: float) -> torch.Tensor:
    """SDPA with each KV head's query group folded into the query-length axis.

    The query heads sharing a KV head become extra query rows of one head (their mask rows
    repeated), so K/V are never expanded per query head. On this CPU it runs 4-7x faster than
    ``enable_gqa=True`` for bf16 decode over 1K-8K keys, with the same result.
    """
    num_kv_heads, num_queries = view.keys.shape[1], query.shape[2]
    folded = rearrange(query, "b (k g) t d -> b k (g t) d", k=num_kv_heads)  # [B, H_kv, G*T, D]
    mask = None if view.mask is None else view.mask.repeat(folded.shape[2] // num_queries, 1)
    out = F.scaled_dot_product_attention(folded, view.keys, view.values, attn_mask=mask, scale=scale)
    return rearrange(out, "b k (g t) d -> b (k g) t d", t=num_queries)  # [B, H, T, D]


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
