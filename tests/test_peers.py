"""The llama.cpp peer's provisioning, without building it: the vendored commit, the toolchain check,
finding a finished build, GGUF conversion's cache and errors, and the YaRN copy's metadata."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from gguf import GGUFReader, GGUFWriter

from cascade.errors import CascadeError
from cascade.packages import staged_file
from cascade.peers import convert, llamacpp
from cascade.peers.convert import ensure_gguf, ensure_yarn_gguf, gguf_path, peer_gguf
from cascade.peers.llamacpp import LlamaCpp, ensure_built, installed_build

CHANGELOG = """# Changelog

## [Unreleased]

## [0.3.36]

- feat: update llama.cpp to ggml-org/llama.cpp@0c1e57098

## [0.3.35]

- fix: a bug

## [0.3.34]

- feat: update llama.cpp to ggml-org/llama.cpp@4df29be4f
"""


@pytest.mark.parametrize(
    "version, commit", [("0.3.36", "0c1e57098"), ("0.3.35", "unknown"), ("0.3.34", "4df29be4f"), ("0.1.0", "unknown")]
)
def test_vendored_commit_is_read_from_the_release_entry_of_the_changelog(tmp_path, version, commit):
    changelog = tmp_path / "CHANGELOG.md"
    changelog.write_text(CHANGELOG)
    assert llamacpp.vendored_commit(changelog, version) == commit


def test_vendored_commit_of_a_missing_changelog_is_unknown(tmp_path):
    assert llamacpp.vendored_commit(tmp_path / "absent.md", "0.3.36") == "unknown"


def test_missing_toolchain_names_each_tool_and_how_to_get_it(monkeypatch):
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name: None)
    monkeypatch.delenv("CMAKE_GENERATOR", raising=False)
    missing = llamacpp.missing_toolchain()
    assert [item.split(" ")[0] for item in missing] == ["cmake", "a", "make"]
    assert "pip install cmake" in missing[0] and "g++" in missing[1]


def test_ensure_built_without_cmake_fails_before_downloading(home, monkeypatch):
    monkeypatch.setattr(llamacpp.shutil, "which", lambda name: None if name == "cmake" else f"/usr/bin/{name}")
    monkeypatch.setattr(llamacpp, "pip_download", lambda *args, **kwargs: pytest.fail("downloaded"))
    with pytest.raises(CascadeError, match="building llama.cpp needs cmake"):
        ensure_built()


def test_a_finished_build_is_found_and_not_built_again(home, monkeypatch):
    root = home / "peers" / "llama.cpp-0.3.36"
    root.mkdir(parents=True)
    version = "version: 0.5.0-dev (build 0, commit 0c1e57098); built with GNU 12.2.0 for Linux x86_64"
    (root / "build.json").write_text(
        json.dumps({"llama_cpp_python": "0.3.36", "commit": "0c1e57098", "version": version})
    )
    monkeypatch.setattr(llamacpp, "missing_toolchain", lambda: pytest.fail("checked the toolchain"))
    build = ensure_built("0.3.36")
    assert build == installed_build("0.3.36") == LlamaCpp(root, "0.3.36", "0c1e57098", version)
    assert build.tool("llama-bench") == root / "bin" / "llama-bench"
    assert build.converter == root / "convert" / "convert_hf_to_gguf.py"
    assert installed_build("0.3.35") is None  # a partial or other build is not taken for it


@pytest.mark.parametrize("flags, amx_off", [({"avx512f", "amx_int8"}, True), ({"avx512f"}, False), (set(), False)])
def test_cmake_options_name_the_commit_and_leave_out_amx_int8_kernels_only_where_the_cpu_has_them(flags, amx_off):
    options = llamacpp.cmake_options("0c1e57098", flags)
    assert options[: len(llamacpp.CMAKE_OPTIONS)] == list(llamacpp.CMAKE_OPTIONS)
    assert "-DLLAMA_BUILD_COMMIT=0c1e57098" in options and "-DLLAMA_BUILD_NUMBER=0" in options
    assert "-DGGML_NATIVE=ON" in options and "-DBUILD_SHARED_LIBS=OFF" in options
    assert all(option in options for option in llamacpp.WITHOUT_AMX_INT8) == amx_off
    assert any("amx" in option for option in options) == amx_off


def test_staged_file_appears_only_when_complete(tmp_path):
    final = tmp_path / "model.gguf"
    with pytest.raises(RuntimeError), staged_file(final) as partial:
        partial.write_text("half")
        raise RuntimeError("killed")
    assert list(tmp_path.iterdir()) == []
    with staged_file(final) as partial:
        partial.write_text("whole")
    assert final.read_text() == "whole" and list(tmp_path.iterdir()) == [final]


# ---- GGUF files --------------------------------------------------------------------------------


def write_tiny_gguf(path: Path, context: int = 512) -> Path:
    """A GGUF with a Llama context length and two tensors, as the converter would start one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, arch="llama")
    writer.add_context_length(context)
    writer.add_block_count(2)
    writer.add_tensor("token_embd.weight", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.add_tensor("output_norm.weight", np.ones(4, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_yarn_copy_stretches_the_context_in_its_metadata_and_keeps_the_tensors(tmp_path):
    base = write_tiny_gguf(tmp_path / "tiny-bf16.gguf")
    stretched = ensure_yarn_gguf(base, 4.0)
    assert stretched == tmp_path / "tiny-bf16-yarn4.gguf"
    reader = GGUFReader(stretched)
    assert convert.field_value(reader, "llama.rope.scaling.type") == "yarn"
    assert convert.field_value(reader, "llama.rope.scaling.factor") == 4.0
    assert convert.field_value(reader, "llama.rope.scaling.original_context_length") == 512
    assert convert.field_value(reader, "llama.context_length") == 2048
    assert convert.field_value(reader, "llama.block_count") == 2
    original = {tensor.name: tensor.data.tolist() for tensor in GGUFReader(base).tensors}
    assert {tensor.name: tensor.data.tolist() for tensor in reader.tensors} == original
    stretched.write_bytes(b"kept")  # an existing copy is reused, not written again
    assert ensure_yarn_gguf(base, 4.0).read_bytes() == b"kept"


def fake_build(tmp_path: Path) -> LlamaCpp:
    return LlamaCpp(tmp_path / "no-build", "0.3.36", "0c1e57098", "version: 0.5.0-dev (build 0, commit 0c1e57098)")


@pytest.mark.parametrize(
    "tokens, expected", [(512, "llama-bf16.gguf"), (600, "llama-bf16-yarn2.gguf"), (1500, "llama-bf16-yarn4.gguf")]
)
def test_peer_gguf_stretches_with_yarn_beyond_the_native_context_as_cascade_does(
    home, tmp_path, tiny_dir, tokens, expected
):
    write_tiny_gguf(gguf_path(tiny_dir, "bf16"), context=512)  # tiny_dir's native context: 512
    assert peer_gguf(fake_build(tmp_path), tiny_dir, "bf16", tokens).name == expected


def test_ensure_gguf_reuses_a_converted_file_without_running_the_converter(home, tmp_path, tiny_dir):
    converted = gguf_path(tiny_dir, "q8_0")
    converted.parent.mkdir(parents=True)
    converted.write_bytes(b"converted")
    assert ensure_gguf(fake_build(tmp_path), tiny_dir, "q8_0") == converted == home / "peers/gguf/llama-q8_0.gguf"


def test_ensure_gguf_refuses_an_unknown_type_and_a_directory_that_is_no_checkpoint(home, tmp_path):
    with pytest.raises(CascadeError, match="GGUF type 'q4_0': expected one of bf16, q8_0"):
        ensure_gguf(fake_build(tmp_path), tmp_path, "q4_0")
    with pytest.raises(CascadeError, match="has no config.json"):
        ensure_gguf(fake_build(tmp_path), tmp_path, "bf16")


def test_a_failed_conversion_says_why_and_leaves_no_file(home, tmp_path, tiny_dir, monkeypatch):
    def converter(command, **kwargs):
        Path(command[-1]).write_text("partial")
        return convert.subprocess.CompletedProcess(
            command, 1, "", "Traceback ...\nModuleNotFoundError: No module named 'sentencepiece'\n"
        )

    monkeypatch.setattr(convert.subprocess, "run", converter)
    fix = r"No module named 'sentencepiece'; install .*`pip install -e \"\.\[peers\]\"`"
    with pytest.raises(CascadeError, match=fix):
        ensure_gguf(fake_build(tmp_path), tiny_dir, "bf16")
    assert list((home / "peers" / "gguf").iterdir()) == []
