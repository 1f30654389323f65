"""Decode and prefill speed of cascade's autoregressive path vs transformers' generate(), side by side.

Both run the same checkpoint in the same dtype, greedy, on the first N tokens of a long document.
Every (implementation, context) case runs in its own subprocess so that its peak RSS is its own.

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
    parser.add_argument("--repeats", type=int, default=3, help="timed runs per case (medians reported)")
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


def run_cascade(args: argparse.Namespace, path: Path, prompt: torch.Tensor) -> tuple[list[dict], list[int]]:
    from cascade.pipeline import StopRule
    from cascade.runtime import build_runtime
    from configs import load_config

    settings = {"dtype": args.dtype, "max_new_tokens": args.new_tokens, "target.path": str(path)}
    _, config = load_config(preset="autoregressive", settings=settings)
    runtime = build_runtime(config, log=log)
    stop = StopRule(frozenset(), args.new_tokens)  # no EOS: exactly N tokens, like min_new_tokens
    runs, tokens = [], []
    for _ in range(1 + args.repeats):  # the first run is the warm-up
        pipeline = runtime.pipeline_for(prompt.numel(), args.new_tokens)
        result = pipeline.generate(prompt, stop)
        stats, tokens = result.stats, result.token_ids
        runs.append({"prefill_s": stats.prefill_s, "decode_s": stats.decode_s,
                     "prefill_tokens_per_s": prompt.numel() / stats.prefill_s,
                     "decode_tokens_per_s": stats.tokens_per_s})
    return runs[1:], tokens


def run_transformers(
    args: argparse.Namespace, path: Path, prompt: torch.Tensor
) -> tuple[list[dict], list[int]]:
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

    timed(n)  # warm-up
    runs, tokens = [], []
    for _ in range(args.repeats):
        (t_1, _), (t_n, tokens) = timed(1), timed(n)
        runs.append({"t_1_s": t_1, "t_n_s": t_n, "prefill_tokens_per_s": prompt.numel() / t_1,
                     "decode_tokens_per_s": (n - 1) / (t_n - t_1)})
    return runs, tokens


def run_case(args: argparse.Namespace) -> dict:
    impl, context = args.case.split(":")
    path = model_dir(args)
    prompt = prompt_ids(path, args.document, int(context))
    runs, tokens = (run_cascade if impl == "cascade" else run_transformers)(args, path, prompt)
    return {
        "impl": impl, "context": int(context), "new_tokens": args.new_tokens, "dtype": args.dtype,
        "decode_tokens_per_s": statistics.median(r["decode_tokens_per_s"] for r in runs),
        "prefill_tokens_per_s": statistics.median(r["prefill_tokens_per_s"] for r in runs),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "runs": runs, "token_ids": tokens,
    }


# ---- the driver: one subprocess per case, then the table and the JSON --------------------------


def spawn_case(args: argparse.Namespace, impl: str, context: int) -> dict:
    command = [sys.executable, __file__, "--case", f"{impl}:{context}", "--new-tokens", str(args.new_tokens),
               "--repeats", str(args.repeats), "--dtype", args.dtype, "--document", args.document,
               "--contexts", str(context), *(["--target", args.target] if args.target else [])]
    started = time.perf_counter()
    result = subprocess.run(command, stdout=subprocess.PIPE, text=True)
    if result.returncode != 0:
        raise CascadeError(f"the {impl} case at context {context} failed (exit {result.returncode})")
    case = json.loads(result.stdout.strip().splitlines()[-1])
    log(f"[{impl:12} ctx {context:>5}] decode {case['decode_tokens_per_s']:7.1f} tok/s, prefill "
        f"{case['prefill_tokens_per_s']:7.1f} tok/s, peak RSS {case['peak_rss_mb']:6.0f} MB "
        f"({time.perf_counter() - started:.0f} s)")
    return case


def ratios(runs: list[dict]) -> list[dict]:
    """cascade / transformers per context (above 1: cascade is faster or, for RSS, uses more)."""
    by_key = {(run["impl"], run["context"]): run for run in runs}
    out = []
    for context in sorted({run["context"] for run in runs}):
        ours, theirs = by_key[("cascade", context)], by_key[("transformers", context)]
        same = next((i for i, (a, b) in enumerate(zip(ours["token_ids"], theirs["token_ids"])) if a != b),
                    min(len(ours["token_ids"]), len(theirs["token_ids"])))
        out.append({"context": context,
                    **{key: ours[key] / theirs[key] for key in
                       ("decode_tokens_per_s", "prefill_tokens_per_s", "peak_rss_mb")},
                    "same_greedy_prefix_tokens": same})
    return out


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
    runs = [spawn_case(args, impl, context) for context in args.contexts for impl in IMPLS]
    ratio_rows = ratios(runs)
    settings = {key: getattr(args, key) for key in ("document", "contexts", "new_tokens", "repeats", "dtype")}
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
