"""Int8 and 4-bit drafts: the packed weight holds the rounded weight; the kernels compute exactly the
integer sums of per-64-input quantised activations; fused quantised passes run the kernels and stay
as close to the bf16 model as the eager quantised passes; a speculative run with a quantised draft (a
separate draft, or the target's own weights) decodes exactly the target's greedy output; the target
itself cannot be quantised."""

from __future__ import annotations

import pytest
import torch
from pydantic import ValidationError

from cache.full import FullCache
from cascade import fused, kernels
from cascade.checkpoint import load_model
from cascade.graphs import MAX_GRAPH_TOKENS
from cascade.quantise import (
    Int4Linear,
    Int8Linear,
    dense_quantised_product,
    int4_scales,
    pack,
    pack_int4,
    quantise,
    unpack,
    unpack_int4,
)
from configs.schema import PipelineConfig
from tests.conftest import make_checkpoint
from tests.test_fused import CPU, SHORT_PASSES, decode, layer_op_calls, layer_op_calls_expected
from tests.test_pipeline import PROMPT, generate, runtime_for

needs_quantised_kernels = pytest.mark.skipif(
    not kernels.quantised_kernels_available(),
    reason="cascade's quantised kernels need AVX512-VNNI or AVX2 and a C++ compiler",
)
SHAPES = [(960, 576), (96, 1536), (101, 64), (7, 37), (33, 130), (16, 64)]


def linear(outputs: int, inputs: int, seed: int) -> torch.nn.Linear:
    layer = torch.nn.Linear(inputs, outputs, bias=False)
    layer.weight.data = torch.randn(outputs, inputs, generator=torch.Generator().manual_seed(seed)).bfloat16()
    return layer


@pytest.mark.parametrize("outputs, inputs", SHAPES)
def test_packing_keeps_every_weight_and_rounding_stays_within_half_a_step(outputs, inputs):
    layer = linear(outputs, inputs, seed=outputs + inputs)
    quantised = Int8Linear(layer)
    rounded = unpack(quantised.weight, outputs, inputs)
    assert torch.equal(unpack(pack(rounded), outputs, inputs), rounded)
    scales = quantised.scales.double()[:, None]
    error = (rounded.double() * scales - layer.weight.double()).abs()
    assert (error <= scales / 2 * (1 + 1e-5)).all()
    assert rounded.abs().amax(dim=1).eq(127).all()  # each row's largest weight sets its scale


def reference_int8_product(rows: torch.Tensor, quantised: Int8Linear) -> torch.Tensor:
    """The kernel's arithmetic: activations rounded per 64 inputs as it rounds them (times the
    float32 inverse of their scale, ties to even), then integer block sums in float64."""
    outputs, inputs = quantised.scales.shape[0], rows.shape[1]
    weight = unpack(quantised.weight, outputs, inputs).double()  # [O, I]
    blocks = torch.nn.functional.pad(rows.float(), (0, -inputs % 64)).view(rows.shape[0], -1, 64)  # [T, B, 64]
    row_scales = blocks.abs().amax(dim=-1, keepdim=True) / 127  # [T, B, 1] float32
    inverse = torch.where(row_scales > 0, 1 / row_scales, 0)
    levels = torch.round(blocks * inverse).double()
    padded = torch.nn.functional.pad(weight, (0, -inputs % 64)).view(outputs, -1, 64)  # [O, B, 64]
    sums = torch.einsum("tbi,obi->tob", levels, padded)  # exact integers
    return (sums * row_scales.double().squeeze(-1)[:, None, :]).sum(-1) * quantised.scales.double()


@needs_quantised_kernels
@pytest.mark.parametrize("num_rows", [1, 3, 16])
def test_int8_kernel_amx_and_vnni_paths_compute_the_same_sums(num_rows):
    if "amx_int8" not in kernels.compiled_features():
        pytest.skip("this CPU has no AMX-INT8: only the AVX512-VNNI path runs")
    quantised = Int8Linear(linear(960, 576, seed=num_rows))
    rows = torch.randn(num_rows, 576, generator=torch.Generator().manual_seed(1)).bfloat16()
    tiles = torch.ops.cascade_kernels.rows_times_int8(rows, quantised.weight, quantised.scales)
    try:
        torch.ops.cascade_kernels.set_amx(False)
        vectors = torch.ops.cascade_kernels.rows_times_int8(rows, quantised.weight, quantised.scales)
    finally:
        torch.ops.cascade_kernels.set_amx(True)
    assert torch.equal(tiles, vectors)  # exact int32 block sums either way


@needs_quantised_kernels
def test_int8_kernel_refuses_what_it_cannot_take():
    quantised = Int8Linear(linear(32, 128, seed=0))
    with pytest.raises(RuntimeError, match="rows have 64 columns, the packed weight 128"):
        torch.ops.cascade_kernels.rows_times_int8(torch.randn(1, 64).bfloat16(), quantised.weight, quantised.scales)
    with pytest.raises(RuntimeError, match="1 <= T <= 16"):
        torch.ops.cascade_kernels.rows_times_int8(torch.randn(17, 128).bfloat16(), quantised.weight, quantised.scales)
    with pytest.raises(RuntimeError, match="bfloat16 rows"):
        torch.ops.cascade_kernels.rows_times_int8(torch.randn(1, 128), quantised.weight, quantised.scales)


@pytest.mark.parametrize("outputs, inputs", SHAPES)
def test_int4_packing_keeps_every_level_and_rounding_stays_within_half_a_step(outputs, inputs):
    layer = linear(outputs, inputs, seed=outputs + inputs)
    quantised = Int4Linear(layer)
    levels = unpack_int4(quantised.weight, outputs, inputs)
    assert levels.max() <= 15 and torch.equal(unpack_int4(pack_int4(levels), outputs, inputs), levels)
    scale, low = (part.double().repeat_interleave(32, dim=1)[:, :inputs] for part in int4_scales(quantised.scales))
    error = (levels.double() * scale + low - layer.weight.double()).abs()
    assert (error <= scale / 2 + 2**-11 * low.abs() + 1e-12).all()  # half a step, and the low's float16 rounding


@pytest.mark.parametrize("group_inputs", [64, 128, 256])
def test_coarser_int4_groups_share_one_scale_and_low_and_round_within_half_their_step(group_inputs):
    outputs, inputs = 48, 320  # 320: the last group of 128 or 256 inputs ends in zeros
    layer = linear(outputs, inputs, seed=group_inputs)
    quantised, finest = Int4Linear(layer, group_inputs), Int4Linear(layer)
    assert quantised.scales.shape == finest.scales.shape == (10, 2, outputs)  # stored per 32 inputs
    first_of_its_group = torch.arange(10) // (group_inputs // 32) * (group_inputs // 32)
    assert torch.equal(quantised.scales, quantised.scales[first_of_its_group])

    def rounding_error(q: Int4Linear) -> torch.Tensor:
        levels = unpack_int4(q.weight, outputs, inputs).double()
        scale, low = (part.double().repeat_interleave(32, dim=1)[:, :inputs] for part in int4_scales(q.scales))
        error = (levels * scale + low - layer.weight.double()).abs()
        assert (error <= scale / 2 + 2**-11 * low.abs() + 1e-12).all()  # half a step, and the low's rounding
        return error.mean()

    assert rounding_error(quantised) > rounding_error(finest)  # wider ranges, coarser steps
    with pytest.raises(ValueError, match="multiple of 32 inputs, not 48"):
        Int4Linear(layer, 48)


def reference_int4_product(rows: torch.Tensor, quantised: Int4Linear) -> torch.Tensor:
    """The int4 kernel's arithmetic: activations rounded per 64 inputs as for int8, integer sums per
    group of 32 times its scale, plus its low times the group's sum of activations, in float64."""
    outputs, inputs = quantised.scales.shape[2], rows.shape[1]
    levels = unpack_int4(quantised.weight, outputs, inputs).double()  # [O, I]
    blocks = torch.nn.functional.pad(rows.float(), (0, -inputs % 64)).view(rows.shape[0], -1, 64)  # [T, B, 64]
    row_scales = blocks.abs().amax(dim=-1, keepdim=True) / 127  # [T, B, 1] float32
    activations = torch.round(blocks * torch.where(row_scales > 0, 1 / row_scales, 0)).double()
    groups = activations.view(rows.shape[0], -1, 32)  # [T, G, 32]
    padded = torch.nn.functional.pad(levels, (0, -inputs % 64)).view(outputs, -1, 32)  # [O, G, 32]
    scale, low = (part.double() for part in int4_scales(quantised.scales))  # [O, G] each
    sums = torch.einsum("tgi,ogi->tog", groups, padded) * scale + groups.sum(-1)[:, None, :] * low  # [T, O, G]
    return (sums.view(*sums.shape[:2], -1, 2).sum(-1) * row_scales.double().squeeze(-1)[:, None, :]).sum(-1)


# format -> (its layer, its kernel, the kernel's arithmetic in float64, how far from the exact product it
# may be: ~1% with 255 levels a row and activations rounded per 64; ~10% with 16 levels a group of 32)
KERNELS = {
    "int8": (Int8Linear, "rows_times_int8", reference_int8_product, 0.02),
    "int4": (Int4Linear, "rows_times_int4", reference_int4_product, 0.15),
}


@needs_quantised_kernels
@pytest.mark.parametrize("num_rows", [1, 2, 5, 16])
@pytest.mark.parametrize("outputs, inputs", SHAPES)
@pytest.mark.parametrize("kind", KERNELS)
def test_quantised_kernel_equals_its_arithmetic_in_float64(kind, num_rows, outputs, inputs):
    layer, kernel, reference, error = KERNELS[kind]
    weights = linear(outputs, inputs, seed=num_rows)
    quantised = layer(weights)
    rows = torch.randn(num_rows, inputs, generator=torch.Generator().manual_seed(inputs)).bfloat16()
    rows[0, :3] = 0  # a block's zeros stay zero
    got = getattr(torch.ops.cascade_kernels, kernel)(rows, quantised.weight, quantised.scales)
    assert got.dtype == torch.float32 and got.shape == (num_rows, outputs)
    expected = reference(rows, quantised)
    torch.testing.assert_close(got.double(), expected, atol=1e-4 * expected.abs().max().item(), rtol=1e-5)
    exact = rows.double() @ weights.weight.double().T
    assert (got.double() - exact).norm() <= error * exact.norm()


@needs_quantised_kernels
@pytest.mark.parametrize("kind", KERNELS)
@pytest.mark.parametrize("outputs", [101, 117])  # 7 and 8 blocks of 16: AVX2 one-row products take 4 at once
def test_each_row_of_a_wider_quantised_pass_equals_its_one_row_product_bit_for_bit(kind, outputs):
    """Integer sums are exact and each row's float32 arithmetic runs alone (on AVX512-VNNI, AMX and
    AVX2 alike), so a draft's catch-up pass proposes what its single steps would."""
    layer, kernel, _, _ = KERNELS[kind]
    quantised = layer(linear(outputs, 576, seed=7))
    rows = torch.randn(16, 576, generator=torch.Generator().manual_seed(8)).bfloat16()
    product = getattr(torch.ops.cascade_kernels, kernel)
    wide = product(rows, quantised.weight, quantised.scales)
    for t in (0, 5, 15):
        assert torch.equal(wide[t : t + 1], product(rows[t : t + 1], quantised.weight, quantised.scales))


@needs_quantised_kernels
def test_the_int4_kernel_takes_coarser_groups_as_its_arithmetic_says():
    quantised = Int4Linear(linear(96, 1536, seed=5), 128)
    rows = torch.randn(3, 1536, generator=torch.Generator().manual_seed(6)).bfloat16()
    got = torch.ops.cascade_kernels.rows_times_int4(rows, quantised.weight, quantised.scales)
    expected = reference_int4_product(rows, quantised)
    torch.testing.assert_close(got.double(), expected, atol=1e-4 * expected.abs().max().item(), rtol=1e-5)


@needs_quantised_kernels
def test_int4_kernel_refuses_what_it_cannot_take():
    quantised, product = Int4Linear(linear(32, 128, seed=0)), torch.ops.cascade_kernels.rows_times_int4
    rows = torch.randn(1, 128).bfloat16()
    with pytest.raises(RuntimeError, match="rows have 64 columns, the packed weight 128"):
        product(rows[:, :64], quantised.weight, quantised.scales)
    with pytest.raises(RuntimeError, match="float16 scales and lows"):
        product(rows, quantised.weight, quantised.scales.float())
    with pytest.raises(RuntimeError, match="do not fit a packed weight"):
        product(rows, quantised.weight, quantised.scales[..., :8].contiguous())


@pytest.mark.parametrize("emulated", [True, False])
@pytest.mark.parametrize("kind", KERNELS)
def test_an_unpacked_quantised_product_rounds_once_to_bf16(monkeypatch, kind, emulated):
    """A prefill chunk's product unpacks the weight; where the CPU emulates bf16 products it multiplies
    in float32 (several times faster there) and rounds to bf16 once, as a bf16 product does: within
    half a bf16 step of the exact product with the rounded weight."""
    monkeypatch.setattr(kernels, "cpu_has_avx512_bf16", lambda: not emulated)
    layer, _, _, _ = KERNELS[kind]
    quantised = layer(linear(40, 200, seed=3))
    rows = torch.randn(33, 200, generator=torch.Generator().manual_seed(4)).bfloat16()
    got = dense_quantised_product(rows, quantised.weight, quantised.scales)
    identity = torch.eye(200).bfloat16()  # the rounded weight, column by column: exact in either dtype
    weight = dense_quantised_product(identity, quantised.weight, quantised.scales).double().T  # [O, I]
    exact = rows.double() @ weight.T
    half_step = exact.abs() * 2.0**-8 + 1e-3  # float32 summation error is far below a bf16 step
    assert got.dtype == torch.float32 and ((got.double() - exact).abs() <= half_step).all()


@needs_quantised_kernels
@pytest.mark.parametrize("bits", [8, 4])
def test_fused_quantised_passes_run_the_layer_ops_and_stay_as_close_to_bf16_as_eager_ones(tmp_path, bits):
    checkpoint = make_checkpoint(tmp_path / "m", "qwen2-bias")
    reference = decode(load_model(checkpoint, torch.bfloat16, CPU), "full", 0, SHORT_PASSES).float()
    model = quantise(load_model(checkpoint, torch.bfloat16, CPU), bits)
    fused.use_cpu_kernels()
    eager_error = (decode(model, "full", 0, SHORT_PASSES).float() - reference).abs().mean()
    decode(model, "full", MAX_GRAPH_TOKENS, SHORT_PASSES)  # compiles
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        fused_error = (decode(model, "full", MAX_GRAPH_TOKENS, SHORT_PASSES).float() - reference).abs().mean()
    assert fused_error <= 2 * eager_error + 0.01 * reference.abs().mean(), (fused_error, eager_error)
    assert layer_op_calls(profile) == layer_op_calls_expected(model, SHORT_PASSES)


@needs_quantised_kernels
@pytest.mark.parametrize("bits", [8, 4])
def test_a_quantised_pass_of_every_layer_in_one_call_equals_layer_by_layer_bit_for_bit(
    tmp_path, bits, monkeypatch, torch_threads
):
    """``decoder_layers`` runs a quantised draft's layers in one parallel region too, each thread
    quantising the rows for its share of every product: the same bits as the layer-by-layer ops."""
    model = quantise(load_model(make_checkpoint(tmp_path / "m", "qwen2-bias"), torch.bfloat16, CPU), bits)
    fused.use_cpu_kernels()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        whole = decode(model, "full", MAX_GRAPH_TOKENS, SHORT_PASSES)
    assert layer_op_calls(profile)["decoder_layers"] == len(SHORT_PASSES)
    monkeypatch.setattr(fused, "decoder_layers_apply", lambda *args: False)
    assert torch.equal(decode(model, "full", MAX_GRAPH_TOKENS, SHORT_PASSES), whole)


@needs_quantised_kernels
def test_a_quantised_pass_of_more_rows_than_its_kernels_take_is_refused_by_name(tmp_path):
    model = quantise(load_model(make_checkpoint(tmp_path / "m", "qwen2-bias"), torch.bfloat16, CPU), 8)
    fused.use_cpu_kernels()
    cache = FullCache(model.cache_layout(40))
    positions = cache.allocate(17)
    cos, sin = model.rotary.cos_sin(positions, model.dtype)  # [17, D] each
    x = model.embed_tokens(torch.randint(0, model.spec.vocab_size, (17,)))  # [17, C]
    spec = model.spec
    with pytest.raises(RuntimeError, match=r"at most 16 rows through quantised weights|1 <= T <= 16"):
        fused.decoder_layers(
            x,
            cos,
            sin,
            model._kernel_operands(),
            [cache.plain_pass()],
            [17],
            spec.rms_norm_eps,
            spec.num_heads,
            spec.num_kv_heads,
            model.layers[0].self_attn.scale,
        )


@needs_quantised_kernels
def test_a_model_quantised_after_fused_passes_runs_its_quantised_weights(tmp_path):
    """The layer op's operands are gathered once per model: quantising afterwards must not leave the
    passes on the bf16 weights gathered before."""
    checkpoint = make_checkpoint(tmp_path / "m", "qwen2-bias")
    fused.use_cpu_kernels()
    quantised_first = quantise(load_model(checkpoint, torch.bfloat16, CPU), 4)
    expected = decode(quantised_first, "full", MAX_GRAPH_TOKENS, SHORT_PASSES)
    model = load_model(checkpoint, torch.bfloat16, CPU)
    bf16 = decode(model, "full", MAX_GRAPH_TOKENS, SHORT_PASSES)
    quantise(model, 4)
    assert torch.equal(decode(model, "full", MAX_GRAPH_TOKENS, SHORT_PASSES), expected)
    assert not torch.equal(expected, bf16)


@pytest.mark.parametrize("self_draft", [False, True], ids=["draft", "self-draft"])
@pytest.mark.parametrize("setting, linear_type", [("int8", Int8Linear), ("int4", Int4Linear)])
def test_speculation_with_a_quantised_draft_decodes_the_targets_greedy_output(
    setting, linear_type, self_draft, tiny_dir, tiny_draft_dir
):
    expected = generate(runtime_for("autoregressive", tiny_dir, tiny_draft_dir), PROMPT).token_ids
    draft = tiny_dir if self_draft else tiny_draft_dir
    runtime = runtime_for("speculative", tiny_dir, draft, [f"draft.quantise={setting}", "stages.0.schedule=fixed"])
    assert isinstance(runtime.draft.model.lm_head, linear_type)
    result = generate(runtime, PROMPT)
    assert result.token_ids == expected
    draft_stage = result.stats.stages[0]
    assert draft_stage.rounds > 0
    if self_draft and setting == "int8":  # the target's own weights, rounded, agree with it far more often
        assert draft_stage.acceptance_rate > 0.5  # than chance (16 levels flip the tiny model's near-uniform logits)


@needs_quantised_kernels
def test_an_int8_draft_catches_up_in_passes_its_kernels_take(tiny_dir, tiny_draft_dir, monkeypatch):
    """A draft the cost model bypassed resumes on every token it skipped: with int8 weights those go
    in passes of at most the compiled kernels' width (a wider pass would unpack every weight), the
    last of them with the token whose logits are asked for."""
    for name in ("cpu_layers", "quantised_kernels", "attention_kernel"):  # the runtime sets them: restore them after
        monkeypatch.setattr(fused, name, getattr(fused, name))
    runtime = runtime_for("speculative", tiny_dir, tiny_draft_dir, ["draft.quantise=int8"], dtype="bfloat16")
    draft = runtime.pipeline_for(len(PROMPT) + 40, 8).stages[0]
    assert draft.model.fused_tokens == MAX_GRAPH_TOKENS and isinstance(draft.model.lm_head, Int8Linear)
    draft.prefill(torch.tensor(PROMPT), runtime.config.prefill_chunk)
    widths, forward = [], draft.model.forward
    draft.model.forward = lambda ids, *args, **kwargs: widths.append(ids.shape[1]) or forward(ids, *args, **kwargs)
    context = PROMPT + list(range(3, 43))  # 40 tokens it skipped
    assert draft.extend(context, 1).shape[0] == 1
    assert widths == [16, 8, 16] and draft.cache.length == len(context)


def test_a_draft_takes_its_int4_groups_from_the_config(tiny_dir):
    runtime = runtime_for("speculative", tiny_dir, tiny_dir, ["draft.quantise=int4", "draft.int4_group=128"])
    scales = runtime.draft.model.lm_head.scales  # [I' / 32, 2, O]
    assert torch.equal(scales, scales[torch.arange(scales.shape[0]) // 4 * 4])
    assert not torch.equal(scales, Int4Linear(runtime.target.model.lm_head).scales)


def test_the_target_cannot_be_quantised():
    stages = [{"model": "target", "cache": {"kind": "full"}}]
    with pytest.raises(ValidationError, match="target.quantise: 'int8' would change the output"):
        PipelineConfig.model_validate({"stages": stages, "target": {"quantise": "int8"}})
    with pytest.raises(ValidationError, match="quantise"):
        PipelineConfig.model_validate({"stages": stages, "draft": {"quantise": "int2"}})
    with pytest.raises(ValidationError, match="int4_group 128 groups int4 weights, but quantise is 'int8'"):
        PipelineConfig.model_validate({"stages": stages, "draft": {"quantise": "int8", "int4_group": 128}})
    with pytest.raises(ValidationError, match="int4_group\n  Input should be a multiple of 32"):
        PipelineConfig.model_validate({"stages": stages, "draft": {"quantise": "int4", "int4_group": 100}})


def test_the_speculative_preset_quantises_its_draft_where_the_int8_kernel_runs(tiny_dir, tiny_draft_dir, monkeypatch):
    assert not isinstance(runtime_for("speculative", tiny_dir, tiny_draft_dir).draft.model.lm_head, Int8Linear)
    for name in ("cpu_layers", "quantised_kernels", "attention_kernel"):  # the runtime sets them: restore them after
        monkeypatch.setattr(fused, name, getattr(fused, name))
    for available in (True, False):
        monkeypatch.setattr(kernels, "quantised_kernels_available", lambda available=available: available)
        runtime = runtime_for("speculative", tiny_dir, tiny_draft_dir, dtype="bfloat16")
        assert isinstance(runtime.draft.model.lm_head, Int8Linear) == available  # auto: int8 where the int8 kernel runs
        assert not isinstance(runtime.target.model.lm_head, Int8Linear)
