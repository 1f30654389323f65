"""The grid file: defaults, then named sweeps that vary settings, each expanded into runs.

Run settings are config keys in dotted form (``stages.0.gamma``, ``stages.0.cache.chunk_size``) and
these run keys: ``preset``, ``document``, ``context`` (prompt tokens), ``new_tokens``, ``temperature``,
``policy`` and ``budget_share``: the cache kind of the preset's sparse target stage (stage 0 of
``self-spec``, stage 1 of ``triforce``) and its budget as a share of the prompt. Every distinct
(document, context, temperature, new_tokens) also gets an ``autoregressive`` run: the baseline of
its speed-ups.
"""

from __future__ import annotations

import hashlib
import itertools
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from cascade.errors import CascadeError

RUN_KEYS = ("preset", "document", "context", "new_tokens", "temperature", "policy", "budget_share")
BASELINE_KEYS = ("document", "context", "temperature", "new_tokens")
REQUIRED = ("preset", "document", "context", "new_tokens", "temperature")


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class PlotSpec(Strict):
    kind: Literal["line", "time_split"] = "line"
    """line: ``y`` against ``x``, one line per value of ``series``; time_split: stacked time per stage."""
    x: str | None = None
    y: Literal["acceptance", "speedup", "tokens_per_s"] = "speedup"
    series: str | None = None


class Sweep(Strict):
    set: dict[str, Any] = Field(default_factory=dict)
    """Settings of every run of this sweep (over the grid's defaults)."""
    vary: dict[str, list[Any]] = Field(min_length=1)
    """Each key's values; the sweep runs every combination."""
    plot: PlotSpec | None = None


class Grid(Strict):
    defaults: dict[str, Any] = Field(default_factory=dict)
    sweeps: dict[str, Sweep] = Field(min_length=1)


@dataclass(frozen=True)
class Run:
    settings: tuple[tuple[str, Any], ...]
    """Sorted (key, value) pairs."""

    @property
    def id(self) -> str:
        return hashlib.sha1(json.dumps(self.settings, default=str).encode()).hexdigest()[:12]

    def get(self, key: str, default: Any = None) -> Any:
        return dict(self.settings).get(key, default)

    def baseline(self) -> Run:
        return make_run({**{key: self.get(key) for key in BASELINE_KEYS}, "preset": "autoregressive"})


def make_run(settings: dict[str, Any]) -> Run:
    missing = [key for key in REQUIRED if key not in settings]
    if missing:
        raise CascadeError(f"a run needs {', '.join(missing)} (set them in defaults or the sweep)")
    return Run(tuple(sorted(settings.items())))


def load_grid(path: Path) -> Grid:
    try:
        return Grid.model_validate(yaml.safe_load(path.read_text()))
    except (OSError, yaml.YAMLError) as exc:
        raise CascadeError(f"cannot read the grid {path}: {exc}") from None
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, error['loc']))}: {error['msg']}" for error in exc.errors())
        raise CascadeError(f"invalid grid {path}: {problems}") from None


def sweep_runs(grid: Grid, sweep: Sweep) -> list[Run]:
    keys = list(sweep.vary)
    return [
        make_run({**grid.defaults, **sweep.set, **dict(zip(keys, values))})
        for values in itertools.product(*(sweep.vary[key] for key in keys))
    ]


def expand(grid: Grid) -> list[Run]:
    """Every run of the grid once: the baselines first, then the sweeps' runs in order."""
    runs = [run for sweep in grid.sweeps.values() for run in sweep_runs(grid, sweep)]
    baselines = [run.baseline() for run in runs]
    return list(dict.fromkeys(baselines + runs))
