"""``llama-speculative`` runs: a draft GGUF proposing to a target GGUF of the same vocabulary (the
Qwen2.5-Coder 0.5B -> 1.5B pair, say), greedy or sampled, on a prompt file; what it prints, parsed.
Sampled (temperature > 0), llama-speculative verifies stochastically; its own default top-k 40 and
min-p 0.05 are switched off, so it starts from the distribution cascade samples at the same
temperature and top-p. It is not lossless there: it proposes the draft's most probable token and
judges it as if it had been sampled (docs/benchmarks.md), which raises its acceptance.

Rope scaling comes from the GGUF files themselves (``cascade.peers.convert.peer_gguf``), so the
target and the draft each keep their own native context and YaRN stretch. At the end of a run the
tool logs its speeds and counts (each line after a time stamp and a level)::

    0.09.135.693 I encoded  102 tokens in    3.728 seconds, speed:   27.361 t/s
    0.09.135.705 I decoded   11 tokens in    0.795 seconds, speed:   13.833 t/s
    0.09.135.717 I n_draft   = 4
    0.09.135.722 I n_predict = 11
    0.09.135.728 I n_drafted = 8
    0.09.135.733 I n_accept  = 8
    0.09.135.739 I accept    = 100.000%
"""

from __future__ import annotations

import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

from cascade.errors import CascadeError
from cascade.peers.llama_bench import FLASH_ATTN_CODES

SPEED = re.compile(r"(encoded|decoded)\s+(\d+) tokens in\s+([\d.]+) seconds, speed:\s+([\d.]+) t/s")
COUNT = re.compile(r"\b(n_draft|n_predict|n_drafted|n_accept)\s*=\s*(\d+)")


@dataclass(frozen=True)
class SpeculativeSettings:
    """One llama-speculative run (greedy at temperature 0)."""

    new_tokens: int = 128
    draft_max: int = 3
    """Tokens the draft proposes per round (``--spec-draft-n-max``; llama-speculative proposes this
    many every round). llama.cpp's own default, 3, was its fastest for the Qwen2.5-Coder pair at 1K
    tokens (prose and code, greedy and sampled) against 8 and 16; 16 proposed on prose cost it
    more than half its speed."""
    draft_min: int = 0
    """Fewest tokens a round proposes (``--spec-draft-n-min``)."""
    context: int = 0
    """KV cache size of each model; 0 takes the GGUF's context length (stretched, for a YaRN copy)."""
    batch: int = 2048
    """Most tokens per llama_decode call (``-b``): llama-speculative decodes the whole prompt in one
    call and aborts when the prompt is longer, so at least the prompt's length."""
    flash_attn: str = "auto"
    threads: int = 2
    seed: int = 0
    temperature: float = 0.0
    """0: greedy (the target's argmax decides); above: sampled, verified stochastically."""
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.new_tokens < 1 or self.draft_max < 1 or not 0 <= self.draft_min <= self.draft_max:
            raise CascadeError(
                f"llama-speculative needs new_tokens >= 1 and 0 <= draft_min <= draft_max >= 1; "
                f"got {self.new_tokens}, {self.draft_min}, {self.draft_max}"
            )
        if self.context < 0 or self.threads < 1 or self.batch < 1:
            raise CascadeError(
                f"llama-speculative needs context >= 0, threads >= 1 and batch >= 1; "
                f"got {self.context}, {self.threads}, {self.batch}"
            )
        if self.flash_attn not in FLASH_ATTN_CODES.values():
            raise CascadeError(f"flash attention {self.flash_attn!r}: expected off, on or auto")
        if self.temperature < 0 or not 0 < self.top_p <= 1:
            raise CascadeError(
                f"llama-speculative needs temperature >= 0 and 0 < top_p <= 1; got {self.temperature}, {self.top_p}"
            )


def speculative_command(
    tool: Path, target: Path, draft: Path, prompt_file: Path, settings: SpeculativeSettings
) -> list[str]:
    """The llama-speculative command line: ``draft`` proposing to ``target`` on the text of
    ``prompt_file``, sampling at the settings' temperature and top-p alone (top-k and min-p off)."""
    return [
        str(tool),
        "-m",
        str(target),
        "-md",
        str(draft),
        "-f",
        str(prompt_file),
        "-n",
        str(settings.new_tokens),
        "--temp",
        str(settings.temperature),
        "--top-p",
        str(settings.top_p),
        "--top-k",
        "0",
        "--min-p",
        "0",
        "--seed",
        str(settings.seed),
        "-t",
        str(settings.threads),
        "-td",
        str(settings.threads),
        "-c",
        str(settings.context),
        "-b",
        str(settings.batch),
        "-fa",
        settings.flash_attn,
        "--spec-draft-n-max",
        str(settings.draft_max),
        "--spec-draft-n-min",
        str(settings.draft_min),
    ]


def run_speculative(tool: Path, target: Path, draft: Path, prompt_file: Path, settings: SpeculativeSettings) -> dict:
    """Run llama-speculative -> its figures (see ``parse_speculative_output``)."""
    command = speculative_command(tool, target, draft, prompt_file, settings)
    result = subprocess.run(command, check=False, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if result.returncode != 0:
        last = result.stdout.strip().splitlines()[-5:] or ["no output"]
        raise CascadeError(f"llama-speculative failed (exit {result.returncode}):\n" + "\n".join(last))
    return parse_speculative_output(result.stdout)


def parse_speculative_output(text: str) -> dict:
    """llama-speculative's log -> ``prompt_tokens``, ``prefill_s``, ``prefill_tokens_per_s``,
    ``new_tokens``, ``decode_s``, ``decode_tokens_per_s``, ``n_draft`` (most proposed per round),
    ``n_drafted`` (proposed), ``n_accept`` (accepted) and ``acceptance`` (accepted / proposed)."""
    speeds = {kind: match for kind, *match in SPEED.findall(text)}
    counts = dict(COUNT.findall(text))
    missing = [name for name in ("encoded", "decoded") if name not in speeds]
    missing += [name for name in ("n_draft", "n_predict", "n_drafted", "n_accept") if name not in counts]
    if missing:
        tail = "\n".join(text.strip().splitlines()[-5:])
        raise CascadeError(f"llama-speculative's output lacks {', '.join(missing)}; it ended:\n{tail}")
    (prompt_tokens, prefill_s, prefill_rate), (_, decode_s, decode_rate) = speeds["encoded"], speeds["decoded"]
    drafted, accepted = int(counts["n_drafted"]), int(counts["n_accept"])
    return {
        "prompt_tokens": int(prompt_tokens),
        "prefill_s": float(prefill_s),
        "prefill_tokens_per_s": float(prefill_rate),
        "new_tokens": int(counts["n_predict"]),
        "decode_s": float(decode_s),
        "decode_tokens_per_s": float(decode_rate),
        "n_draft": int(counts["n_draft"]),
        "n_drafted": drafted,
        "n_accept": accepted,
        "acceptance": accepted / drafted if drafted else None,
    }
