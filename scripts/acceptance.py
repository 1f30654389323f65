"""Greedy acceptance of each cache policy as the self-speculating stage of the target.

For each prompt length and budget (a share of the prompt), the `self-spec` preset runs with its
proposing stage's cache replaced by each policy, and the full-cache target verifies; the figure is
the share of proposed tokens the target accepted (and the mean accepted run per round). The
published ordering at equal budget is oracle top-k > retrieval > H2O > StreamingLLM.

    python scripts/acceptance.py [--contexts 8000 16000] [--budgets 0.01 0.03 0.05 0.1]
        [--policies topk_oracle retrieval h2o streaming] [--document lcet10] [--new-tokens 128]

Rerunning with the same ``--out`` keeps the rows it already holds (same document, gamma, new
tokens and dtype) and measures only the missing ones, so an interrupted sweep continues.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cache import POLICIES
from cascade.checkpoint import yarn_scaling
from cascade.data import DOCUMENTS, document_ids
from cascade.models import default_model
from cascade.runtime import build_runtime
from configs import load_config



def measure(args, target: Path, prompt: list[int], kind: str, budget: int) -> dict:
    settings = {"dtype": args.dtype, "max_new_tokens": args.new_tokens, "stages.0.gamma": args.gamma,
                "stages.0.cache": POLICIES[kind].config.at_budget(budget).model_dump()}
    if scaling := yarn_scaling(target, len(prompt) + args.new_tokens):
        settings["target.rope_scaling"] = scaling
    _, config = load_config("self-spec", None, [], settings)
    runtime = build_runtime(config, log=lambda message: print(message, file=sys.stderr))
    result = runtime.generate(prompt, args.new_tokens, stop_at_eos=False)
    stage = result.stats.stages[0]
    return {"acceptance": stage.acceptance_rate, "mean_accepted_run": stage.mean_accepted_run,
            "proposed": stage.proposed, "accepted": stage.accepted, "rounds": stage.rounds}


def finished_rows(out: Path, args: argparse.Namespace) -> list[dict]:
    """Rows an earlier run with the same document, gamma, length and dtype already wrote to ``out``."""
    if not out.exists():
        return []
    earlier = json.loads(out.read_text())
    same = ("document", "gamma", "new_tokens", "dtype")
    if any(earlier["settings"].get(key) != getattr(args, key) for key in same):
        return []
    return earlier["rows"]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python scripts/acceptance.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8000, 16000])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.01, 0.03, 0.05, 0.10])
    parser.add_argument("--policies", nargs="+", default=["topk_oracle", "retrieval", "h2o", "streaming"])
    parser.add_argument("--gamma", type=int, default=6)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--document", choices=sorted(DOCUMENTS), default="lcet10")
    parser.add_argument("--out", type=Path, default=Path("results/acceptance.json"))
    args = parser.parse_args(argv)
    rows = finished_rows(args.out, args)
    done = {(row["context"], row["budget_fraction"], row["policy"]) for row in rows}
    target = default_model("target", log=lambda message: print(message, file=sys.stderr))
    for context in args.contexts:
        prompt = document_ids(target, args.document, context)
        for fraction in args.budgets:
            budget = max(16, round(fraction * context / 8) * 8)
            for kind in args.policies:
                if (context, fraction, kind) in done:
                    continue
                started = time.perf_counter()
                row = {"context": context, "budget_fraction": fraction, "budget": budget, "policy": kind,
                       **measure(args, target, prompt, kind, budget)}
                rows.append(row)
                print(f"{context:6d} {kind:12} budget {fraction:4.0%} ({budget:5d}): acceptance "
                      f"{row['acceptance']:.3f}, {row['mean_accepted_run']:.2f} per round of {args.gamma} "
                      f"({time.perf_counter() - started:.0f} s)", flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({"settings": vars(args) | {"out": str(args.out)}, "rows": rows},
                                               indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
