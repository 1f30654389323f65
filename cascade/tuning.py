"""Thresholds whose best value depends on the machine: a documented default each, replaced by what
``python -m cascade.tune`` measured on this machine (kept in ``$CASCADE_HOME/tuning/``). They
decide which kernel runs a pass, never what it computes."""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from cascade import atomic
from cascade.home import cascade_home

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Tuning:
    compiled_attention_max_keys: int = 6144
    """CPU, for passes cascade's attention kernel does not take (float32, or a head size it lacks):
    one-query passes over at most this many cached keys run Inductor's compiled kernel, longer ones
    the ``cpu`` family's products. Default: the crossover on a 2-core AMD EPYC (SmolLM2, 30 layers:
    18 against 23 ms at 4K keys, 40 against 35 ms at 8K)."""
    step_in_memory_order: bool = False
    """CPU: whether cascade's bf16 weight kernel reads a one-row product's (a decode step's) weight row
    after row in blocks of 16, in memory order, instead of across blocks of 2 rows with the next
    block asked for, as wider passes go across blocks of 4 (the same bits either way). Default: across,
    which streamed 1.04-1.30x faster on a 2-core AMD EPYC Zen 5 (SmolLM2's matrices in huge pages,
    alternated; across blocks of 4 then)."""
    split_keys: int = 1024
    """CUDA: a multi-token static pass's weights-values product (few rows, thousands of keys) runs
    as partial products over blocks of at most this many keys. Default: an H100, where one product
    over 16K keys got a few blocks of threads (0.2-0.5 ms per layer)."""


def machine_key() -> dict:
    """What a measured tuning holds for: the processor, its cores, how many GPUs and torch (read at
    import, so without starting CUDA: the GPU's name is recorded in the file but not part of the key)."""
    from cascade import kernels

    return {
        "cpu": kernels.cpu_model(),
        "cpu_count": os.cpu_count(),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
    }


def tuning_path(machine: dict) -> Path:
    digest = hashlib.sha256(json.dumps(machine, sort_keys=True).encode()).hexdigest()[:16]
    return cascade_home() / "tuning" / f"{digest}.json"


@functools.cache
def machine_tuning() -> Tuning:
    """This machine's measured tuning, else the defaults (read once per process)."""
    path = tuning_path(machine_key())
    if not path.exists():
        return Tuning()
    try:
        return Tuning(**json.loads(path.read_text())["tuning"])
    except (ValueError, KeyError, TypeError) as error:
        logger.warning(
            f"{path} is unreadable ({error}); using the default tuning (python -m cascade.tune measures it again)"
        )
        return Tuning()


def save_tuning(tuning: Tuning, measurements: dict) -> Path:
    """Keep ``tuning`` (and the timings it came from) as this machine's."""
    machine = machine_key()
    path = tuning_path(machine)
    path.parent.mkdir(parents=True, exist_ok=True)
    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    report = {"machine": {**machine, "gpu": gpu}, "tuning": dataclasses.asdict(tuning), "measurements": measurements}
    atomic.write_text(path, json.dumps(report, indent=2) + "\n")
    return path
