"""``python -m cascade.generate``: generate text with a preset or config; streams it to stdout."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from cache import describe_policies
from cascade import atomic
from cascade.completion import Completion
from cascade.errors import CascadeError, entry_point
from cascade.llm import LLM, with_kept_pass_costs
from cascade.logs import show_logs
from cascade.profiling import check_profile_dir, profiled
from configs import load_config, preset_names

DEFAULT_PROMPT = Path(__file__).parent / "data" / "alice_chapters_1_2.txt"
"""The prompt without --prompt or --prompt-file: the first two chapters of Alice's Adventures in
Wonderland (public domain; 6.1K SmolLM2 tokens, more than the default preset's retrieval budget, so
the first run speculates)."""

FLAG_SETTINGS = {  # CLI flag -> dotted config key it overrides
    "max_new_tokens": "max_new_tokens",
    "temperature": "sampling.temperature",
    "top_p": "sampling.top_p",
    "top_k": "sampling.top_k",
    "seed": "seed",
    "dtype": "dtype",
    "target": "target.path",
    "draft": "draft.path",
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m cascade.generate", description=__doc__)
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--preset", help=f"one of: {', '.join(preset_names())}")
    source.add_argument("--config", type=Path, help="a pipeline config YAML file")
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config setting, e.g. sampling.temperature=0.7 (repeatable)",
    )
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", help="prompt text (raw, tokenized with the target's tokenizer)")
    prompt.add_argument(
        "--prompt-file",
        type=Path,
        action="append",
        help="read the prompt from a UTF-8 text file; repeat it to generate for several prompts, decoded "
        "together where the preset decodes autoregressively",
    )
    parser.add_argument("--batch-size", type=int, help="with several --prompt-file: at most this many decode together")
    parser.add_argument("--chat", action="store_true", help="wrap the prompt in the target's chat template")
    parser.add_argument("--max-new-tokens", type=int)
    parser.add_argument("--temperature", type=float)
    parser.add_argument("--top-p", type=float)
    parser.add_argument("--top-k", type=int)
    parser.add_argument("--seed", type=int)
    parser.add_argument("--dtype", choices=["auto", "bfloat16", "float32"])
    parser.add_argument(
        "--target",
        help="target: a catalog model name (`python -m cascade.models list`) or a "
        "checkpoint directory (default: provisioned SmolLM2)",
    )
    parser.add_argument("--draft", help="draft: a catalog model name or a checkpoint directory")
    parser.add_argument("--json", type=Path, help="write text, token ids, config and stats here")
    parser.add_argument("--verbose", action="store_true", help="print every stage's stats to stderr at the end")
    parser.add_argument(
        "--profile",
        type=Path,
        metavar="DIR",
        help="profile the generation with torch.profiler: DIR/trace.json (Chrome trace, passes labelled by "
        "stage) and DIR/operators.txt (operators by self time)",
    )
    parser.add_argument(
        "--quiet", action="store_true", help="do not stream text to stdout nor print the one-line summary to stderr"
    )
    parser.add_argument(
        "--list-cache-policies",
        action="store_true",
        help="print every cache policy kind with its settings and defaults, then exit",
    )
    return parser.parse_args(argv)


def read_prompts(args: argparse.Namespace) -> list[str]:
    """The prompt texts: --prompt's, each --prompt-file's, or the default prompt."""
    if args.prompt_file is None:
        return [DEFAULT_PROMPT.read_text(encoding="utf-8") if args.prompt is None else args.prompt]
    return [read_prompt_file(path) for path in args.prompt_file]


def read_prompt_file(path: Path) -> str:
    try:
        text = path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise CascadeError(f"cannot read prompt file {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise CascadeError(f"prompt file {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    if not text.strip():
        raise CascadeError(f"prompt file {path} is empty: give some text")
    return text


def run(args: argparse.Namespace) -> dict[str, Any]:
    settings = {key: getattr(args, flag) for flag, key in FLAG_SETTINGS.items() if getattr(args, flag) is not None}
    preset, config = load_config(args.preset, args.config, args.set, settings)
    texts = read_prompts(args)
    if not texts[0].strip():
        raise CascadeError("the prompt is empty: give some text with --prompt or --prompt-file")
    llm = LLM.from_config(with_kept_pass_costs(config), preset)
    requests = [
        llm.prepare([{"role": "user", "content": text}], chat=True) if args.chat else llm.prepare(text)
        for text in texts
    ]
    run_info = {"preset": preset, "config": config.model_dump(mode="json")}
    device = llm.runtime.target.model.device
    with profiled(args.profile, device) if args.profile else contextlib.nullcontext():
        if len(requests) == 1:
            return output_of(generate_one(args, llm, requests[0])) | run_info
        return {"completions": generate_many(args, llm, requests), **run_info}


def generate_one(args: argparse.Namespace, llm: LLM, request) -> Completion:
    """One prompt's completion, its text streamed to stdout as it grows (unless --quiet)."""
    completion = llm.run(request, on_text=None if args.quiet else print_text)
    if not args.quiet:
        print(flush=True)
    return completion


def generate_many(args: argparse.Namespace, llm: LLM, requests: list) -> list[dict[str, Any]]:
    """Several prompt files' completions (decoded in batches where the preset allows), each printed
    under its file's name once done (unless --quiet) -> their reports, in order."""
    reports = []
    for path, completion in zip(args.prompt_file, llm.run_batch(requests, args.batch_size), strict=True):
        if not args.quiet:
            print(f"==> {path} <==\n{completion.text}\n", flush=True)
        reports.append(output_of(completion) | {"prompt_file": str(path)})
    return reports


def output_of(completion: Completion) -> dict[str, Any]:
    """A completion as the --json report holds it."""
    return {
        "text": completion.text,
        "token_ids": completion.token_ids,
        "prompt_token_ids": completion.prompt_token_ids,
        "stats": completion.stats,
    }


def print_text(delta: str) -> None:
    print(delta, end="", flush=True)


def check_writable(path: Path) -> None:
    """Fail before any work if ``write_json`` could not write ``path`` (a directory, a missing or
    read-only folder, a file where a folder should be)."""
    if path.is_dir():
        raise CascadeError(f"cannot write {path}: it is a directory; give a file path for --json")
    partial = atomic.partial_path(path)
    try:
        partial.touch()
        partial.unlink()
    except OSError as exc:
        raise CascadeError(f"cannot write {path}: {exc.strerror}") from None


def write_json(path: Path, data: dict[str, Any]) -> None:
    """Write atomically: a reader never sees half a file, an old file survives a failed write.
    If the write fails the report goes to stdout, so a finished generation is never lost."""
    try:
        atomic.write_text(path, json.dumps(data, indent=2) + "\n")
    except OSError as exc:
        print(json.dumps(data, indent=2))
        raise CascadeError(f"cannot write {path}: {exc.strerror}; the report is on stdout instead") from None


def summary(stats: dict[str, Any]) -> str:
    """One line: prompt and new tokens, speed, each proposing stage's acceptance, the cost model's
    predicted speed-up over autoregressive decoding."""
    parts = [
        f"[{stats['prompt_tokens']} prompt tokens, {stats['new_tokens']} new at {stats['tokens_per_s']:.1f} tokens/s"
    ]
    parts += [
        f"{stage['name']} accepted {stage['acceptance_rate']:.0%} of {stage['proposed']}"
        for stage in stats["stages"][:-1]
    ]
    if len(stats["stages"]) > 1:
        parts.append(f"predicted speed-up over autoregressive {stats['predicted_speedup']:.2f}x")
    return "; ".join(parts) + "]"


def print_stats(stats: dict[str, Any]) -> None:
    say = lambda line: print(line, file=sys.stderr)  # noqa: E731
    loaded = " (loaded from the prompt cache)" if stats["prefill_loaded"] else ""
    say(
        f"\n[{stats['prompt_tokens']} prompt tokens, prefill {stats['prefill_s']:.2f} s{loaded}; "
        f"{stats['new_tokens']} new tokens at {stats['tokens_per_s']:.1f} tokens/s "
        f"({stats['ms_per_token']:.1f} ms/token); stop: {stats['stop_reason']}]"
    )
    if len(stats["stages"]) > 1:
        say(
            f"  {stats['tokens_per_verify']:.2f} tokens per full-cache pass; cost model speed-up "
            f"{stats['predicted_speedup']:.2f}x"
        )
    for stage in stats["stages"]:
        line = (
            f"  stage {stage['name']}: {stage['forward_calls']} passes, {stage['time_s']:.2f} s, "
            f"{stage['kv_bytes_read'] / 2**20:.1f} MiB KV read"
        )
        if stage["rounds"]:
            line += (
                f"; proposed {stage['proposed']}, accepted {stage['accepted']} "
                f"({stage['acceptance_rate']:.0%}, {stage['mean_accepted_run']:.2f} per round); "
                f"{stage['schedule']} gamma, rounds per gamma {stage['gamma_choices']}"
            )
            if stage["unmatched"]:
                line += f"; found nothing to propose in {stage['unmatched']} rounds (plain steps)"
            if stage["verify_over_step"]:
                line += f"; a verification pass costs {stage['verify_over_step']:.2f} plain steps"
            if stage["tree_nodes"]:
                ranks = ", ".join(f"{share:.2f}" for share in stage["rank_acceptance"])
                line += (
                    f"; token trees of {stage['tree_nodes'] / stage['rounds']:.1f} nodes, the verifier's "
                    f"token was its 1st, 2nd, ... most likely in shares {ranks}"
                )
        if stage["held_rounds"]:
            line += f"; sat out {stage['held_rounds']} rounds while the stage above was unproven"
        say(line)


@entry_point
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    show_logs(quiet=args.quiet)
    if args.list_cache_policies:
        print(describe_policies())
        return 0
    if args.json:
        check_writable(args.json)
    if args.profile:
        check_profile_dir(args.profile)
    if args.batch_size is not None and args.batch_size < 1:
        raise CascadeError(f"--batch-size must be at least 1; got {args.batch_size}")
    output = run(args)
    if args.json:
        write_json(args.json, output)
    for completion in output.get("completions", [output]):
        if args.verbose:
            print_stats(completion["stats"])
        elif not args.quiet:
            print(f"\n{summary(completion['stats'])}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
