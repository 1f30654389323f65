"""Decode and prefill speed of cascade's autoregressive path vs transformers' generate(), side by side.

Both run the same checkpoint in the same dtype, greedy, on the first N tokens of a long document.
The machine's speed drifts, so the cases are interleaved: each of ``--repeats`` rounds runs every
(implementation, context) case once, each in its own subprocess (load, ``--warmups`` generations, one
measured generation), odd rounds in reverse order. A case reports the median over rounds (peak RSS:
the maximum); a ratio cascade / transformers is taken within each round, then its median reported.

    python scripts/bench.py [--contexts 1024 8000] [--new-tokens 64] [--repeats 3] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from cascade.data import DOCUMENTS, document_text
from cascade.errors import CascadeError

IMPLS = ("cascade", "transformers")
MAX_TOKENS = 8192  # SmolLM2's native context: prompt + new tokens must fit


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python scripts/bench.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[1024, 8000],
                        help="prompt lengths in tokens")
    parser.add_argument("--new-tokens", type=int, default=64, help="tokens generated per run")
    parser.add_argument("--repeats", type=int, default=3,
                        help="rounds, each running every case once (medians reported)")
    parser.add_argument("--warmups", type=int, default=2,
                        help="generations before the measured one, per process (first-touch costs)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--document", choices=sorted(DOCUMENTS), default="plrabn12", help="prompt source")
    parser.add_argument("--target", help="checkpoint directory (default: the provisioned SmolLM2)")
    parser.add_argument("--out", type=Path, default=Path("results/bench_foundation.json"))
    parser.add_argument("--case", help=argparse.SUPPRESS)  # "impl:context": run one case, print JSON
    args = parser.parse_args(argv)
    for context in args.contexts:
        if context < 1 or context + args.new_tokens > MAX_TOKENS:
            parser.error(f"context {context} + {args.new_tokens} new tokens must be between 1 and "
                         f"{MAX_TOKENS} tokens (the target's native context) in all")
    if args.new_tokens < 2 or args.repeats < 1:
        parser.error("--new-tokens must be >= 2 and --repeats >= 1")
    return args


# ---- one case, in its own process -------------------------------------------------------------


def model_dir(args: argparse.Namespace) -> Path:
    from cascade.models import default_model

    return Path(args.target) if args.target else default_model("target", log=log)


def prompt_ids(path: Path, document: str, context: int) -> torch.Tensor:
    """The first ``context`` tokens of ``document`` under the checkpoint's tokenizer -> [T]."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(path)
    ids = tokenizer(document_text(document, log), add_special_tokens=False, verbose=False)["input_ids"]
    if len(ids) < context:
        raise CascadeError(f"document {document!r} has only {len(ids)} tokens; need {context}")
    return torch.tensor(ids[:context])


def run_cascade(args: argparse.Namespace, path: Path, prompt: torch.Tensor) -> tuple[dict, list[int]]:
    from cascade.pipeline import StopRule
    from cascade.runtime import build_runtime
    from configs import load_config

    settings = {"dtype": args.dtype, "max_new_tokens": args.new_tokens, "target.path": str(path)}
    _, config = load_config(preset="autoregressive", settings=settings)
    runtime = build_runtime(config, log=log)
    stop = StopRule(frozenset(), args.new_tokens)  # no EOS: exactly N tokens, like min_new_tokens
    for _ in range(args.warmups + 1):  # the last generation is the measured one
        result = runtime.pipeline_for(prompt.numel(), args.new_tokens).generate(prompt, stop)
    stats = result.stats
    return {"prefill_s": stats.prefill_s, "decode_s": stats.decode_s,
            "prefill_tokens_per_s": prompt.numel() / stats.prefill_s,
            "decode_tokens_per_s": stats.tokens_per_s}, result.token_ids


def run_transformers(args: argparse.Namespace, path: Path, prompt: torch.Tensor) -> tuple[dict, list[int]]:
    """Prefill time is a 1-token generate()'s; decode speed comes from the N-token one's extra time."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging

    logging.set_verbosity_error()
    logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, args.dtype)).eval()
    inputs = {"input_ids": prompt[None, :], "attention_mask": torch.ones(1, prompt.numel(), dtype=torch.long)}
    n = args.new_tokens

    def timed(new_tokens: int) -> tuple[float, list[int]]:
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(**inputs, do_sample=False, max_new_tokens=new_tokens,
                                 min_new_tokens=new_tokens, pad_token_id=model.config.eos_token_id)
        return time.perf_counter() - started, out[0, prompt.numel():].tolist()

    for _ in range(args.warmups):
        timed(n)
    (t_1, _), (t_n, tokens) = timed(1), timed(n)
    return {"t_1_s": t_1, "t_n_s": t_n, "prefill_tokens_per_s": prompt.numel() / t_1,
            "decode_tokens_per_s": (n - 1) / (t_n - t_1)}, tokens


def run_case(args: argparse.Namespace) -> dict:
    """One measurement of one case in this process: {"run": figures, "token_ids": generated}."""
    impl, context = args.case.split(":")
    path = model_dir(args)
    prompt = prompt_ids(path, args.document, int(context))
    run, tokens = (run_cascade if impl == "cascade" else run_transformers)(args, path, prompt)
    run["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"run": run, "token_ids": tokens}


# ---- the driver: rounds of one subprocess per case, then the table and the JSON ---------------


RATES = ("decode_tokens_per_s", "prefill_tokens_per_s")


def spawn_case(args: argparse.Namespace, impl: str, context: int) -> dict:
    command = [sys.executable, __file__, "--case", f"{impl}:{context}", "--new-tokens", str(args.new_tokens),
               "--dtype", args.dtype, "--document", args.document, "--warmups", str(args.warmups),
               "--contexts", str(context), *(["--target", args.target] if args.target else [])]
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise CascadeError(f"the {impl} case at context {context} failed (exit {result.returncode})")
    return json.loads(result.stdout.strip().splitlines()[-1])


def run_round(args: argparse.Namespace, cases: list[tuple[str, int]], index: int) -> dict:
    """Every case once, in order on even rounds and in reverse on odd ones -> {(impl, context): case}."""
    order = cases if index % 2 == 0 else cases[::-1]
    measured = {}
    for slot, (impl, context) in enumerate(order):
        started = time.perf_counter()
        case = spawn_case(args, impl, context)
        run = case["run"]
        run.update(round=index, slot=slot)
        log(f"[round {index + 1}/{args.repeats} {impl:12} ctx {context:>5}] decode "
            f"{run['decode_tokens_per_s']:7.1f} tok/s, prefill {run['prefill_tokens_per_s']:7.1f} tok/s, "
            f"peak RSS {run['peak_rss_mb']:6.0f} MB ({time.perf_counter() - started:.0f} s)")
        measured[(impl, context)] = case
    return measured


def summarize(args: argparse.Namespace, impl: str, context: int, cases: list[dict]) -> dict:
    """One case over its rounds: median rates, maximum peak RSS, the per-round figures in ``runs``."""
    runs = [case["run"] for case in cases]
    if any(case["token_ids"] != cases[0]["token_ids"] for case in cases):
        log(f"warning: {impl} at context {context} generated different tokens in different rounds")
    return {"impl": impl, "context": context, "new_tokens": args.new_tokens, "dtype": args.dtype,
            **{key: statistics.median(run[key] for run in runs) for key in RATES},
            "peak_rss_mb": max(run["peak_rss_mb"] for run in runs),
            "runs": runs, "token_ids": cases[0]["token_ids"]}


def ratios(runs: list[dict]) -> list[dict]:
    """cascade / transformers per context: rates per round (side by side), then their median;
    peak RSS as the ratio of the cases' peaks (above 1: cascade is faster or, for RSS, uses more)."""
    by_key = {(run["impl"], run["context"]): run for run in runs}
    out = []
    for context in sorted({run["context"] for run in runs}):
        ours, theirs = by_key[("cascade", context)], by_key[("transformers", context)]
        per_round = {key: [a[key] / b[key] for a, b in zip(ours["runs"], theirs["runs"], strict=True)]
                     for key in RATES}
        out.append({"context": context, **{key: statistics.median(per_round[key]) for key in RATES},
                    "peak_rss_mb": ours["peak_rss_mb"] / theirs["peak_rss_mb"], "per_round": per_round,
                    "same_greedy_prefix_tokens": common_prefix(ours["token_ids"], theirs["token_ids"])})
    return out


def common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def machine() -> dict:
    import transformers

    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor())
    return {"cpu": cpu, "cpu_count": os.cpu_count(), "threads": torch.get_num_threads(),
            "torch": torch.__version__, "transformers": transformers.__version__,
            "python": platform.python_version()}


def table(runs: list[dict], ratio_rows: list[dict]) -> str:
    lines = ["| context | implementation | decode tok/s | prefill tok/s | peak RSS (MB) |",
             "|---:|---|---:|---:|---:|"]
    for ratio in ratio_rows:
        for run in (r for r in runs if r["context"] == ratio["context"]):
            lines.append(f"| {run['context']} | {run['impl']} | {run['decode_tokens_per_s']:.1f} | "
                         f"{run['prefill_tokens_per_s']:.1f} | {run['peak_rss_mb']:.0f} |")
        lines.append(f"| {ratio['context']} | **cascade / transformers** | "
                     f"**{ratio['decode_tokens_per_s']:.2f}x** | **{ratio['prefill_tokens_per_s']:.2f}x** | "
                     f"{ratio['peak_rss_mb']:.2f}x |")
    return "\n".join(lines)


def drive(args: argparse.Namespace) -> None:
    cases = [(impl, context) for context in args.contexts for impl in IMPLS]
    rounds = [run_round(args, cases, index) for index in range(args.repeats)]
    runs = [summarize(args, impl, context, [measured[(impl, context)] for measured in rounds])
            for impl, context in cases]
    ratio_rows = ratios(runs)
    settings = {key: getattr(args, key) for key in ("document", "contexts", "new_tokens", "repeats", "dtype")}
    settings["order"] = "each round runs every case once, in its own process; odd rounds in reverse"
    report = {"machine": machine(), "settings": settings, "runs": runs, "ratios": ratio_rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(report, indent=2) + "\n")
    print(table(runs, ratio_rows))
    log(f"wrote {args.out}")


def log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        if args.case:
            print(json.dumps(run_case(args)))
        else:
            drive(args)
    except CascadeError as exc:
        log(f"error: {exc}")
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
