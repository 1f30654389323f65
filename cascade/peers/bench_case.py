"""llama.cpp as one case of ``scripts/bench.py``: a context's prefill and decode speeds, flash
attention off and on, and the best setting's figures under the names the cascade cases use.

A case at context N runs llama-bench twice, one repetition each (bench.py repeats the case in its
interleaved rounds): prompt processing of N tokens on an empty cache (prefill), and generation of
the new tokens after N tokens in the cache (decode). Within the case the faster flash-attention
setting gives ``prefill_tokens_per_s`` and ``decode_tokens_per_s``, so cascade is compared with
llama.cpp at its best. Each setting prefills the context for both tests (llama-bench fills the
decode test's depth untimed): at 32K tokens that is most of a case's time, so a case may be asked
for one setting only (the one earlier runs found faster), for decode alone (no prefill test:
half the prefilling; its prefill rate is then None) or prefill alone (no decode test, whose untimed
depth is the other half; its decode rate is then None), and for several repetitions in one run:
llama-bench prefills a depth once and restores it for each further repetition, and the case
reports the median of the repetitions.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from cascade.errors import CascadeError
from cascade.peers.llama_bench import FLASH_ATTN, BenchSettings, run_llama_bench

RATES = {"pp": "prefill_tokens_per_s", "tg": "decode_tokens_per_s"}


def context_case(
    tool: Path,
    model: Path,
    context: int,
    new_tokens: int,
    threads: int,
    flash_attn: tuple[str, ...] = FLASH_ATTN,
    prefill: bool = True,
    repetitions: int = 1,
    decode: bool = True,
) -> dict:
    """One measurement of llama-bench (``tool``) on ``model`` at ``context`` with each ``flash_attn``
    setting -> ``prefill_tokens_per_s`` (None without ``prefill``), ``decode_tokens_per_s`` (None
    without ``decode``; each rate the best setting's, the median of its ``repetitions``),
    ``flash_attn`` ({setting: the rates measured}), ``best_flash_attn`` ({rate: setting}),
    ``build_commit`` and the parsed ``tests``."""
    if not (prefill or decode):
        raise CascadeError("a llama.cpp case needs its prefill test, its decode test or both")
    common = {"threads": threads, "repetitions": repetitions, "flash_attn": flash_attn}
    runs = [BenchSettings(prompt_tokens=(context,), **common)] if prefill else []
    if decode:
        runs.append(BenchSettings(gen_tokens=(new_tokens,), depths=(context,), **common))
    tests = [test for settings in runs for test in run_llama_bench(tool, model, settings)]
    by_setting = {
        setting: {
            RATES[test["test"]]: statistics.median(test["samples_tokens_per_s"])
            for test in tests
            if test["flash_attn"] == setting
        }
        for setting in flash_attn
    }
    rates = list(by_setting[flash_attn[0]])
    best = {rate: max(flash_attn, key=lambda setting: by_setting[setting][rate]) for rate in rates}
    return {
        **dict.fromkeys(RATES.values()),
        **{rate: by_setting[best[rate]][rate] for rate in rates},
        "flash_attn": by_setting,
        "best_flash_attn": best,
        "build_commit": tests[0]["build_commit"],
        "tests": tests,
    }


def flash_attn_summary(runs: list[dict]) -> dict:
    """A case's rounds -> {setting: {rate: median over rounds}}, and the best setting per rate."""
    settings = list(runs[0]["flash_attn"])
    rates = list(runs[0]["flash_attn"][settings[0]])
    medians = {
        setting: {rate: statistics.median(run["flash_attn"][setting][rate] for run in runs) for rate in rates}
        for setting in settings
    }
    best = {rate: max(settings, key=lambda setting: medians[setting][rate]) for rate in rates}
    return {"flash_attn": medians, "best_flash_attn": best}
