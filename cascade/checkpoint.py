"""Load a local Hugging Face checkpoint directory of the Llama family into ``CausalLM``.

transformers reads the config and the tokenizer; safetensors reads the weights. Biases and tied
embeddings are detected from the weights themselves, so no branch names a ``model_type``.
"""

from __future__ import annotations

import argparse
import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoTokenizer, PreTrainedConfig, PreTrainedTokenizerBase

from cascade.errors import CascadeError
from cascade.model import CausalLM, ModelSpec, PassOptions
from cascade.models import checkpoint_path
from cascade.rope import Rotary, rope_frequencies

LLAMA_FAMILY = ("llama", "mistral", "qwen2")


@dataclass
class LoadedModel:
    path: Path
    model: CausalLM
    tokenizer: PreTrainedTokenizerBase
    eos_token_ids: tuple[int, ...]


def read_config(path: Path, rope_scaling: dict | None = None) -> PreTrainedConfig:
    """The checkpoint's transformers config, checked to be Llama family, rope scaling applied."""
    if not path.is_dir():
        raise CascadeError(f"model directory {path} does not exist")
    if not (path / "config.json").is_file():
        raise CascadeError(f"{path} is not a Hugging Face checkpoint: it has no config.json")
    try:
        config = AutoConfig.from_pretrained(path)
    except (ValueError, OSError, json.JSONDecodeError) as exc:
        raise CascadeError(f"cannot read {path / 'config.json'}: {exc}") from None
    if config.model_type not in LLAMA_FAMILY:
        raise CascadeError(
            f"{path} holds a {config.model_type!r} model; cascade runs the Llama family: " + ", ".join(LLAMA_FAMILY)
        )
    if rope_scaling is not None:
        apply_rope_scaling(config, **rope_scaling)
    return config


def checkpoint_option(value: str) -> Path:
    """The scripts' ``--target`` / ``--draft``: a provisioned catalog model's name or a Llama-family
    checkpoint directory, checked while arguments are parsed (argparse prints the reason and exits 2)."""
    try:
        path = checkpoint_path(value)
        read_config(path)
    except CascadeError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return path


def stretch_factor(tokens: int, native_context: int) -> float | None:
    """The power-of-two rope-scaling factor that fits ``tokens`` positions (None if they fit as is)."""
    if tokens <= native_context:
        return None
    return float(2 ** math.ceil(math.log2(tokens / native_context)))


def yarn_scaling(path: Path, tokens: int) -> dict | None:
    """YaRN settings that fit ``tokens`` positions in the checkpoint at ``path`` (a power-of-two
    stretch of its native context), or None when they fit as is."""
    factor = stretch_factor(tokens, AutoConfig.from_pretrained(path).max_position_embeddings)
    return None if factor is None else {"kind": "yarn", "factor": factor}


def apply_rope_scaling(config: PreTrainedConfig, kind: str, factor: float) -> None:
    """Stretch the model's context by ``factor`` with YaRN or linear position interpolation."""
    original = config.max_position_embeddings
    config.rope_parameters = {
        "rope_type": kind,
        "rope_theta": config.rope_parameters["rope_theta"],
        "factor": factor,
        "original_max_position_embeddings": original,
    }
    config.max_position_embeddings = int(original * factor)


def load_checkpoint(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    rope_scaling: dict | None = None,
    options: PassOptions = PassOptions(),
) -> LoadedModel:
    """Model, tokenizer and end-of-sequence ids of a checkpoint directory."""
    config = read_config(path, rope_scaling)
    model = build_model(path, config, dtype, device, options)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # the tokenizers library raises bare Exceptions for malformed files
        raise CascadeError(f"{path} has no usable tokenizer: {str(exc).splitlines()[0]}") from None
    return LoadedModel(path, model, tokenizer, eos_token_ids(path, config))


def load_model(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    rope_scaling: dict | None = None,
    options: PassOptions = PassOptions(),
) -> CausalLM:
    """Just the model (no tokenizer needed)."""
    return build_model(path, read_config(path, rope_scaling), dtype, device, options)


def build_model(
    path: Path, config: PreTrainedConfig, dtype: torch.dtype, device: torch.device, options: PassOptions
) -> CausalLM:
    weights = read_weights(path)
    spec = model_spec(config, weights)
    rotary = Rotary(*rope_frequencies(config), device=device)
    with torch.device("meta"):
        model = CausalLM(spec, rotary, options)
    try:
        model.load_state_dict(fuse_projections(weights, spec), assign=True, strict=True)
    except (KeyError, RuntimeError) as exc:  # a tensor missing, or shaped unlike the config says
        raise CascadeError(f"{path}: its weights do not match its config.json ({first_problem(exc)})") from None
    if spec.tied_embeddings:
        model.lm_head.weight = model.embed_tokens.weight  # tie before .to() so it stays tied
    return model.to(device=device, dtype=dtype).eval()


def read_weights(path: Path) -> dict[str, torch.Tensor]:
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise CascadeError(f"{path} has no *.safetensors weights (other formats are not read)")
    weights: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            with safe_open(file, framework="pt") as handle:
                weights.update({name: handle.get_tensor(name) for name in handle.keys()})
        except (SafetensorError, OSError) as exc:
            raise CascadeError(
                f"cannot read weights {file}: {exc} (a partial download or copy? fetch it again)"
            ) from None
    return weights


def first_problem(exc: KeyError | RuntimeError) -> str:
    """The first specific line of a state-dict load's error: a missing tensor or a size mismatch."""
    if isinstance(exc, KeyError):
        return f"no tensor {exc.args[0]}"
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return lines[1] if len(lines) > 1 else lines[0]


def model_spec(config: PreTrainedConfig, weights: dict[str, torch.Tensor]) -> ModelSpec:
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return ModelSpec(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_layers=config.num_hidden_layers,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        rms_norm_eps=config.rms_norm_eps,
        qkv_bias="model.layers.0.self_attn.q_proj.bias" in weights,
        tied_embeddings="lm_head.weight" not in weights,
        max_context=min(config.max_position_embeddings, sliding_window(config) or 1 << 62),
    )


def sliding_window(config: PreTrainedConfig) -> int | None:
    """Sliding-window attention span, if the checkpoint uses one.

    Within the window, sliding-window attention equals full attention, so cascade caps the
    context at the window instead of masking (Mistral v0.1: 4096 tokens).
    """
    if not getattr(config, "use_sliding_window", True):
        return None
    return getattr(config, "sliding_window", None)


def fuse_projections(weights: dict[str, torch.Tensor], spec: ModelSpec) -> dict[str, torch.Tensor]:
    """Rename a transformers state dict to ours: q/k/v -> qkv_proj, gate/up -> gate_up_proj.

    Consumes ``weights`` (each layer's originals are dropped as soon as they are fused) so the
    load never holds two copies of the model.
    """
    fused = weights
    for layer in range(spec.num_layers):
        attn, mlp = f"model.layers.{layer}.self_attn", f"model.layers.{layer}.mlp"
        for kind in ("weight", "bias") if spec.qkv_bias else ("weight",):
            parts = [fused.pop(f"{attn}.{name}_proj.{kind}") for name in "qkv"]
            fused[f"layers.{layer}.self_attn.qkv_proj.{kind}"] = torch.cat(parts)
        parts = [fused.pop(f"{mlp}.{name}_proj.weight") for name in ("gate", "up")]
        fused[f"layers.{layer}.mlp.gate_up_proj.weight"] = torch.cat(parts)
    renamed = {name.removeprefix("model."): tensor for name, tensor in fused.items()}
    if spec.tied_embeddings:
        renamed["lm_head.weight"] = renamed["embed_tokens.weight"]  # re-tied as one parameter
    return renamed


def eos_token_ids(path: Path, config: PreTrainedConfig) -> tuple[int, ...]:
    """End-of-sequence ids as transformers' generate() would use them (generation config first)."""
    eos = config.eos_token_id
    generation_config = path / "generation_config.json"
    if generation_config.is_file():
        eos = json.loads(generation_config.read_text()).get("eos_token_id", eos)
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)
