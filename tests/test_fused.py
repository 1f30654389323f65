"""The compiled kernels of short passes compute what the eager forward pass computes: one-token
passes (as on CPU) and passes of several tokens (as on CUDA, checked here on CPU too).

Tolerance: float32 logits within 5e-5 absolute on tiny models (logit scale ~1): the kernels
differ from the eager ones only in summation order.
"""

from __future__ import annotations

import pytest
import torch

from cache.base import AttentionView
from cache.full import FullCache
from cache.registry import POLICIES, build_policy
from cascade import fused, kernels
from cascade.attention import FOLD_MAX_QUERIES, attend_cpu
from cascade.checkpoint import load_model
from cascade.graphs import MAX_GRAPH_TOKENS
from cascade.model import PassOptions
from cascade.runtime import build_runtime, has_cxx_compiler
from configs.schema import PipelineConfig
from tests.conftest import FAMILIES, make_checkpoint, runtime_messages

CPU = torch.device("cpu")
needs_compiler = pytest.mark.skipif(not has_cxx_compiler(), reason="Inductor's CPU kernels need a C++ compiler")
PROMPT, GENERATED = 40, 12
ONE_TOKEN = (1,) * GENERATED
SHORT_PASSES = (1, 3, 1, 4, 2, 1)
"""Widths of the passes after the prompt, like proposals and verifications (GENERATED tokens)."""

SMALL_POLICIES = {  # every registered policy, small enough to evict from a 40-token prompt
    "full": {},
    "streaming": {"sinks": 4, "window": 16},
    "retrieval": {"budget": 16, "chunk_size": 4},
    "h2o": {"budget": 16, "recent": 4},
    "topk_oracle": {"budget": 16},
}


def tokens(model, count: int, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.spec.vocab_size, (1, count), generator=generator).to(model.device)


def decode(model, kind: str, fused_tokens: int, widths: tuple[int, ...] = ONE_TOKEN) -> torch.Tensor:
    """Logits [GENERATED, V] of passes of ``widths`` tokens after a 40-token prompt, under policy
    ``kind``, with passes of up to ``fused_tokens`` fused."""
    layout = model.cache_layout(PROMPT + GENERATED)
    entry = POLICIES[kind]
    source = None
    if entry.policy.reads_source:
        source = FullCache(layout)
        model(tokens(model, PROMPT, 0), source)
        source.commit(PROMPT)
    cache = build_policy(entry.config(**SMALL_POLICIES[kind]), layout, source)
    if source is None:
        model(tokens(model, PROMPT, 0), cache)
        cache.commit(PROMPT)
    model.options = PassOptions(fused_tokens)
    generated = tokens(model, GENERATED, 1)
    logits = []
    for width in widths:
        logits.append(model(generated[:, cache.length - PROMPT : cache.length - PROMPT + width], cache)[0])
        cache.commit(cache.length)
    model.options = PassOptions()
    return torch.cat(logits)  # [GENERATED, V]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_model(request, tmp_path_factory):
    return load_model(make_checkpoint(tmp_path_factory.mktemp(request.param) / "m", request.param), torch.float32, CPU)


@needs_compiler
@pytest.mark.parametrize("attention_limit", [fused.MAX_COMPILED_ATTENTION_KEYS, PROMPT + 4])
def test_compiled_decode_equals_eager_for_every_family(family_model, attention_limit, monkeypatch):
    """Both attention kernels: the compiled one, and past the limit the per-KV-head products."""
    monkeypatch.setattr(fused, "MAX_COMPILED_ATTENTION_KEYS", attention_limit)
    torch.testing.assert_close(decode(family_model, "full", 1), decode(family_model, "full", 0), atol=5e-5, rtol=0)


@needs_compiler
def test_fused_short_passes_equal_eager_for_every_family(family_model):
    torch.testing.assert_close(
        decode(family_model, "full", MAX_GRAPH_TOKENS, SHORT_PASSES),
        decode(family_model, "full", 0, SHORT_PASSES),
        atol=5e-5,
        rtol=0,
    )


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return load_model(make_checkpoint(tmp_path_factory.mktemp("t") / "m", "llama-gqa-tied"), torch.float32, CPU)


@needs_compiler
@pytest.mark.parametrize("kind", sorted(POLICIES))
@pytest.mark.parametrize("widths", [ONE_TOKEN, SHORT_PASSES], ids=["one-token", "short-passes"])
def test_compiled_passes_equal_eager_under_every_policy(tiny_model, kind, widths, monkeypatch):
    compiled, fused_widths = fused.pre_attention, []
    monkeypatch.setattr(fused, "pre_attention", lambda x, *args: fused_widths.append(x.shape[0]) or compiled(x, *args))
    torch.testing.assert_close(
        decode(tiny_model, kind, MAX_GRAPH_TOKENS, widths), decode(tiny_model, kind, 0, widths), atol=5e-5, rtol=0
    )
    layers = tiny_model.spec.num_layers  # every layer of every pass of the first run, none of the eager one
    assert fused_widths == [width for width in widths for _ in range(layers)]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (and Triton)")
@pytest.mark.parametrize("kind", sorted(POLICIES))
def test_fused_passes_equal_eager_on_cuda(tmp_path, kind):
    """On CUDA the kernels are Triton's and attention is the model's family (cuda)."""
    checkpoint = make_checkpoint(tmp_path / "m", "llama-gqa-tied")
    model = load_model(checkpoint, torch.float32, torch.device("cuda"))
    torch.testing.assert_close(
        decode(model, kind, MAX_GRAPH_TOKENS, SHORT_PASSES), decode(model, kind, 0, SHORT_PASSES), atol=5e-5, rtol=0
    )


@pytest.fixture(params=["cpu-kernels", "torch-kernels"])
def kernel_choice(request, monkeypatch):
    """bf16 passes' layers and attention through cascade's CPU ops (skipped where they do not run) or
    through the compiled graphs and PyTorch's kernels."""
    ours = request.param == "cpu-kernels"
    if ours and not kernels.weight_kernel_available():
        pytest.skip("cascade's weight kernel does not build here, or the CPU has neither AVX512-BF16 nor AVX2")
    monkeypatch.setattr(fused, "cpu_layers", ours)
    monkeypatch.setattr(fused, "attention_kernel", ours and kernels.attention_kernel_available())
    return request.param


LAYER_OPS = ("pre_attention", "decode_attention", "post_attention", "decoder_layers", "logits")


def layer_op_calls(profile) -> dict[str, int]:
    """Calls of cascade's per-layer CPU ops in a profile."""
    counts = {event.key: event.count for event in profile.key_averages()}
    return {op: counts.get(f"cascade_kernels::{op}", 0) for op in LAYER_OPS}


def layer_op_calls_expected(model, widths) -> dict[str, int]:
    """A pass over the full cache: every layer in one call where cascade's attention kernel runs,
    else every layer on cascade's ops around PyTorch's attention; and the logits."""
    passes, layers = len(widths), len(widths) * model.spec.num_layers
    whole = fused.attention_kernel
    return {
        "pre_attention": 0 if whole else layers,
        "decode_attention": 0,
        "post_attention": 0 if whole else layers,
        "decoder_layers": passes if whole else 0,
        "logits": passes,
    }


@needs_compiler
@pytest.mark.parametrize("widths", [ONE_TOKEN, SHORT_PASSES], ids=["one-token", "short-passes"])
def test_compiled_bfloat16_passes_are_as_close_to_float32_as_eager(tmp_path, kernel_choice, widths):
    """In bf16 both paths round; the compiled one must not stray further from float32 logits."""
    checkpoint = make_checkpoint(tmp_path / "m", "qwen2-bias")
    reference = decode(load_model(checkpoint, torch.float32, CPU), "full", 0, widths)
    model = load_model(checkpoint, torch.bfloat16, CPU)
    compiled_error = (decode(model, "full", MAX_GRAPH_TOKENS, widths).float() - reference).abs().mean()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        decode(model, "full", MAX_GRAPH_TOKENS, widths)  # compiled by the first run: only passes here
    eager_error = (decode(model, "full", 0, widths).float() - reference).abs().mean()
    assert compiled_error <= 1.25 * eager_error, (compiled_error, eager_error)
    expected = layer_op_calls_expected(model, widths)
    assert layer_op_calls(profile) == (expected if fused.cpu_layers else dict.fromkeys(expected, 0))


def runtime_fused_tokens(checkpoint, **settings) -> list[int]:
    config = PipelineConfig.model_validate(
        {
            "stages": [{"model": "draft", "cache": {"kind": "full"}}, {"model": "target", "cache": {"kind": "full"}}],
            "target": {"path": str(checkpoint)},
            "draft": {"path": str(checkpoint)},
            "dtype": "float32",
            **settings,
        }
    )
    runtime = build_runtime(config)
    return [runtime.target.model.fused_tokens, runtime.draft.model.fused_tokens]


def test_runtime_sets_the_kernels_the_config_names(tiny_dir, monkeypatch, caplog):
    monkeypatch.setattr("shutil.which", lambda name: f"/usr/bin/{name}")
    assert runtime_fused_tokens(tiny_dir) == [1, 1]  # float32 on CPU: one-token passes
    assert runtime_fused_tokens(tiny_dir, kernels="eager") == [0, 0]
    assert runtime_messages(caplog) == []
    monkeypatch.setattr("shutil.which", lambda name: None)
    assert runtime_fused_tokens(tiny_dir) == [0, 0]
    assert any("no C++ compiler" in message for message in runtime_messages(caplog))


def test_bfloat16_passes_of_a_few_tokens_run_fused_where_the_weight_kernel_runs(tiny_dir, monkeypatch):
    monkeypatch.setattr(kernels, "weight_kernel_available", lambda: True)
    assert runtime_fused_tokens(tiny_dir, dtype="bfloat16") == [MAX_GRAPH_TOKENS] * 2
    monkeypatch.setattr(kernels, "weight_kernel_available", lambda: False)
    assert runtime_fused_tokens(tiny_dir, dtype="bfloat16") == [1, 1]


def test_a_failed_build_of_the_fused_kernels_falls_back_to_eager_and_says_why(tiny_dir, monkeypatch, caplog):
    def failing_build(*args):
        raise RuntimeError("Python.h: No such file or directory\ncompilation terminated.")

    monkeypatch.setattr(fused, "pre_attention", failing_build)
    assert runtime_fused_tokens(tiny_dir) == [0, 0]
    assert (
        runtime_messages(caplog)
        == [
            "compiling the fused kernels failed (RuntimeError: Python.h: No such file or directory); "
            "short passes run eagerly (kernels: eager)"
        ]
        * 2
    )


def test_a_failed_build_of_the_cpu_kernels_leaves_pytorchs_kernels_and_says_why(monkeypatch, caplog):
    def failing_build(**settings):
        raise RuntimeError("ninja: command not found\nmore")

    monkeypatch.setattr("torch.utils.cpp_extension.load", failing_build)
    with caplog.at_level("WARNING", logger="cascade.kernels"):
        assert kernels.weight_kernel_available.__wrapped__() is False
    assert caplog.messages == [
        "building cascade's CPU kernels failed (RuntimeError: ninja: command not found); "
        "weight products and attention use PyTorch's kernels"
    ]


@pytest.mark.skipif(
    not kernels.attention_kernel_available(), reason="cascade's CPU layer and attention ops do not run here"
)
@pytest.mark.parametrize("family", ["qwen2-bias", "llama-gqa-tied"])
def test_bfloat16_passes_of_any_width_equal_one_token_steps_bit_for_bit(tmp_path, family):
    """Row-independent products and layer ops, and attention that scores every key alike however many
    follow it: a verification pass computes what the steps it replaces would have, so a bf16 greedy
    speculative run emits exactly the bf16 autoregressive tokens."""
    model = load_model(make_checkpoint(tmp_path / "m", family), torch.bfloat16, CPU)
    fused.use_cpu_kernels()
    steps = decode(model, "full", MAX_GRAPH_TOKENS, ONE_TOKEN)
    assert torch.equal(decode(model, "full", MAX_GRAPH_TOKENS, SHORT_PASSES), steps)
    assert torch.equal(decode(model, "full", MAX_GRAPH_TOKENS, (GENERATED,)), steps)


@pytest.mark.skipif(
    not kernels.attention_kernel_available(), reason="cascade's CPU layer and attention ops do not run here"
)
@pytest.mark.parametrize("kind", sorted(POLICIES))
def test_a_pass_of_every_layer_in_one_call_equals_layer_by_layer_bit_for_bit(
    tmp_path, kind, monkeypatch, torch_threads
):
    """Over a plain cache (full, streaming, retrieval once it has selected) ``decoder_layers`` runs
    the layers in C++ (bf16 weights: in one parallel region, the threads splitting each product): it
    must compute what the layer-by-layer ops and the policy's own update do."""
    model = load_model(make_checkpoint(tmp_path / "m", "qwen2-bias"), torch.bfloat16, CPU)
    fused.use_cpu_kernels()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        whole = decode(model, kind, MAX_GRAPH_TOKENS, SHORT_PASSES)
    plain = {"full": len(SHORT_PASSES), "streaming": len(SHORT_PASSES), "retrieval": len(SHORT_PASSES) - 1}
    assert layer_op_calls(profile)["decoder_layers"] == plain.get(kind, 0)
    monkeypatch.setattr(fused, "decoder_layers_apply", lambda *args: False)
    assert torch.equal(decode(model, kind, MAX_GRAPH_TOKENS, SHORT_PASSES), whole)


def one_layer_operands(**changed) -> dict:
    """``decoder_layers``' operands for one layer of hidden size 64, 4 query heads and 2 KV heads of
    16, a 96-wide MLP and one token after 7 cached, with any of them ``changed``."""
    bf16 = dict(dtype=torch.bfloat16)
    operands = dict(
        x=torch.randn(1, 64, **bf16),
        norms=[torch.ones(64, **bf16)] * 2,
        weights=[torch.randn(*shape, **bf16) for shape in ((128, 64), (64, 64), (192, 64), (64, 96))],
        scales=[None] * 4,
        biases=[None],
        keys=[torch.zeros(1, 1, 2, 8, 16, **bf16)],
        values=[torch.zeros(1, 1, 2, 8, 16, **bf16)],
        starts=[7],
        tokens=[1],
        cos=torch.ones(1, 16, **bf16),
        sin=torch.zeros(1, 16, **bf16),
        eps=1e-5,
        heads=4,
        kv_heads=2,
        scale=0.25,
    )
    return {**operands, **changed}


@pytest.mark.skipif(
    not kernels.attention_kernel_available(), reason="cascade's CPU layer and attention ops do not run here"
)
@pytest.mark.parametrize(
    "changed, message",
    [
        ({}, None),
        (
            dict(weights=[torch.randn(*shape).bfloat16() for shape in ((128, 64), (64, 60), (192, 64), (64, 96))]),
            r"a bf16 o weight \[64, 64\]|rows have 64 columns, the weight 60",  # one region | per op (AVX2)
        ),
        (dict(cos=torch.ones(2, 16).bfloat16()), r"cos and sin \[T, D\] = \[1, 16\]"),
        (dict(starts=[8]), r"room for slots \[8, 9\)"),
        (dict(starts=[-1]), r"room for slots \[-1, 0\)"),
        (dict(values=[torch.zeros(1, 1, 2, 8, 16)]), r"sequence 0: contiguous bf16 K/V buffers"),
        (dict(kv_heads=0), r"4 query heads, a multiple of the caches' KV heads \(2\); got kv_heads 0"),
    ],
    ids=["valid", "o-weight", "cos", "slots", "negative-start", "float-values", "kv-heads"],
)
def test_a_pass_whose_operands_do_not_fit_its_layers_is_refused_by_name(changed, message):
    call = torch.ops.cascade_kernels.decoder_layers
    if message is None:
        assert call(**one_layer_operands()).shape == (1, 64)
        return
    with pytest.raises(RuntimeError, match=message):
        call(**one_layer_operands(**changed))


@pytest.mark.skipif(not kernels.weight_kernel_available(), reason="cascade's CPU layer ops do not run here")
def test_a_prefill_chunks_norms_and_silu_products_run_on_the_layer_ops_row_by_row(tmp_path, monkeypatch):
    """A bf16 pass too long for the fused ops (a prefill chunk) takes the layer ops' norms and SiLU
    products, its rows split across threads: each row as the op computes it alone, near float32."""
    generator = torch.Generator().manual_seed(3)
    x = (torch.randn(100, 96, generator=generator) * 3).bfloat16()
    weight = torch.randn(96, generator=generator).bfloat16()
    normed = torch.ops.cascade_kernels.norm_rows(x, weight, 1e-5)
    assert torch.equal(normed, torch.cat([torch.ops.cascade_kernels.norm_rows(row[None], weight, 1e-5) for row in x]))
    reference = torch.nn.functional.rms_norm(x.double(), (96,), weight.double(), 1e-5)
    torch.testing.assert_close(normed.double(), reference, rtol=1e-2, atol=1e-2)
    gate_up = (torch.randn(100, 2 * 80, generator=generator) * 3).bfloat16()
    product = torch.ops.cascade_kernels.gated_rows(gate_up)
    assert torch.equal(product, torch.cat([torch.ops.cascade_kernels.gated_rows(row[None]) for row in gate_up]))
    gate, up = gate_up.double().chunk(2, dim=-1)
    torch.testing.assert_close(product.double(), torch.nn.functional.silu(gate) * up, rtol=1e-2, atol=1e-2)
    with pytest.raises(RuntimeError, match=r"gated_rows: a contiguous bf16 \[T, 2F\] gate and up projection"):
        torch.ops.cascade_kernels.gated_rows(gate_up.float())

    monkeypatch.setattr(fused, "cpu_layers", True)
    checkpoint = make_checkpoint(tmp_path / "m", "llama-gqa-tied")
    model = load_model(checkpoint, torch.bfloat16, CPU)
    ids = tokens(model, PROMPT, 0)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as profile:
        ours = model(ids, FullCache(model.cache_layout(PROMPT)))
    counts = {event.key: event.count for event in profile.key_averages()}
    layers = model.spec.num_layers
    assert (counts["cascade_kernels::norm_rows"], counts["cascade_kernels::gated_rows"]) == (2 * layers + 1, layers)
    reference = load_model(checkpoint, torch.float32, CPU)
    float32 = reference(ids, FullCache(reference.cache_layout(PROMPT)))
    monkeypatch.setattr(fused, "cpu_layers", False)
    torchs = model(ids, FullCache(model.cache_layout(PROMPT)))
    assert (ours.float() - float32).abs().mean() <= 1.25 * (torchs.float() - float32).abs().mean()


@pytest.mark.skipif(not kernels.attention_kernel_available(), reason="cascade's CPU attention op does not run here")
@pytest.mark.parametrize("causal", [True, False])
def test_a_prefill_chunk_through_the_kernel_equals_one_call_over_it_whatever_its_slices(monkeypatch, causal):
    """A chunk of 100 tokens (three slices of 32 and a part) over 700 keys, causal or every token
    reading every key: its rows are the bits one kernel call over the whole chunk gives, and within
    bf16 rounding of PyTorch's flash kernel (the ``cpu`` family's prefill path)."""
    monkeypatch.setattr(fused, "prefill_kernel", True)
    generator = torch.Generator().manual_seed(0)
    query = torch.randn(1, 6, 100, 64, generator=generator).bfloat16()  # [1, H, T, D]
    keys, values = (torch.randn(1, 2, 700, 64, generator=generator).bfloat16() for _ in range(2))  # [1, H_kv, S, D]
    view = AttentionView(keys, values, None, causal=causal)
    sliced = fused.attend_prefill(query, view, 0.125, attend_cpu)
    whole = torch.ops.cascade_kernels.decode_attention(query[0], keys[0], values[0], 0.125, causal)
    assert torch.equal(sliced[0], whole)
    torch.testing.assert_close(sliced.float(), attend_cpu(query, view, 0.125).float(), atol=2e-2, rtol=0)


def test_only_long_unmasked_bfloat16_passes_take_the_prefill_kernel(monkeypatch):
    """Passes of up to FOLD_MAX_QUERIES tokens, masked views, float32 and a build without the
    prefill kernel keep the model's attention family."""
    monkeypatch.setattr(fused, "prefill_kernel", True)
    calls = []
    family = lambda query, view, scale: calls.append(query.shape[2]) or query  # noqa: E731
    keys = torch.zeros(1, 2, 200, 64, dtype=torch.bfloat16)
    short, long = (torch.zeros(1, 6, tokens, 64, dtype=torch.bfloat16) for tokens in (FOLD_MAX_QUERIES, 100))
    fused.attend_prefill(short, AttentionView(keys, keys, None, causal=True), 0.125, family)
    fused.attend_prefill(long, AttentionView(keys, keys, torch.zeros(100, 200, dtype=torch.bfloat16)), 0.125, family)
    fused.attend_prefill(long.float(), AttentionView(keys.float(), keys.float(), None, causal=True), 0.125, family)
    monkeypatch.setattr(fused, "prefill_kernel", False)
    fused.attend_prefill(long, AttentionView(keys, keys, None, causal=True), 0.125, family)
    assert calls == [FOLD_MAX_QUERIES, 100, 100, 100]


@pytest.mark.parametrize(
    "features, takes",
    [({"avx512_bf16"}, True), ({"avx512_bf16", "amx_bf16"}, False), ({"avx2"}, False)],
)
def test_the_prefill_kernel_is_used_on_avx512_bf16_builds_without_amx(monkeypatch, features, takes):
    """Where it was timed against PyTorch's CPU flash kernel; AMX and AVX2 builds keep PyTorch's."""
    monkeypatch.setattr(kernels, "attention_kernel_available", lambda: True)
    monkeypatch.setattr(kernels, "compiled_features", lambda: frozenset(features))
    for flag in ("cpu_layers", "quantised_kernels", "attention_kernel"):
        monkeypatch.setattr(fused, flag, getattr(fused, flag))  # restored after use_cpu_kernels sets them
    monkeypatch.setattr(fused, "prefill_kernel", not takes)
    fused.use_cpu_kernels()
    assert fused.prefill_kernel is takes
