"""Our forward pass against transformers' implementation of the same checkpoint, and cache equivalences.

Tolerance: float32 logits agree within 2e-4 absolute on tiny models (logit scale ~1) and within
2e-3 on SmolLM2 (logit scale ~30); the differences are float32 summation order only.
"""

from __future__ import annotations

import json
import re

import pytest
import torch
from transformers import AutoModelForCausalLM

from cache.full import FullCache
from cascade import model as model_module
from cascade.checkpoint import load_model, stretch_factor
from cascade.errors import CascadeError
from tests.conftest import FAMILIES, make_checkpoint

CPU = torch.device("cpu")


def our_logits(model, token_ids: torch.Tensor, chunk: int | None = None) -> torch.Tensor:
    """Logits [T, V] for token_ids [T], prefilled ``chunk`` tokens per forward pass."""
    cache = FullCache(model.cache_layout(token_ids.numel()))
    chunk = chunk or token_ids.numel()
    parts = [model(token_ids[None, start : start + chunk], cache)[0] for start in range(0, token_ids.numel(), chunk)]
    return torch.cat(parts)


def reference_logits(path, token_ids: torch.Tensor) -> torch.Tensor:
    reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        return reference(token_ids[None]).logits[0]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family_checkpoint(request, tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp(request.param) / "ckpt", request.param)


def test_logits_match_transformers(family_checkpoint):
    ours = load_model(family_checkpoint, torch.float32, CPU)
    token_ids = torch.randint(0, ours.spec.vocab_size, (200,), generator=torch.Generator().manual_seed(1))
    expected = reference_logits(family_checkpoint, token_ids)
    torch.testing.assert_close(our_logits(ours, token_ids), expected, atol=2e-4, rtol=0)


def test_family_features_are_read_from_the_checkpoint(tmp_path):
    qwen = load_model(make_checkpoint(tmp_path / "q", "qwen2-bias"), torch.float32, CPU)
    llama = load_model(make_checkpoint(tmp_path / "l", "llama-gqa-tied"), torch.float32, CPU)
    assert qwen.spec.qkv_bias and not qwen.spec.tied_embeddings
    assert not llama.spec.qkv_bias and llama.spec.tied_embeddings
    assert llama.lm_head.weight is llama.embed_tokens.weight
    assert (llama.spec.num_heads, llama.spec.num_kv_heads) == (4, 2)


def test_qwen2_features_are_read_from_the_checkpoint(tmp_path):
    """Qwen2.5's layout: q/k/v biases (none on o_proj), 2 KV heads, tied embeddings, rope theta 1e6."""
    model = load_model(make_checkpoint(tmp_path / "q", "qwen2-tied"), torch.float32, CPU)
    spec, attention = model.spec, model.layers[0].self_attn
    assert spec.qkv_bias and attention.qkv_proj.bias.shape == (spec.qkv_size,) and attention.o_proj.bias is None
    assert spec.tied_embeddings and model.lm_head.weight is model.embed_tokens.weight
    assert spec.num_kv_heads == 2
    torch.testing.assert_close(model.rotary.inv_freq[1], torch.tensor(1e6 ** (-2 / spec.head_dim)))


def test_yarn_stretches_the_context_limit(tmp_path):
    yarn = load_model(make_checkpoint(tmp_path / "y", "llama-yarn"), torch.float32, CPU)
    scaled = load_model(
        make_checkpoint(tmp_path / "g", "llama-gqa-tied"), torch.float32, CPU, {"kind": "yarn", "factor": 2.0}
    )
    assert yarn.rotary.scale > 1.0  # YaRN's attention temperature is applied to cos/sin
    assert scaled.spec.max_context == 1024


@pytest.mark.parametrize("chunk", [1, 7, 64, 100])
def test_chunked_prefill_and_decode_equal_one_pass(family_checkpoint, chunk):
    """Token-by-token decode and chunked prefill (every attention path) equal a single causal pass."""
    model = load_model(family_checkpoint, torch.float32, CPU)
    token_ids = torch.randint(0, model.spec.vocab_size, (300,), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(our_logits(model, token_ids, chunk), our_logits(model, token_ids), atol=2e-5, rtol=0)


@pytest.mark.slow
def test_smollm2_logits_match_transformers(smollm2_dir):
    model = load_model(smollm2_dir, torch.float32, CPU)
    token_ids = torch.randint(0, model.spec.vocab_size, (600,), generator=torch.Generator().manual_seed(3))
    expected = reference_logits(smollm2_dir, token_ids)
    torch.testing.assert_close(our_logits(model, token_ids, chunk=256), expected, atol=2e-3, rtol=0)


@pytest.mark.parametrize("scale", [1.0, 1.2])
def test_rotary_shift_moves_keys_to_new_positions(scale):
    from cascade.rope import Rotary, apply_rotary

    rotary = Rotary(1.0 / (10000 ** (torch.arange(0, 16, 2) / 16)), scale, CPU)
    keys = torch.randn(1, 2, 5, 16, dtype=torch.float64).float()
    positions = torch.arange(100, 105)
    at_old = apply_rotary(keys, *rotary.cos_sin(positions, torch.float32))
    at_new = apply_rotary(keys, *rotary.cos_sin(positions - 37, torch.float32))
    torch.testing.assert_close(rotary.shift(at_old, -37), at_new, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("family", ["llama-gqa-tied", "qwen2-bias"])
def test_a_pass_reads_every_weight_once_but_one_row_of_an_untied_embedding(tmp_path, family):
    model = load_model(make_checkpoint(tmp_path / "m", family), torch.bfloat16, torch.device("cpu"))
    embedding = model.embed_tokens.weight  # [V, C]
    everything = sum(parameter.nbytes for parameter in model.parameters())  # a tied head counted once
    tied = model.lm_head.weight is embedding
    row = embedding.shape[1] * embedding.element_size()
    assert model.pass_weight_bytes() == (everything if tied else everything - embedding.nbytes + row)


def test_stretch_factor_is_the_smallest_power_of_two_that_fits():
    assert stretch_factor(8192, 8192) is None
    assert stretch_factor(8193, 8192) == 2.0
    assert stretch_factor(32_064, 8192) == 4.0
    assert stretch_factor(64_064, 8192) == 8.0


@pytest.mark.parametrize(
    "damage,message",
    [
        ("vocab_size", "weights do not match its config.json (size mismatch for embed_tokens.weight"),
        ("num_hidden_layers", "weights do not match its config.json (no tensor model.layers.2."),
        ("truncated", "cannot read weights"),
    ],
)
def test_weights_that_do_not_match_the_config_are_refused_by_name(damage, message, tmp_path):
    path = make_checkpoint(tmp_path / "llama", "llama-gqa-tied")
    config = json.loads((path / "config.json").read_text())
    if damage == "truncated":
        weights = path / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:5000])
    else:
        config[damage] += 1
        (path / "config.json").write_text(json.dumps(config))
    with pytest.raises(CascadeError, match=re.escape(message)):
        load_model(path, torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("emulated", [True, False])
def test_a_wide_bf16_projection_rounds_its_float32_product_once(monkeypatch, emulated):
    """Where the CPU emulates bf16 products (no AVX512-BF16), a prefill chunk's projection multiplies
    in float32 and rounds to bf16 once, as a bf16 product does: within half a bf16 step of the exact
    product; a short pass (kernel-sized) keeps nn.Linear's own product."""
    monkeypatch.setattr(model_module.compiled_kernels, "cpu_has_avx512_bf16", lambda: not emulated)
    generator = torch.Generator().manual_seed(7)
    linear = model_module.Linear(96, 40, bias=True).bfloat16()
    with torch.no_grad():
        for parameter in linear.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator))
        wide = torch.randn(2, model_module.WIDE_PASS_ROWS + 3, 96, generator=generator).bfloat16()
        got = linear(wide)
        short = wide[:, :2]
        assert torch.equal(linear(short), torch.nn.functional.linear(short, linear.weight, linear.bias))
    exact = wide.double() @ linear.weight.double().T + linear.bias.double()
    assert got.dtype == torch.bfloat16 and got.shape == (2, model_module.WIDE_PASS_ROWS + 3, 40)
    half_step = exact.abs() * 2.0**-8 + 1e-3  # float32 summation error is far below a bf16 step
    assert ((got.double() - exact).abs() <= half_step).all()
