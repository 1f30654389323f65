"""Shared fixtures: tiny random-weight checkpoints of each family, and the provisioned SmolLM2."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, MistralConfig, Qwen2Config

from cascade.models import DEFAULTS, fetch

TINY = dict(
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,  # grouped-query attention: 2 query heads per KV head
    max_position_embeddings=512,
)

FAMILIES = {
    "llama-gqa-tied": (LlamaConfig, dict(tie_word_embeddings=True)),
    "llama-untied-mha": (LlamaConfig, dict(tie_word_embeddings=False, num_key_value_heads=4)),
    "llama-yarn": (
        LlamaConfig,
        dict(
            rope_parameters={
                "rope_type": "yarn",
                "factor": 4.0,
                "original_max_position_embeddings": 128,
                "rope_theta": 10000.0,
            }
        ),
    ),
    "llama-linear": (LlamaConfig, dict(rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 10000.0})),
    "qwen2-bias": (Qwen2Config, dict(tie_word_embeddings=False)),
    "qwen2-tied": (
        Qwen2Config,
        dict(
            tie_word_embeddings=True,  # Qwen2.5's published layout: bias, 2 KV heads, theta 1e6
            rope_parameters={"rope_type": "default", "rope_theta": 1e6},
        ),
    ),
    "mistral": (MistralConfig, dict(sliding_window=None)),
}


def pytest_configure(config) -> None:
    """Under pytest-xdist each worker takes its share of the cores: workers that each ran on all of
    them would wait on each other's threads."""
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))


def make_checkpoint(
    path: Path, family: str, vocab_size: int = 320, tokenizer_dir: Path | None = None, seed: int = 0
) -> Path:
    """Save a random-weight transformers model of ``family`` (and optionally a tokenizer) to ``path``."""
    config_class, overrides = FAMILIES[family]
    config = config_class(vocab_size=vocab_size, **{**TINY, **overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():  # init leaves norms at 1 and small weights; perturb all for varied outputs
        for parameter in model.parameters():
            parameter.add_(torch.randn_like(parameter) * 0.15)
    model.save_pretrained(path)
    if tokenizer_dir is not None:
        for file in tokenizer_dir.glob("tokenizer*"):
            shutil.copy(file, path)
        shutil.copy(tokenizer_dir / "chat_template.jinja", path)
    return path


def runtime_messages(caplog) -> list[str]:
    """What ``cascade.runtime`` logged during the test."""
    return [record.getMessage() for record in caplog.records if record.name == "cascade.runtime"]


@pytest.fixture(autouse=True)
def kept_pass_costs(tmp_path_factory, monkeypatch) -> Path:
    """Each test keeps pass costs (``cascade.cost_store``) where no other test reads them: a runtime's
    first request starts from its own test's costs only (the CLIs it starts inherit the variable)."""
    directory = tmp_path_factory.mktemp("pass-costs")
    monkeypatch.setenv("CASCADE_PASS_COSTS", str(directory))
    return directory


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def torch_threads(request) -> int:
    """Runs a test on one and on two of torch's threads (work split among threads must compute what
    one thread does), whatever share of the cores the worker has."""
    threads = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(threads)


@pytest.fixture
def home(tmp_path, monkeypatch) -> Path:
    """An empty $CASCADE_HOME: nothing provisioned."""
    monkeypatch.setenv("CASCADE_HOME", str(tmp_path))
    return tmp_path


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The provisioned default target (fetched on first use; CI provisions it before the tests)."""
    return fetch(DEFAULTS["target"])


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory, smollm2_dir) -> Path:
    """A tiny Llama with SmolLM2's tokenizer, for fast end-to-end and CLI tests."""
    return make_checkpoint(
        tmp_path_factory.mktemp("tiny") / "llama", "llama-gqa-tied", 49152, tokenizer_dir=smollm2_dir
    )


@pytest.fixture(scope="session")
def tiny_draft_dir(tmp_path_factory, smollm2_dir) -> Path:
    """Another tiny Llama (other weights, same tokenizer): a draft that rarely agrees with tiny_dir."""
    return make_checkpoint(
        tmp_path_factory.mktemp("tiny-draft") / "llama",
        "llama-gqa-tied",
        49152,
        tokenizer_dir=smollm2_dir,
        seed=1,
    )
