"""One ablation run: its config, a warm-up, ``repeats`` measured generations, and its CSV row."""

from __future__ import annotations

import json
import statistics
import time
from functools import cache
from pathlib import Path
from typing import Any

from cache import POLICIES
from cache.config import budget_for
from cascade.ablation.grid import RUN_KEYS, Run
from cascade.checkpoint import yarn_scaling
from cascade.data import document_ids
from cascade.llm import LLM
from configs import load_config

BUDGET_GRANULE = 64
"""Budgets from ``budget_share`` are rounded to this: a multiple of every chunk size swept."""
WARMUP_TOKENS = 2
"""New tokens of the warm-up generation (on the run's own prompt: a shorter one could fall within a
sparse stage's budget) each run makes before it measures."""


@cache
def prompt_tokens(target: Path, document: str, context: int) -> tuple[int, ...]:
    """A run's prompt, tokenized once per sweep."""
    return tuple(document_ids(target, document, context))


def sparse_stage(preset: str) -> int:
    """Index of the stage ``policy`` / ``budget_share`` set: the first target stage below the last
    (stage 0 of ``self-spec``, stage 1 of ``triforce``)."""
    _, config = load_config(preset)
    return next(index for index, stage in enumerate(config.stages[:-1]) if stage.model == "target")


def config_settings(run: Run, target: Path, dtype: str) -> dict[str, Any]:
    """Dotted config settings of ``run``: its sparse stage's cache first, then its own dotted keys."""
    context, new_tokens = run.get("context"), run.get("new_tokens")
    settings: dict[str, Any] = {}
    if run.get("policy") or run.get("budget_share"):
        index = sparse_stage(run.get("preset"))
        _, preset = load_config(run.get("preset"))
        kind = run.get("policy") or preset.stages[index].cache.kind
        share = run.get("budget_share")
        budget = budget_for(share, context, BUDGET_GRANULE) if share else None
        policy = POLICIES[kind].config
        settings[f"stages.{index}.cache"] = (policy.at_budget(budget) if budget else policy()).as_settings()
        settings[f"stages.{index}.optional"] = False  # an ablation of this stage must run it
    settings.update({key: value for key, value in run.settings if key not in RUN_KEYS})
    settings.update(
        {
            "sampling.temperature": run.get("temperature"),
            "max_new_tokens": new_tokens,
            "target.path": str(target),
            "dtype": dtype,
        }
    )
    if scaling := yarn_scaling(target, context + new_tokens):
        settings["target.rope_scaling"] = scaling
    return settings


def measure(run: Run, target: Path, dtype: str, repeats: int, prompt_cache: str | None = None) -> dict[str, Any]:
    """The CSV row of ``run``: median decode speed over ``repeats`` and the last generation's stats
    (``prompt_cache``: where prefilled prompts are reused across runs, see ``PromptCacheConfig``)."""
    started = time.perf_counter()
    settings = config_settings(run, target, dtype) | {"prompt_cache.dir": prompt_cache}
    _, config = load_config(run.get("preset"), None, [], settings)
    llm = LLM.from_config(config)
    prompt = list(prompt_tokens(target, run.get("document"), run.get("context")))
    llm.run(llm.prepare(prompt, max_new_tokens=WARMUP_TOKENS, ignore_eos=True))
    request = llm.prepare(prompt, max_new_tokens=run.get("new_tokens"), ignore_eos=True)
    runs = [llm.run(request).stats for _ in range(repeats)]
    stats, speeds = runs[-1], [run_stats["tokens_per_s"] for run_stats in runs]
    proposers = stats["stages"][:-1]
    return {
        "run_id": run.id,
        **{key: run.get(key, "") for key in RUN_KEYS},
        "settings": json.dumps({key: value for key, value in run.settings if key not in RUN_KEYS}),
        "tokens_per_s": round(statistics.median(speeds), 3),
        "ms_per_token": round(1000 / statistics.median(speeds), 3),
        "prefill_s": "" if stats["prefill_loaded"] else round(stats["prefill_s"], 3),
        "tokens_per_verify": round(stats["tokens_per_verify"], 3),
        "predicted_speedup": round(stats["predicted_speedup"], 3),
        "acceptance": json.dumps({stage["name"]: round(stage["acceptance_rate"], 4) for stage in proposers}),
        "mean_accepted_run": json.dumps({stage["name"]: round(stage["mean_accepted_run"], 3) for stage in proposers}),
        "stage_time_s": json.dumps({stage["name"]: round(stage["time_s"], 3) for stage in stats["stages"]}),
        "wall_s": round(time.perf_counter() - started, 1),
    }
