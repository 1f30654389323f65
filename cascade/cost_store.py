"""Pass costs kept on disk, so that a later process on the same machine starts from them.

``cascade.pass_costs`` carries a stage's pass costs from a runtime's request to its next; a one-off
run (``python -m cascade.generate``, one case of a benchmark) has no previous request, and its cost
model prices its passes from nothing, warming up at a ladder of gammas. Here each request's costs are
written to a file named by what they depend on (``costs_identity``: the machine, torch, cascade's
kernels, the models and how they run, and the stages), one entry per prompt length, and a runtime's
first request on a prompt within ``cascade.pass_costs.CARRY_WITHIN`` of a kept length starts from that
entry's costs. The acceptance, which depends on the prompt, is never kept. A file that cannot be read
or written costs a warning (once per file and process), never a generation.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import time
from pathlib import Path

import torch
from pydantic import BaseModel, ValidationError

from cascade import atomic, kernels
from cascade.pass_costs import carries
from cascade.stats import StageStats
from cascade.tuning import machine_key
from configs.schema import PipelineConfig, StageConfig

logger = logging.getLogger(__name__)

KEPT_LENGTHS = 16
"""Prompt lengths a file keeps entries for (the latest written)."""
COST_SETTINGS = {"target", "draft", "dtype", "device", "kernels", "attention", "cuda_graphs", "prefill_chunk"}
"""The config's settings, besides its stages, that change what a pass costs."""


def costs_identity(config: PipelineConfig, stages: tuple[StageConfig, ...]) -> dict:
    """What the pass costs of ``stages`` under ``config`` depend on, as JSON values."""
    return {
        "machine": {**machine_key(), "threads": torch.get_num_threads(), "kernels": kernels.source_digest()},
        "settings": config.model_dump(mode="json", include=COST_SETTINGS),
        "stages": [stage.model_dump(mode="json") for stage in stages],
    }


def costs_path(directory: Path, identity: dict) -> Path:
    digest = hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()[:16]
    return directory / f"{digest}.json"


class StageCosts(BaseModel):
    """What a stage's stats hold of its pass costs (``StageStats``' fields of the same names)."""

    name: str
    plain_samples: list[float]
    proposal_samples: list[float]
    verification_samples: dict[int, list[float]]


class CostEntry(BaseModel):
    prompt_tokens: int
    kept_at: float
    """When it was written (seconds since the epoch)."""
    stages: list[StageCosts]


class CostFile(BaseModel):
    identity: dict
    entries: list[CostEntry]
    """The latest last."""


def kept_stats(directory: Path, identity: dict, names: list[str], prompt_tokens: int) -> list[StageStats] | None:
    """Stats named ``names`` holding the pass costs kept for ``identity`` at the kept prompt length
    nearest ``prompt_tokens`` that carries to it, else None."""
    entries = read_entries(costs_path(directory, identity), identity)
    near = [entry for entry in entries if carries(entry.prompt_tokens, prompt_tokens)]
    if not near:
        return None
    entry = min(near, key=lambda entry: abs(entry.prompt_tokens - prompt_tokens))
    if [stage.name for stage in entry.stages] != names:
        return None
    return [StageStats(**stage.model_dump()) for stage in entry.stages]


def keep_stats(directory: Path, identity: dict, prompt_tokens: int, stats: list[StageStats]) -> None:
    """Keep ``stats``' pass costs as ``identity``'s on a prompt of ``prompt_tokens``, in place of any
    entry whose length carries to it (the oldest dropped past ``KEPT_LENGTHS``)."""
    path = costs_path(directory, identity)
    entries = [entry for entry in read_entries(path, identity) if not carries(entry.prompt_tokens, prompt_tokens)]
    stages = [StageCosts.model_validate(one, from_attributes=True) for one in stats]
    entry = CostEntry(prompt_tokens=prompt_tokens, kept_at=time.time(), stages=stages)
    kept = CostFile(identity=identity, entries=[*entries[1 - KEPT_LENGTHS :], entry])
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic.write_text(path, kept.model_dump_json(indent=1) + "\n")
    except OSError as error:
        warn_once(f"cascade: could not keep pass costs in {path} ({error}); later runs time them afresh")


def read_entries(path: Path, identity: dict) -> list[CostEntry]:
    """The entries kept in ``path`` for ``identity`` ([] when there is none, or it is unreadable)."""
    try:
        kept = CostFile.model_validate_json(path.read_bytes())
    except FileNotFoundError:
        return []
    except (OSError, ValidationError) as error:
        warn_once(f"cascade: kept pass costs {path} are unreadable ({error}); timing passes afresh")
        return []
    return kept.entries if kept.identity == identity else []


@functools.cache
def warn_once(message: str) -> None:
    logger.warning(message)
