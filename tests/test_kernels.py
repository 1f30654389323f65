"""cascade's CPU weight kernel: bf16 rows times a bf16 weight equals the float64 product up to
float32 summation order, on every code path (AMX tiles, AVX512-BF16 blocks, the tails), and refuses
what it cannot take with a clear error."""

from __future__ import annotations

import pytest
import torch

from cascade import kernels
from cascade.tuning import machine_tuning

pytestmark = pytest.mark.skipif(
    not kernels.weight_kernel_available(),
    reason="cascade's weight kernel does not build here, or the CPU has neither AVX512-BF16 nor AVX2",
)


def product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.cascade_kernels.rows_times_weight(rows, weight)


@pytest.fixture(params=["amx", "avx512", "avx512-steps-in-memory-order"])
def path(request):
    """Each way the kernel can run here: AMX tiles, AVX512-BF16 blocks read across their rows (or
    AVX2's), and AVX512-BF16 one-row products read in memory order (``Tuning.step_in_memory_order``)."""
    if request.param == "amx" and "amx_bf16" not in kernels.compiled_features():
        pytest.skip("this CPU has no AMX: only the vector (AVX512-BF16 or AVX2) path runs")
    if request.param.endswith("memory-order") and not kernels.step_orders_available():
        pytest.skip("the AVX2 product has one order only")
    torch.ops.cascade_kernels.set_amx(request.param == "amx")
    torch.ops.cascade_kernels.set_step_in_memory_order(request.param.endswith("memory-order"))
    yield request.param
    torch.ops.cascade_kernels.set_amx(True)
    torch.ops.cascade_kernels.set_step_in_memory_order(machine_tuning().step_in_memory_order)


@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 7, 8, 15, 16])
@pytest.mark.parametrize("outputs, inner", [(960, 576), (96, 1536), (101, 64), (7, 37), (33, 40), (4, 32)])
def test_product_equals_float64_reference(path, num_rows, outputs, inner):
    generator = torch.Generator().manual_seed(num_rows * 1000 + outputs + inner)
    rows = torch.randn(num_rows, inner, generator=generator).bfloat16()
    weight = torch.randn(outputs, inner, generator=generator).bfloat16()
    expected = rows.double() @ weight.double().T  # bf16 products are exact in float64
    got = product(rows, weight)
    assert got.dtype == torch.float32 and got.shape == (num_rows, outputs)
    bound = 4 * inner * torch.finfo(torch.float32).eps * (rows.double().abs() @ weight.double().abs().T)
    assert ((got.double() - expected).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("outputs, inner", [(960, 576), (1000, 576), (101, 64), (7, 37)])
def test_each_row_of_a_product_equals_its_one_row_product_bit_for_bit(path, outputs, inner):
    """One row may go through blocks of 16 weight rows in memory order, several go through blocks
    of 4 for every row: a verification pass must still compute what the steps it replaces do."""
    generator = torch.Generator().manual_seed(outputs + inner)
    rows = torch.randn(9, inner, generator=generator).bfloat16()
    weight = torch.randn(outputs, inner, generator=generator).bfloat16()
    together = product(rows, weight)
    for row in range(len(rows)):
        assert torch.equal(product(rows[row : row + 1], weight)[0], together[row])


def test_non_contiguous_rows_read_as_their_values():
    rows = torch.randn(64, 6).bfloat16().T  # [6, 64] with strides (1, 6)
    weight = torch.randn(40, 64).bfloat16()
    torch.testing.assert_close(product(rows, weight), product(rows.contiguous(), weight), atol=0, rtol=0)


def test_two_threads_and_one_agree():
    rows, weight = torch.randn(3, 576).bfloat16(), torch.randn(3072, 576).bfloat16()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = product(rows, weight)
        torch.set_num_threads(2)
        torch.testing.assert_close(product(rows, weight), single, atol=0, rtol=0)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize(
    "rows, weight, message",
    [
        (torch.randn(2, 8).bfloat16(), torch.randn(4, 9).bfloat16(), "rows have 8 columns, the weight 9"),
        (torch.randn(2, 8), torch.randn(4, 8).bfloat16(), "bfloat16 rows and weight"),
        (torch.randn(2, 2, 8).bfloat16(), torch.randn(4, 8).bfloat16(), "rows [T, I] and weight [O, I]"),
        (torch.randn(2, 8).bfloat16(), torch.randn(8, 4).bfloat16().T, "the weight must be contiguous"),
    ],
)
def test_bad_operands_are_refused_by_name(rows, weight, message):
    with pytest.raises(RuntimeError, match=message.replace("[", r"\[").replace("]", r"\]")):
        product(rows, weight)


def test_layer_ops_refuse_what_they_cannot_take():
    x, norm = torch.randn(2, 64).bfloat16(), torch.ones(64).bfloat16()
    weight, cos = torch.randn(6 * 16, 64).bfloat16(), torch.ones(2, 16).bfloat16()
    with pytest.raises(RuntimeError, match=r"a contiguous bf16 residual stream \[T, C\]"):
        torch.ops.cascade_kernels.pre_attention(x.float(), norm, weight, None, None, cos, cos, 1e-6, 4, 1)
    with pytest.raises(RuntimeError, match="96 projections do not split into 7 heads"):
        torch.ops.cascade_kernels.pre_attention(x, norm, weight, None, None, cos, cos, 1e-6, 5, 1)
    with pytest.raises(RuntimeError, match=r"cos and sin \[T, D\] = \[2, 16\]"):
        torch.ops.cascade_kernels.pre_attention(x, norm, weight, None, None, cos[:1], cos[:1], 1e-6, 4, 1)
    with pytest.raises(RuntimeError, match="a bf16 norm weight of 64 values"):
        torch.ops.cascade_kernels.logits(x, norm[:32], weight, None, 1e-6)


def reference_attention(query, keys, values, scale, causal):
    """float64 attention of query [H, T, D] over keys/values [H_kv, S, D], query groups sharing a KV head."""
    heads, tokens, _ = query.shape
    group = heads // keys.shape[0]
    scores = torch.einsum("htd,hsd->hts", query.double(), keys.double().repeat_interleave(group, 0)) * scale
    if causal:
        num_keys = keys.shape[1]
        visible = torch.arange(num_keys)[None, :] <= torch.arange(num_keys - tokens, num_keys)[:, None]  # [T, S]
        scores = scores.masked_fill(~visible, float("-inf"))
    return torch.einsum("hts,hsd->htd", scores.softmax(-1), values.double().repeat_interleave(group, 0))


@pytest.mark.parametrize(
    "heads, kv_heads, tokens, num_keys, dim",
    [
        (9, 3, 1, 1000, 64),
        (9, 3, 7, 1000, 64),
        (12, 2, 1, 4099, 128),
        (12, 2, 5, 300, 128),
        (14, 2, 3, 17, 64),
        (4, 4, 16, 16, 32),
        (9, 3, 8, 257, 64),
        (2, 1, 1, 1, 64),
        (4, 2, 3, 70, 16),
        (4, 2, 9, 700, 128),
    ],
)
@pytest.mark.parametrize("causal", [True, False])
def test_decode_attention_equals_float64_reference(path, heads, kv_heads, tokens, num_keys, dim, causal):
    generator = torch.Generator().manual_seed(heads * num_keys + tokens)
    query = torch.randn(heads, tokens, dim, generator=generator).bfloat16()
    buffer = torch.randn(2, kv_heads, num_keys + 40, dim, generator=generator).bfloat16()  # a longer slot buffer
    keys, values = buffer[0, :, :num_keys], buffer[1, :, :num_keys]
    got = torch.ops.cascade_kernels.decode_attention(query, keys, values, dim**-0.5, causal)
    expected = reference_attention(query, keys, values, dim**-0.5, causal)
    assert got.dtype == torch.bfloat16 and got.shape == query.shape
    torch.testing.assert_close(got.double(), expected, atol=1e-2, rtol=1e-2)  # bf16 output rounding: 2^-8


@pytest.mark.parametrize(
    "heads, kv_heads, tokens, num_keys, dim",
    [
        (9, 3, 8, 1000, 64),
        (12, 2, 9, 611, 128),
        (14, 2, 16, 300, 64),
        (4, 2, 5, 33, 16),
        (4, 4, 3, 520, 32),
        (4, 2, 9, 700, 128),
        (4, 2, 9, 270, 16),  # 18 rows a KV head: scored two groups of 16 keys at a time
        (8, 2, 5, 300, 32),
    ],
)
def test_each_token_of_a_causal_pass_equals_its_one_token_step_bit_for_bit(
    path, heads, kv_heads, tokens, num_keys, dim
):
    """A verification pass must attend as the decode steps it replaces do: token t of the pass
    against a cache that ends at its own key, whatever the number of query rows (up to 7 x 16 here,
    several chunks of scores and of weighted sums) or where the blocks of keys end."""
    generator = torch.Generator().manual_seed(heads * num_keys + tokens + dim)
    query = torch.randn(heads, tokens, dim, generator=generator).bfloat16()
    buffer = torch.randn(2, kv_heads, num_keys + 40, dim, generator=generator).bfloat16()
    keys, values = buffer[0, :, :num_keys], buffer[1, :, :num_keys]
    scale = dim**-0.5
    together = torch.ops.cascade_kernels.decode_attention(query, keys, values, scale, True)
    for token in range(tokens):
        visible = num_keys - tokens + token + 1
        step = torch.ops.cascade_kernels.decode_attention(
            query[:, token : token + 1], keys[:, :visible], values[:, :visible], scale, True
        )
        assert torch.equal(step[:, 0], together[:, token]), f"token {token} of {tokens}"


def random_tree(nodes: int, generator: torch.Generator) -> torch.Tensor:
    """[N, N] bool: node i reads node j when j is i or one of its ancestors (parents drawn at random
    among the earlier nodes, or none: several roots below the tree's context)."""
    ancestry = torch.eye(nodes, dtype=torch.bool)
    for node in range(1, nodes):
        parent = int(torch.randint(-1, node, (1,), generator=generator))
        if parent >= 0:
            ancestry[node] |= ancestry[parent]
    return ancestry


@pytest.mark.parametrize(
    "heads, kv_heads, tokens, tail, context, dim",
    [
        (9, 3, 9, 9, 1000, 64),  # a verification pass: the root and 8 nodes
        (12, 2, 5, 12, 611, 128),  # a proposer's level: 5 nodes below 7 earlier ones
        (14, 2, 16, 16, 256, 64),  # the tree starts a block of keys
        (4, 2, 7, 7, 250, 16),  # the tree crosses into the next block
        (4, 4, 3, 3, 0, 32),  # nothing before the tree
        (9, 3, 12, 12, 520, 64),
    ],
)
def test_each_token_of_a_tree_pass_equals_its_one_token_step_bit_for_bit(
    path, heads, kv_heads, tokens, tail, context, dim
):
    """A token tree's verification must attend as the decode step of each node would: over the
    keys before the tree and its own ancestors, in order, and nothing else. Keys the mask hides may
    not even change how the visible ones pair up or fall into blocks."""
    generator = torch.Generator().manual_seed(heads * context + tokens + dim)
    query = torch.randn(heads, tokens, dim, generator=generator).bfloat16()
    num_keys = context + tail
    buffer = torch.randn(2, kv_heads, num_keys + 40, dim, generator=generator).bfloat16()
    keys, values = buffer[0, :, :num_keys], buffer[1, :, :num_keys]
    ancestry = random_tree(tail, generator)[-tokens:]  # [T, M]: the pass's tokens are the tree's last
    scale = dim**-0.5
    together = torch.ops.cascade_kernels.decode_attention_tree(query, keys, values, scale, ancestry)
    for token in range(tokens):
        read = torch.cat([torch.arange(context), context + ancestry[token].nonzero()[:, 0]])
        step = torch.ops.cascade_kernels.decode_attention(
            query[:, token : token + 1], keys[:, read], values[:, read], scale, False
        )
        assert torch.equal(step[:, 0], together[:, token]), f"token {token} of {tokens}"


@pytest.mark.parametrize(
    "mask, message",
    [
        (torch.ones(3, 9, dtype=torch.bool), r"a bool tail mask \[T, M\] with T = 3 <= M <= 8"),
        (torch.ones(2, 4, dtype=torch.bool), "with T = 3"),
        (torch.ones(3, 4), "a bool tail mask"),
    ],
)
def test_a_tree_pass_refuses_a_tail_mask_that_does_not_fit(mask, message):
    query, keys = torch.randn(4, 3, 16).bfloat16(), torch.randn(2, 8, 16).bfloat16()
    with pytest.raises(RuntimeError, match=message):
        torch.ops.cascade_kernels.decode_attention_tree(query, keys, keys, 0.25, mask)
