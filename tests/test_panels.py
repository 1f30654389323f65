"""bf16 weights in panels (cascade.panels) for the AVX2 weight kernel: the layout round-trips, the
kernel's product equals the float64 one up to float32 summation order and is the same for a row in
any pass, and a packed model computes what the unpacked one does, its verification passes bit for
bit what its decode steps do."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from cache.full import FullCache
from cascade import fused, kernels, panels
from cascade.checkpoint import load_model
from cascade.model import PassOptions
from tests.conftest import make_checkpoint

needs_avx2_kernel = pytest.mark.skipif(
    not kernels.weight_kernel_available() or "avx2" not in kernels.compiled_features(),
    reason="panels are the AVX2 weight kernel's layout; this CPU's build has AVX512-BF16, or no kernels",
)


def product(rows: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.cascade_kernels.rows_times_weight(rows, weight)


def test_panels_round_trip_and_widen_to_the_transpose():
    weight = torch.randn(48, 37).bfloat16()  # [O, I]
    packed = panels.pack(weight)
    assert packed.shape == (3, 37, 16) and torch.equal(packed[1, 5], weight[16:32, 5])
    assert torch.equal(panels.unpack(packed), weight)
    assert torch.equal(panels.widened_transpose(packed), weight.float().T)


def test_only_bf16_linears_of_whole_panels_are_packed():
    assert isinstance(panels.packed(nn.Linear(8, 32).bfloat16()), panels.PanelLinear)
    for linear in (nn.Linear(8, 20).bfloat16(), nn.Linear(8, 32)):  # 20 outputs; float32
        assert panels.packed(linear) is linear


@needs_avx2_kernel
@pytest.mark.parametrize("num_rows", [1, 2, 3, 4, 5, 6, 7, 9, 13, 16])
@pytest.mark.parametrize("outputs, inner", [(160, 300), (16, 37), (48, 1536), (80, 64), (27 * 16, 300)])
def test_panel_product_equals_float64_reference(num_rows, outputs, inner):
    """Every tile: one row over 4 panels or one; groups of 2-6 rows over chunks of 6 panels (27 panels: each
    thread's range holds chunks) in tiles of 2 x 3, 3 x 2, 4 x 1.5 or 5-6 x 1 panels, and one panel at a time."""
    generator = torch.Generator().manual_seed(num_rows * 1000 + outputs + inner)
    rows = torch.randn(num_rows, inner, generator=generator).bfloat16()
    weight = torch.randn(outputs, inner, generator=generator).bfloat16()
    got = product(rows, panels.pack(weight))
    expected = rows.double() @ weight.double().T  # bf16 products are exact in float64
    assert got.dtype == torch.float32 and got.shape == (num_rows, outputs)
    bound = 4 * inner * torch.finfo(torch.float32).eps * (rows.double().abs() @ weight.double().abs().T)
    assert ((got.double() - expected).abs() <= bound + 1e-30).all()


@needs_avx2_kernel
@pytest.mark.parametrize("num_rows", [2, 3, 4, 5, 6, 7, 8, 9, 16])
def test_each_row_of_a_panel_pass_equals_its_one_row_product_bit_for_bit(num_rows):
    generator = torch.Generator().manual_seed(num_rows)
    rows = torch.randn(num_rows, 576, generator=generator).bfloat16()
    packed = panels.pack(torch.randn(27 * 16, 576, generator=generator).bfloat16())  # chunks of 6 and panels left
    together = product(rows, packed)
    for row in range(num_rows):
        assert torch.equal(product(rows[row : row + 1], packed)[0], together[row])


@needs_avx2_kernel
def test_panels_of_another_width_are_refused_by_name():
    with pytest.raises(RuntimeError, match=r"or panels \[O / 16, I, 16\]"):
        product(torch.randn(2, 8).bfloat16(), torch.randn(2, 8, 8).bfloat16())


def passes(model, steps: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """A 40-token prefill's last logits [1, 1, V], then each of ``steps`` [1, K] as its own step
    and all of them in one verification pass -> (prefill, steps [1, K, V], pass [1, K, V])."""
    cache = FullCache(model.cache_layout(64))
    prefill = model(torch.arange(3, 43)[None], cache, num_logits=1)
    cache.commit(40)
    one_by_one = torch.cat([model(steps[:, k : k + 1], cache) for k in range(steps.shape[1])], dim=1)
    cache.rollback(40)
    return prefill, one_by_one, model(steps, cache)


@needs_avx2_kernel
def test_a_packed_model_passes_as_the_unpacked_one_and_its_verification_equals_its_steps(tmp_path, monkeypatch):
    monkeypatch.setattr(fused, "cpu_layers", True)
    monkeypatch.setattr(fused, "attention_kernel", kernels.attention_kernel_available())
    checkpoint = make_checkpoint(tmp_path / "m", "qwen2-tied")  # q/k/v biases, tied embedding
    unpacked, model = (load_model(checkpoint, torch.bfloat16, torch.device("cpu")) for _ in range(2))
    for each in (unpacked, model):
        each.options = PassOptions(16)
    embedding = model.embed_tokens.weight.clone()
    assert panels.applies(model)
    panels.pack_panels(model)
    assert isinstance(model.lm_head, panels.PanelLinear) and model.lm_head.weight is model.embed_tokens.weight
    assert model.pass_weight_bytes() == unpacked.pass_weight_bytes()
    ids = torch.tensor([[0, 17, 319, 64]])
    assert torch.equal(model.embed_tokens(ids), embedding[ids])

    steps = torch.tensor([[5, 7, 300, 11, 2]])
    prefill, one_by_one, verification = passes(model, steps)
    assert torch.equal(verification, one_by_one)
    for got, expected in zip((prefill, one_by_one), passes(unpacked, steps)[:2], strict=True):
        scale = expected.float().abs().max()  # bf16 logits after float32 sums in another order
        torch.testing.assert_close(got.float(), expected.float(), rtol=0, atol=0.03 * scale.item())

    kept = torch.tensor([300, 5, 7, 11])
    model.keep_output_tokens(kept)  # 4 rows: a plain projection again, its sums in the [O, I] kernel's order
    cut = passes(model, steps)[1]
    scale = one_by_one.float().abs().max().item()
    torch.testing.assert_close(cut[..., kept].float(), one_by_one[..., kept].float(), rtol=0, atol=0.01 * scale)
