"""Attention kernel families against a float64 reference, for every pass shape the cascade runs,
and the choice of family: auto per device, a clear error for one that cannot run here."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from cache.base import AttentionView
from cache.slots import causal_mask, tree_mask
from cascade import attention
from cascade.attention import FLASH_ATTN_INSTALLED, FLEX_KEY_BLOCK, KERNELS, resolve_kernels
from cascade.errors import CascadeError
from cascade.tree import TokenTree
from tests.test_pipeline import runtime_for

HEADS, KV_HEADS, HEAD_DIM = 6, 2, 16
CUDA = torch.cuda.is_available()
TREE = TokenTree.best_first((0.6, 0.2, 0.1), nodes=19, depth=5)
TREE_LEVEL = 3
"""The token tree of the tree shapes: a verification pass reads its root and every node, a
proposer's pass the nodes of one level after the earlier levels' (already in the cache)."""
SHAPES = {  # name: (queries, keys, how the view is built)
    "decode": (1, 50, "dynamic"),
    "verify": (7, 300, "dynamic"),
    "short-pass": (30, 80, "dynamic"),
    "first-prefill-chunk": (96, 96, "dynamic"),
    "later-prefill-chunk": (96, 300, "dynamic"),
    "static-decode": (1, 50, "static"),
    "static-verify": (5, 50, "static"),
    "tree-verify": (1 + len(TREE), 300, "tree"),
    "tree-level": (len(TREE.level(TREE_LEVEL)), 300, "tree-level"),
    "static-tree-verify": (1 + len(TREE), 50, "static-tree"),
}
BUFFER_SLOTS = 64


def make_view(
    num_queries: int, num_keys: int, how: str, dtype: torch.dtype, device: str, buffer_slots: int = BUFFER_SLOTS
):
    """Random query [1, H, T, D] and a view whose pass tokens are keys num_keys - T .. num_keys - 1."""
    generator = torch.Generator().manual_seed(num_queries * 1000 + num_keys)
    size = buffer_slots if how.startswith("static") else num_keys
    query = torch.randn(1, HEADS, num_queries, HEAD_DIM, generator=generator)
    keys, values = torch.randn(2, 1, KV_HEADS, size, HEAD_DIM, generator=generator)
    query, keys, values = (x.to(device=device, dtype=dtype) for x in (query, keys, values))
    slots = torch.arange(num_keys - num_queries, num_keys, device=device)
    if how == "static":  # the whole buffer: slots past the pass hold stale values, hidden by the mask
        valid = torch.tensor([num_keys], dtype=torch.int32, device=device)
        return query, AttentionView(keys, values, causal_mask(slots, size, dtype), static=True, valid_lengths=valid)
    if how == "static-tree":  # the whole buffer under a tree's mask, with no valid length
        mask = tree_mask(slots, size, TREE.tree_pass(torch.device(device)).ancestry, dtype)
        return query, AttentionView(keys, values, mask, static=True)
    if how.startswith("tree"):  # the pass's last tokens are tree nodes, reading only their ancestors
        tree_pass = TREE.tree_pass(torch.device(device), TREE_LEVEL if how == "tree-level" else None)
        mask = tree_mask(slots, num_keys, tree_pass.ancestry, dtype)
        return query, AttentionView(keys, values, mask, masked_tail=num_queries + tree_pass.earlier_nodes)
    return query, AttentionView(keys, values, None, causal=num_queries > 1)


def reference(query: torch.Tensor, view: AttentionView, scale: float) -> torch.Tensor:
    group = HEADS // KV_HEADS
    keys = view.keys.double().repeat_interleave(group, 1)  # [1, H, S, D]
    values = view.values.double().repeat_interleave(group, 1)
    scores = query.double() @ keys.transpose(-1, -2) * scale  # [1, H, T, S]
    num_queries, num_keys = scores.shape[-2:]
    if view.causal:
        slots = torch.arange(num_keys - num_queries, num_keys, device=scores.device)
        scores = scores + causal_mask(slots, num_keys, torch.float64)
    elif view.mask is not None:
        scores = scores + view.mask.double()
    return scores.softmax(-1) @ values  # [1, H, T, D]


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("family", ["cpu", "sdpa", "cuda", "flex"])  # cuda's products run on any device
def test_kernel_families_match_the_reference(family, shape):
    query, view = make_view(*SHAPES[shape], torch.float32, "cpu")
    out = KERNELS[family](query, view, HEAD_DIM**-0.5)
    torch.testing.assert_close(out.double(), reference(query, view, HEAD_DIM**-0.5), rtol=1e-4, atol=1e-5)


def recorded_calls(monkeypatch, kernel_name: str) -> list:
    """Wraps ``attention.<kernel_name>`` to record each call's arguments; returns the record."""
    kernel, calls = getattr(attention, kernel_name), []

    def recording(*args):
        calls.append(args)
        return kernel(*args)

    monkeypatch.setattr(attention, kernel_name, recording)
    return calls


def test_cuda_family_sums_blockwise_products_to_the_reference(monkeypatch):
    """Over at least two blocks of aligned keys a static verification pass takes the blockwise
    weights-values product (here 4-slot alignment and blocks of up to 16 keys, on CPU tensors)."""
    monkeypatch.setattr(attention, "SPLIT_KEYS", 16)
    monkeypatch.setattr(attention, "SLOT_ALIGNMENT", 4)
    query, view = make_view(*SHAPES["static-verify"], torch.float32, "cpu")
    assert attention.block_size(view.keys.shape[2]) < view.keys.shape[2] // 2
    taken = recorded_calls(monkeypatch, "blockwise_product")
    out = KERNELS["cuda"](query, view, HEAD_DIM**-0.5)
    assert len(taken) == 1
    torch.testing.assert_close(out.double(), reference(query, view, HEAD_DIM**-0.5), rtol=1e-4, atol=1e-5)


@pytest.mark.skipif(attention.CPU_FLASH_WITH_LSE is None, reason="this PyTorch has no CPU flash kernel with its LSE")
def test_a_later_prefill_chunk_folds_query_groups_over_the_earlier_keys_with_the_same_bits(monkeypatch):
    """A later bf16 prefill chunk over a slice of a longer buffer (two sequences) reads the earlier
    keys once per KV head, its query groups folded into rows, and gives the bits of the same kernel
    over the keys repeated per query head; a tensor the size of a repeated prefix is never made."""
    num_queries, num_keys = 96, 300
    generator = torch.Generator().manual_seed(7)
    query = torch.randn(2, num_queries, HEADS, HEAD_DIM, generator=generator).transpose(1, 2).bfloat16()
    buffer = torch.randn(2, 2, KV_HEADS, num_keys + 40, HEAD_DIM, generator=generator).bfloat16()
    view = AttentionView(buffer[0, :, :, :num_keys], buffer[1, :, :, :num_keys], None, causal=True)
    group, scale = HEADS // KV_HEADS, HEAD_DIM**-0.5
    halves = [
        attention.CPU_FLASH_WITH_LSE(
            query, keys.repeat_interleave(group, 1), values.repeat_interleave(group, 1), is_causal=causal, scale=scale
        )
        for keys, values, causal in (
            (view.keys[:, :, :-num_queries], view.values[:, :, :-num_queries], False),
            (view.keys[:, :, -num_queries:], view.values[:, :, -num_queries:], True),
        )
    ]
    (prefix_out, prefix_lse), (block_out, block_lse) = halves
    total_lse = torch.logaddexp(prefix_lse, block_lse)
    repeated = prefix_out.float() * (prefix_lse - total_lse).exp()[..., None]
    repeated = (repeated + block_out.float() * (block_lse - total_lse).exp()[..., None]).bfloat16()
    largest = []

    def recording(tensor, *args, **kwargs):
        largest.append(tensor.shape[2])
        return torch.repeat_interleave(tensor, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "repeat_interleave", recording)
    out = attention.attend_cpu(query, view, scale)
    assert torch.equal(out, repeated)
    assert largest and max(largest) == num_queries  # only the chunk's own keys are repeated
    torch.testing.assert_close(out.double(), reference(query, view, scale), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize(
    "family,products,dtype,tolerance",
    [
        ("cpu", "_per_head_matmul", torch.float32, 1e-4),
        ("cuda", "_attention_weights", torch.float32, 1e-4),
        ("flash", "_attention_weights", torch.bfloat16, 2e-2),  # no flash-attn call: runs on CPU tensors
    ],
)
@pytest.mark.parametrize("shape", ["tree-verify", "tree-level"])
def test_tree_passes_of_any_width_run_as_products_masking_only_the_tail(
    shape, family, products, dtype, tolerance, monkeypatch
):
    """A token-tree pass (20 queries for the whole tree) takes the family's matrix products, not
    SDPA, which add only the mask's last ``masked_tail`` columns: the keys before the tree are read
    by every node."""
    query, view = make_view(*SHAPES[shape], dtype, "cpu")
    assert view.mask[:, : -view.masked_tail].eq(0).all() and view.mask[:, -view.masked_tail :].isinf().any()
    taken = recorded_calls(monkeypatch, products)
    out = KERNELS[family](query, view, HEAD_DIM**-0.5)
    assert len(taken) == 1
    torch.testing.assert_close(out.double(), reference(query, view, HEAD_DIM**-0.5), rtol=tolerance, atol=tolerance)


@pytest.mark.parametrize(
    "shape,compiled",
    [
        ("static-decode", 1),
        ("static-verify", 1),
        ("static-tree-verify", 1),
        ("verify", 0),
        ("tree-verify", 0),
    ],
)
def test_flex_compiles_flex_attention_for_static_views_only(shape, compiled, monkeypatch):
    """Static views (the graphed passes, their shapes fixed) take the compiled FlexAttention;
    dynamic ones, whose key count moves every pass, would compile anew each time and take the
    device's products instead."""
    query, view = make_view(*SHAPES[shape], torch.float32, "cpu")
    taken = recorded_calls(monkeypatch, "_compiled_flex_under_mask")
    KERNELS["flex"](query, view, HEAD_DIM**-0.5)
    assert len(taken) == compiled


@pytest.mark.parametrize("shape", ["static-decode", "static-verify"])
def test_flex_reads_only_the_key_blocks_a_static_pass_uses(shape):
    """A static pass over a buffer kept from a longer request: keys and values past the block that
    holds its last valid key are NaN here, which any read of them would spread into the output."""
    num_queries, num_keys, _ = SHAPES[shape]
    query, view = make_view(num_queries, num_keys, "static", torch.float32, "cpu", buffer_slots=4 * FLEX_KEY_BLOCK)
    view.keys[:, :, FLEX_KEY_BLOCK:] = view.values[:, :, FLEX_KEY_BLOCK:] = float("nan")
    out = KERNELS["flex"](query, view, HEAD_DIM**-0.5)
    torch.testing.assert_close(
        out.double(),
        reference(
            query,
            dataclasses.replace(
                view,
                keys=view.keys[:, :, :FLEX_KEY_BLOCK],
                values=view.values[:, :, :FLEX_KEY_BLOCK],
                mask=view.mask[:, :FLEX_KEY_BLOCK],
            ),
            HEAD_DIM**-0.5,
        ),
        rtol=1e-4,
        atol=1e-5,
    )


def test_blocks_are_the_largest_aligned_divisor_up_to_the_split():
    assert attention.block_size(4096) == 1024
    assert attention.block_size(120064) == 896  # 64 * 1876, 1876 = 4 * 7 * 67
    assert attention.block_size(64 * 17) == 64


def test_auto_picks_the_cpu_family_on_cpu_and_flash_explains_what_it_needs(tiny_dir, tiny_draft_dir):
    assert resolve_kernels("auto", torch.device("cpu")) == "cpu"
    assert resolve_kernels("sdpa", torch.device("cpu")) == "sdpa"
    with pytest.raises(CascadeError, match="flash needs a CUDA device"):
        resolve_kernels("flash", torch.device("cpu"))
    with pytest.raises(CascadeError, match="cuda needs a CUDA device; this run is on cpu"):
        resolve_kernels("cuda", torch.device("cpu"))
    assert resolve_kernels("flex", torch.device("cpu")) == "flex"
    with pytest.raises(CascadeError, match="unknown kernels 'xformers'"):
        resolve_kernels("xformers", torch.device("cpu"))
    if not CUDA:
        with pytest.raises(CascadeError, match="attention: flash needs"):
            runtime_for("autoregressive", tiny_dir, tiny_draft_dir, attention="flash")


@pytest.mark.gpu
@pytest.mark.skipif(not (CUDA and FLASH_ATTN_INSTALLED), reason="needs CUDA and flash-attn")
@pytest.mark.parametrize("shape", list(SHAPES))
def test_flash_family_matches_the_reference_on_cuda(shape):
    query, view = make_view(*SHAPES[shape], torch.bfloat16, "cuda")
    out = KERNELS["flash"](query, view, HEAD_DIM**-0.5)
    torch.testing.assert_close(out.double(), reference(query, view, HEAD_DIM**-0.5), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("family", ["cuda", "flex"])
def test_cuda_and_flex_families_match_the_reference_on_cuda(family, shape, dtype, tolerance):
    assert resolve_kernels("auto", torch.device("cuda")) == ("flash" if FLASH_ATTN_INSTALLED else "cuda")
    query, view = make_view(*SHAPES[shape], dtype, "cuda")
    out = KERNELS[family](query, view, HEAD_DIM**-0.5)
    torch.testing.assert_close(out.double(), reference(query, view, HEAD_DIM**-0.5), rtol=tolerance, atol=tolerance)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs CUDA")
@pytest.mark.parametrize("dtype,tolerance", [(torch.float32, 1e-4), (torch.bfloat16, 2e-2)])
def test_cuda_family_blockwise_verification_over_a_long_static_buffer(dtype, tolerance):
    """The production sizes: a 7-token static pass over a 4096-slot buffer (four 1024-key blocks)."""
    query, view = make_view(7, 3000, "static", dtype, "cuda", buffer_slots=4096)
    out = KERNELS["cuda"](query, view, HEAD_DIM**-0.5)
    torch.testing.assert_close(out.double(), reference(query, view, HEAD_DIM**-0.5), rtol=tolerance, atol=tolerance)
