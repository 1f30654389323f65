"""Batched decoding: decode tokens/s at several batch sizes, side by side in one process.

A batch of B decodes B prompts of ``--context`` tokens each (windows of the document, one after
another) together, greedy, ``--new-tokens`` each without stopping at end-of-sequence; its rate is
every row's decoded tokens over the batch's decode time (its first step to its last row's end).
Batched autoregressive decoding always runs; ``--preset`` (a speculating one) runs beside it on the
same loaded models, each batch size of it right after autoregressive decoding's. Each round runs
every batch size once, in order on even rounds and in reverse on odd ones (this machine's speed
drifts); the report has, per preset and size, the median rate, its median ratio to batch 1 within
a round (and the preset's to autoregressive decoding at the same size), the peak memory, and
whether the first row's tokens were autoregressive batch 1's in every run (they must be: a row of a
batch computes what it would alone, and a preset's greedy tokens are the target's). Prompts are stored in the prompt
cache (``--prompt-cache``, by default a fresh one) by an untimed first pass, so a batch's prefill
loads them. With ``--documents DIR``, a summarization job over the documents there (``python -m
cascade.summarize``, autoregressive, ``--summary-tokens`` at most per summary) also runs at each
batch size, its wall time (the model's load included) reported per round, with whether its
summaries were batch 1's.

    python scripts/batch_bench.py [--target NAME] [--preset self-spec [--draft NAME]]
        [--document plrabn12] [--contexts 2000 8000]
        [--batch-sizes 1 4 8] [--new-tokens 64] [--repeats 3] [--prompt-cache DIR] [--set KEY=VALUE ...]
        [--documents DIR [--summary-tokens 128]]

The report goes to a new run directory under ``$CASCADE_HOME/runs/batch_bench/`` with a manifest,
or to ``--out FILE``.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

from cascade.checkpoint import checkpoint_option, yarn_scaling
from cascade.data import DOCUMENT_NAMES, document_ids
from cascade.errors import CascadeError, entry_point
from cascade.limits import memory_bandwidth
from cascade.llm import LLM
from cascade.models import default_model
from cascade.runs import run_files
from cascade.summarize.__main__ import main as summarize_main
from configs import load_config
from configs.loading import preset_data, preset_names


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=checkpoint_option, help="target checkpoint (default: SmolLM2)")
    parser.add_argument(
        "--preset", default="autoregressive", choices=preset_names(), help="run beside autoregressive decoding"
    )
    parser.add_argument("--draft", type=checkpoint_option, help="draft checkpoint (default: the target's)")
    parser.add_argument("--document", default="plrabn12", choices=DOCUMENT_NAMES)
    parser.add_argument("--contexts", type=int, nargs="+", default=[2000, 8000], help="prompt tokens per row")
    parser.add_argument("--batch-sizes", type=int, nargs="+", default=[1, 4, 8])
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="bfloat16", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--prompt-cache", help="where prompts are stored (default: a fresh temporary one)")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--documents", type=Path, help="also time a summarization job over the documents here")
    parser.add_argument("--summary-tokens", type=int, default=128, help="the job's --max-new-tokens")
    parser.add_argument("--out", type=Path, help="write the report here (default: a new run directory)")
    args = parser.parse_args(argv)
    if min(args.contexts) < 16 or min(args.batch_sizes) < 1 or args.new_tokens < 2 or args.repeats < 1:
        raise CascadeError(
            "--contexts at least 16, --batch-sizes at least 1, --new-tokens at least 2, --repeats at least 1"
        )
    if 1 not in args.batch_sizes:
        raise CascadeError("--batch-sizes must include 1: every rate is reported against it")
    return args


def build_llms(args: argparse.Namespace, target: Path, context: int, store: str) -> dict[str, LLM]:
    """Autoregressive decoding and ``--preset`` (if another) on one set of loaded models."""
    settings = {"dtype": args.dtype, "target.path": str(target), "prompt_cache.dir": store}
    if scaling := yarn_scaling(target, context + args.new_tokens):
        settings["target.rope_scaling"] = scaling
    if "draft" in {stage["model"] for stage in preset_data(args.preset)["stages"]}:
        settings["draft.path"] = str(args.draft or default_model("draft", target=target))
    name, config = load_config(args.preset, None, args.set, settings)
    llm = LLM.from_config(config, name)
    autoregressive = llm.on_stages(config.stages[-1:], "autoregressive")
    return {"autoregressive": autoregressive, **({name: llm} if name != "autoregressive" else {})}


def decode(llm: LLM, prompts: list[list[int]], new_tokens: int) -> dict:
    """One batch of ``prompts`` -> its decode rate, time, first row's tokens and, per proposing
    stage, the share of its proposals accepted over all rows."""
    completions = llm.run_batch([llm.prepare(prompt, max_new_tokens=new_tokens, ignore_eos=True) for prompt in prompts])
    decode_s = max(completion.stats["decode_s"] for completion in completions)
    decoded = sum(len(completion.token_ids) - 1 for completion in completions)
    stages = [stage for completion in completions for stage in completion.stats["stages"][:-1]]
    proposed = {stage["name"]: 0 for stage in stages}
    accepted = dict(proposed)
    for stage in stages:
        proposed[stage["name"]] += stage["proposed"]
        accepted[stage["name"]] += stage["accepted"]
    return {
        "decode_s": decode_s,
        "tokens_per_s": decoded / decode_s,
        "first_row": completions[0].token_ids,
        "acceptance": {name: accepted[name] / proposed[name] if proposed[name] else None for name in proposed},
        "proposed": proposed,
    }


def measure_context(args: argparse.Namespace, target: Path, context: int, store: str) -> dict:
    """Every preset and batch size at ``context``, ``--repeats`` interleaved rounds."""
    llms = build_llms(args, target, context, store)
    document = document_ids(target, args.document, context * max(args.batch_sizes))
    prompts = [document[row * context : (row + 1) * context] for row in range(max(args.batch_sizes))]
    for llm in llms.values():  # untimed: every model's prompts stored
        llm.run_batch([llm.prepare(prompt, max_new_tokens=2, ignore_eos=True) for prompt in prompts])
    runs: dict[tuple[str, int], list[dict]] = {(name, size): [] for name in llms for size in args.batch_sizes}
    for index in range(args.repeats):
        bandwidth = memory_bandwidth()
        for size in args.batch_sizes if index % 2 == 0 else args.batch_sizes[::-1]:
            for name, llm in llms.items():
                run = decode(llm, prompts[:size], args.new_tokens)
                runs[name, size].append(run | {"round": index, "bandwidth_bytes_per_s": bandwidth})
                rate = f"{run['tokens_per_s']:.1f} tok/s"
                print(f"[ctx {context} round {index + 1}] {name} batch {size}: {rate}", file=sys.stderr)
    reference = {run["round"]: run for run in runs["autoregressive", 1]}
    return {
        "context": context,
        **{
            "batches" if name == "autoregressive" else "preset": [
                batch_row(runs, name, size, reference) for size in args.batch_sizes
            ]
            for name in llms
        },
    }


def batch_row(runs: dict[tuple[str, int], list[dict]], name: str, size: int, reference: dict[int, dict]) -> dict:
    """One preset at one batch size: median rate, median per-round ratios, exactness, its runs."""

    def median_over(other: str, other_size: int) -> float:
        by_round = {run["round"]: run["tokens_per_s"] for run in runs[other, other_size]}
        return statistics.median(run["tokens_per_s"] / by_round[run["round"]] for run in runs[name, size])

    return {
        "preset": name,
        "batch_size": size,
        "tokens_per_s": statistics.median(run["tokens_per_s"] for run in runs[name, size]),
        "over_batch_1": median_over(name, 1),
        "over_autoregressive": median_over("autoregressive", size),
        "first_row_as_batch_1": all(
            run["first_row"] == reference[run["round"]]["first_row"] for run in runs[name, size]
        ),
        "runs": runs[name, size],
    }


def measure_summaries(args: argparse.Namespace, target: Path) -> dict:
    """The summarization job over ``--documents`` at every batch size, ``--repeats`` interleaved rounds."""
    runs: dict[int, list[dict]] = {size: [] for size in args.batch_sizes}
    for index in range(args.repeats):
        for size in args.batch_sizes if index % 2 == 0 else args.batch_sizes[::-1]:
            runs[size].append(summary_job(args, target, size) | {"round": index})
            print(f"[summaries round {index + 1}] batch {size}: {runs[size][-1]['wall_s']:.1f} s", file=sys.stderr)
    single = {run["round"]: run for run in runs[1]}
    return {
        "documents": str(args.documents),
        "batches": [
            {
                "batch_size": size,
                "wall_s": statistics.median(run["wall_s"] for run in runs[size]),
                "speedup_over_batch_1": statistics.median(
                    single[run["round"]]["wall_s"] / run["wall_s"] for run in runs[size]
                ),
                "summaries_as_batch_1": all(
                    run["summaries"] == single[run["round"]]["summaries"] for run in runs[size]
                ),
                "runs": runs[size],
            }
            for size in args.batch_sizes
        ],
    }


def summary_job(args: argparse.Namespace, target: Path, batch_size: int) -> dict:
    """One run of the summarization job at ``batch_size`` into a fresh output -> its wall time, its
    documents' prefill and decode totals, and its summaries."""
    with tempfile.TemporaryDirectory(prefix="cascade-batch-bench-") as scratch:
        output = Path(scratch) / "summaries.jsonl"
        flags = ["--preset", "autoregressive", "--max-new-tokens", str(args.summary_tokens), "--quiet"]
        flags += ["--batch-size", str(batch_size), "--set", f"target.path={target}", "--set", f"dtype={args.dtype}"]
        started = time.perf_counter()
        summarize_main([str(args.documents), "--output", str(output), *flags])
        wall_s = time.perf_counter() - started
        records = [json.loads(line) for line in output.read_text().splitlines()]
    return {
        "wall_s": wall_s,
        "prefill_s": sum(record["stats"].get("prefill_s", 0.0) for record in records),
        "new_tokens": sum(record["stats"].get("new_tokens", 0) for record in records),
        "summaries": [record.get("summary") for record in records],
    }


def print_table(report: dict) -> None:
    """One line per context, preset and batch size, and per batch size of the summarization job."""
    for measured in report["contexts"]:
        for row in measured["batches"] + measured.get("preset", []):
            print(
                f"context {measured['context']:>6} {row['preset']:>14} batch {row['batch_size']:>2}: "
                f"{row['tokens_per_s']:7.1f} tok/s, {row['over_batch_1']:.2f}x batch 1, "
                f"{row['over_autoregressive']:.2f}x autoregressive, first row as batch 1: {row['first_row_as_batch_1']}"
            )
    for row in report["summaries"]["batches"] if report["summaries"] else []:
        print(
            f"summarization job, batch {row['batch_size']:>2}: {row['wall_s']:6.1f} s, "
            f"{row['speedup_over_batch_1']:.2f}x batch 1, summaries as batch 1: {row['summaries_as_batch_1']}"
        )


@entry_point
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    files = run_files("batch_bench", args.out, "batch_bench.json")
    target = args.target or default_model("target")
    with tempfile.TemporaryDirectory(prefix="cascade-batch-bench-") as fresh:
        store = args.prompt_cache or fresh
        contexts = [measure_context(args, target, context, store) for context in args.contexts]
    summaries = measure_summaries(args, target) if args.documents else None
    report = {
        "settings": {
            key: getattr(args, key)
            for key in (
                "preset",
                "draft",
                "document",
                "contexts",
                "batch_sizes",
                "new_tokens",
                "repeats",
                "dtype",
                "set",
                "documents",
                "summary_tokens",
            )
        },
        "target": str(target),
        "contexts": contexts,
        "summaries": summaries,
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
    }
    files.write(report, vars(args))
    print_table(report)
    print(f"wrote {files.report} (manifest: {files.manifest})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
