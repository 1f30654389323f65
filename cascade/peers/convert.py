"""A cascade checkpoint as the GGUF files llama.cpp runs, under ``$CASCADE_HOME/peers/gguf/``.

``ensure_gguf`` converts a checkpoint directory (safetensors, config.json, tokenizer files) once,
with the converter its llama.cpp build ships, at bf16 (the precision cascade runs) or q8_0 (for
reference): ``<checkpoint directory name>-<type>.gguf``. Beyond the native context cascade stretches
rope with YaRN (``cascade.checkpoint.yarn_scaling``); llama-bench takes no rope options, so
``ensure_yarn_gguf`` copies a file with that stretch in its metadata
(``<checkpoint>-<type>-yarn<factor>.gguf``), which every llama.cpp tool reads as it would from a
user's own stretched GGUF. Files are written under a hidden name and renamed into place when
complete; an existing file is reused (delete it after changing the checkpoint).
"""

from __future__ import annotations

import logging
import subprocess
import sys
from pathlib import Path

from gguf import GGUFReader, GGUFValueType, GGUFWriter, Keys
from gguf.scripts.gguf_new_metadata import MetadataDetails, copy_with_new_metadata

from cascade.checkpoint import read_config, yarn_scaling
from cascade.errors import CascadeError
from cascade.home import peers_dir
from cascade.packages import staged_file
from cascade.peers.llamacpp import LlamaCpp

logger = logging.getLogger(__name__)

GGUF_TYPES = ("bf16", "q8_0")


def gguf_path(checkpoint: Path, outtype: str) -> Path:
    return peers_dir() / "gguf" / f"{checkpoint.name}-{outtype}.gguf"


def peer_gguf(llama: LlamaCpp, checkpoint: Path, outtype: str, tokens: int) -> Path:
    """The GGUF of ``checkpoint`` at ``outtype`` that fits ``tokens`` positions: YaRN-stretched, as
    cascade stretches it, where they exceed its native context."""
    base = ensure_gguf(llama, checkpoint, outtype)
    scaling = yarn_scaling(checkpoint, tokens)
    return base if scaling is None else ensure_yarn_gguf(base, scaling["factor"])


def ensure_gguf(llama: LlamaCpp, checkpoint: Path, outtype: str) -> Path:
    """``checkpoint`` converted to GGUF at ``outtype`` (one of ``GGUF_TYPES``), unless it was already."""
    if outtype not in GGUF_TYPES:
        raise CascadeError(f"GGUF type {outtype!r}: expected one of {', '.join(GGUF_TYPES)}")
    path = gguf_path(checkpoint, outtype)
    if path.is_file():
        return path
    read_config(checkpoint)  # a Llama-family checkpoint directory, or an error saying what it is not
    logger.info(f"converting {checkpoint} to {path} with llama.cpp's converter")
    with staged_file(path) as partial:
        command = [
            sys.executable,
            str(llama.converter),
            str(checkpoint),
            "--outtype",
            outtype,
            "--outfile",
            str(partial),
        ]
        result = subprocess.run(command, check=False, capture_output=True, text=True)
        if result.returncode != 0:
            raise CascadeError(f"llama.cpp's converter failed on {checkpoint}: {converter_failure(result.stderr)}")
    return path


def converter_failure(stderr: str) -> str:
    """The converter's reason in a line, with the fix when it is a missing Python package."""
    lines = stderr.strip().splitlines() or ["it gave no reason"]
    missing = next((line for line in lines if line.startswith("ModuleNotFoundError")), None)
    if missing:
        return f'{missing}; install the converter\'s packages with `pip install -e ".[peers]"`'
    return lines[-1]


def ensure_yarn_gguf(base: Path, factor: float) -> Path:
    """A copy of the GGUF ``base`` whose metadata stretches its context ``factor`` times with YaRN."""
    path = base.with_name(f"{base.stem}-yarn{factor:g}.gguf")
    if path.is_file():
        return path
    reader = GGUFReader(base)
    arch = field_value(reader, Keys.General.ARCHITECTURE)
    native_context = field_value(reader, Keys.LLM.CONTEXT_LENGTH.format(arch=arch))
    logger.info(f"writing {path.name}: {base.name} with YaRN x{factor:g} of its {native_context} positions")
    with staged_file(path) as partial:
        writer = GGUFWriter(partial, arch=arch, endianess=reader.endianess)
        if (alignment := field_value(reader, Keys.General.ALIGNMENT)) is not None:
            writer.data_alignment = alignment
        copy_with_new_metadata(reader, writer, yarn_metadata(arch, native_context, factor), remove_metadata=[])
    return path


def yarn_metadata(arch: str, native_context: int, factor: float) -> dict[str, MetadataDetails]:
    """The GGUF keys of a YaRN stretch of ``native_context`` positions by ``factor``: those the
    converter writes for a checkpoint whose config carries YaRN rope parameters."""

    def key(template: str) -> str:
        return template.format(arch=arch)

    return {
        key(Keys.Rope.SCALING_TYPE): MetadataDetails(GGUFValueType.STRING, "yarn"),
        key(Keys.Rope.SCALING_FACTOR): MetadataDetails(GGUFValueType.FLOAT32, factor),
        key(Keys.Rope.SCALING_ORIG_CTX_LEN): MetadataDetails(GGUFValueType.UINT32, native_context),
        key(Keys.LLM.CONTEXT_LENGTH): MetadataDetails(GGUFValueType.UINT32, int(native_context * factor)),
    }


def field_value(reader: GGUFReader, key: str):
    field = reader.get_field(key)
    return None if field is None else field.contents()
