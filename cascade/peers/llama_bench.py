"""``llama-bench`` runs: the command line for given settings, and its JSON output as plain dicts.

llama-bench times passes over random tokens, without sampling: prompt processing (test ``pp``:
``n_prompt`` tokens in batches) and token generation (test ``tg``: ``n_gen`` one-token passes), each
after ``n_depth`` tokens already in the KV cache (filled untimed), each ``repetitions`` times after
a warm-up run, once per flash-attention setting asked. It reports tokens/s as the mean and standard
deviation over the repetitions, and the llama.cpp commit it was built from.
"""

from __future__ import annotations

import json
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cascade.errors import CascadeError

FLASH_ATTN = ("off", "on")
FLASH_ATTN_CODES = {-1: "auto", 0: "off", 1: "on"}
"""How llama-bench's JSON writes the setting (llama.cpp's ``llama_flash_attn_type``)."""


@dataclass(frozen=True)
class BenchSettings:
    """One llama-bench invocation: every test below at every depth, for every flash-attention setting."""

    prompt_tokens: tuple[int, ...] = ()
    """Prompt-processing tests, by prompt length."""
    gen_tokens: tuple[int, ...] = ()
    """Token-generation tests, by tokens generated."""
    depths: tuple[int, ...] = (0,)
    """Tokens in the KV cache before each test."""
    flash_attn: tuple[str, ...] = FLASH_ATTN
    threads: int = 2
    repetitions: int = 3

    def __post_init__(self) -> None:
        if not (self.prompt_tokens or self.gen_tokens):
            raise CascadeError("llama-bench needs a prompt-processing or a token-generation test")
        if not self.depths:
            raise CascadeError("llama-bench needs a KV depth (0: an empty cache)")
        counts = {
            "prompt lengths": (self.prompt_tokens, 1),
            "generated tokens": (self.gen_tokens, 1),
            "depths": (self.depths, 0),
            "threads": ((self.threads,), 1),
            "repetitions": ((self.repetitions,), 1),
        }
        for what, (values, least) in counts.items():
            if any(value < least for value in values):
                raise CascadeError(f"llama-bench {what} must be >= {least}; got {list(values)}")
        if not self.flash_attn or set(self.flash_attn) - set(FLASH_ATTN_CODES.values()):
            raise CascadeError(f"flash attention settings {list(self.flash_attn)}: expected some of off, on, auto")


def bench_command(tool: Path, model: Path, settings: BenchSettings) -> list[str]:
    """The llama-bench command line that runs ``settings`` on the GGUF ``model`` and prints JSON."""

    def listed(values) -> str:
        return ",".join(str(value) for value in values) or "0"  # 0: no test of that kind

    return [
        str(tool),
        "-m",
        str(model),
        "-o",
        "json",
        "-t",
        str(settings.threads),
        "-r",
        str(settings.repetitions),
        "-p",
        listed(settings.prompt_tokens),
        "-n",
        listed(settings.gen_tokens),
        "-d",
        listed(settings.depths),
        "-fa",
        listed(settings.flash_attn),
    ]


def run_llama_bench(tool: Path, model: Path, settings: BenchSettings) -> list[dict]:
    """Run llama-bench -> one dict per test (see ``bench_result``)."""
    result = subprocess.run(bench_command(tool, model, settings), check=False, capture_output=True, text=True)
    if result.returncode != 0:
        last = result.stderr.strip().splitlines()[-5:] or ["no output"]
        raise CascadeError(f"llama-bench failed on {model} (exit {result.returncode}):\n" + "\n".join(last))
    return parse_bench_json(result.stdout)


def parse_bench_json(text: str) -> list[dict]:
    """llama-bench's ``-o json`` output -> one dict per test."""
    try:
        records = json.loads(text)
    except json.JSONDecodeError as exc:
        raise CascadeError(f"llama-bench's output is not JSON ({exc}): {text[:200]!r}") from None
    if not isinstance(records, list) or not all(isinstance(record, dict) for record in records):
        raise CascadeError(f"llama-bench's JSON is not a list of test records: {text[:200]!r}")
    return [bench_result(record) for record in records]


def bench_result(record: dict) -> dict:
    """One test of llama-bench's JSON in our names: what ran (``test`` pp or tg, ``n_prompt``,
    ``n_gen``, ``n_depth``, ``flash_attn`` on/off/auto, ``threads``, the model's ``type`` and
    ``file``), how fast (``tokens_per_s`` mean and ``tokens_per_s_stddev`` over the repetitions,
    ``samples_tokens_per_s``), and the llama.cpp ``build_commit`` / ``build_number``."""
    try:
        return {
            "test": "pp" if record["n_prompt"] else "tg",
            "n_prompt": record["n_prompt"],
            "n_gen": record["n_gen"],
            "n_depth": record["n_depth"],
            "flash_attn": FLASH_ATTN_CODES.get(record["flash_attn"], str(record["flash_attn"])),
            "threads": record["n_threads"],
            "type": record["model_type"],
            "file": record["model_filename"],
            "tokens_per_s": record["avg_ts"],
            "tokens_per_s_stddev": record["stddev_ts"],
            "samples_tokens_per_s": record["samples_ts"],
            "build_commit": record["build_commit"],
            "build_number": record["build_number"],
        }
    except KeyError as exc:
        raise CascadeError(f"a llama-bench test record lacks {exc} (a llama.cpp whose JSON differs?)") from None
