"""Greedy acceptance of each cache policy as the self-speculating stage of the target.

For each prompt length and budget (a share of the prompt), the `self-spec` preset runs with its
proposing stage's cache replaced by each policy, and the full-cache target verifies; the figures
are the share of proposed tokens the target accepted, the per-token acceptance estimated from the
rounds (``acceptance_mle``) and the mean accepted run per round, with gamma fixed unless
``--schedule`` says otherwise. The published ordering at equal budget is oracle top-k >
retrieval > H2O > StreamingLLM.

    python scripts/acceptance.py [--contexts 8000 16000] [--budgets 0.01 0.03 0.05 0.1]
        [--policies topk_oracle retrieval h2o streaming] [--document lcet10] [--new-tokens 128]
        [--tree NODES [--tree-ranks P0 P1 ...] [--tree-dynamic]]

With ``--tree N`` the proposing stage proposes token trees of N nodes (``--tree-ranks`` shapes
them; ``--tree 6 --tree-ranks 1`` is the chain of 6 run as a tree, which measures how often the
verifier's token is the proposer's r-th most likely one: each row's ``rank_acceptance``);
``--tree-dynamic`` fills each level by the proposer's path probabilities instead).

A policy may carry settings of its config after a colon, e.g. ``retrieval:refresh.every=16`` or
``retrieval:refresh.on_drop=0.6,chunk_size=16`` (values are YAML); the row's policy is that text.

The report goes to a new run directory under ``$CASCADE_HOME/runs/acceptance/`` with a manifest
(command, commit, machine), or to ``--out FILE`` with ``<FILE stem>.manifest.json`` beside it. Naming
an earlier run's report as ``--out`` keeps the rows it already holds (same document, gamma,
schedule, new tokens and dtype) and measures only the missing ones, so an interrupted sweep
continues; ``--fresh`` measures every cell again and replaces them (after a code change, kept rows
would describe the code that measured them).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from cache.config import budget_for
from cascade.checkpoint import yarn_scaling
from cascade.data import DOCUMENT_NAMES, document_ids
from cascade.errors import CascadeError, entry_point
from cascade.home import prompt_cache_dir, prompt_cache_option
from cascade.llm import LLM
from cascade.models import default_model
from cascade.runs import run_files
from cascade.schedule import SCHEDULES
from configs import load_config
from configs.loading import policy_at_budget, policy_option


def measure(args, target: Path, prompt: list[int], policy: str, budget: int) -> dict:
    settings = {
        "dtype": args.dtype,
        "max_new_tokens": args.new_tokens,
        "stages.0.gamma": args.gamma,
        "stages.0.schedule": args.schedule,
        "stages.0.cache": policy_at_budget(policy, budget),
        "prompt_cache.dir": args.prompt_cache,
    }
    if args.tree:
        ranks = {"rank_acceptance": args.tree_ranks} if args.tree_ranks else {}
        settings["stages.0.tree"] = {"nodes": args.tree, "dynamic": args.tree_dynamic, **ranks}
    if scaling := yarn_scaling(target, len(prompt) + args.new_tokens):
        settings["target.rope_scaling"] = scaling
    _, config = load_config("self-spec", None, [], settings)
    llm = LLM.from_config(config)
    stage = llm.run(llm.prepare(prompt, max_new_tokens=args.new_tokens, ignore_eos=True)).stats["stages"][0]
    return {"acceptance": stage["acceptance_rate"]} | {
        key: stage[key]
        for key in (
            "acceptance_mle",
            "mean_accepted_run",
            "proposed",
            "accepted",
            "rounds",
            "tree_nodes",
            "rank_acceptance",
            "choice_ranks",
        )
    }


def finished_rows(out: Path, args: argparse.Namespace) -> list[dict]:
    """Rows an earlier run with the same document, gamma, schedule, length and dtype wrote to
    ``out``; a file measured with other settings, or not this script's report, is not overwritten."""
    if args.fresh or not out.exists():
        return []
    earlier = earlier_report(out)
    same = ("document", "gamma", "schedule", "new_tokens", "dtype", "tree", "tree_ranks", "tree_dynamic")
    differ = [
        f"{key}: {earlier['settings'].get(key)}" for key in same if earlier["settings"].get(key) != getattr(args, key)
    ]
    if differ:
        raise CascadeError(f"{out} holds rows measured with other settings ({', '.join(differ)}); give another --out")
    return earlier["rows"]


def earlier_report(out: Path) -> dict:
    """The report an earlier run wrote to ``out``: its settings and rows."""
    try:
        report = json.loads(out.read_text())
    except (OSError, ValueError) as exc:
        raise CascadeError(
            f"cannot read {out} to continue its rows ({exc}); give another --out, or move the file away to start over"
        ) from None
    if not (
        isinstance(report, dict) and isinstance(report.get("settings"), dict) and isinstance(report.get("rows"), list)
    ):
        raise CascadeError(
            f"{out} is not a report of this script (settings and rows); give another --out, or "
            "move the file away to start over"
        )
    return report


def tables(rows: list[dict]) -> str:
    """Markdown, one table per context: a row per policy, a column per budget, acceptance (accepted
    of proposed) in each cell."""
    out = []
    for context in sorted({row["context"] for row in rows}):
        here = [row for row in rows if row["context"] == context]
        budgets = sorted({(row["budget_fraction"], row["budget"]) for row in here})
        cells = {(row["policy"], row["budget_fraction"]): row for row in here}
        out += [
            f"{context} tokens:",
            "",
            "| policy | " + " | ".join(f"{fraction:.0%} ({budget} tokens)" for fraction, budget in budgets) + " |",
            "|---|" + "---:|" * len(budgets),
        ]
        for policy in dict.fromkeys(row["policy"] for row in here):
            row_cells = [cells.get((policy, fraction)) for fraction, _ in budgets]
            out.append(
                f"| `{policy}` | "
                + " | ".join(
                    f"{cell['acceptance']:.3f} ({cell['accepted']} of {cell['proposed']})" if cell else ""
                    for cell in row_cells
                )
                + " |"
            )
        out.append("")
    return "\n".join(out)


RANGES = {"gamma": (1, 64), "new_tokens": (1, 1_000_000), "tree": (0, 63)}
"""Each option's allowed values, as the config allows them (configs/schema.py); --tree 0: no trees."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python scripts/acceptance.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8000, 16000])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.01, 0.03, 0.05, 0.10])
    parser.add_argument(
        "--policies", nargs="+", type=policy_option, default=["topk_oracle", "retrieval", "h2o", "streaming"]
    )
    parser.add_argument("--gamma", type=int, default=6)
    parser.add_argument(
        "--schedule",
        choices=sorted(SCHEDULES),
        default="fixed",
        help="the proposing stage's schedule (default: %(default)s, gamma every round; the "
        "cost model may stop proposing after a few bad rounds, leaving a cell few proposals)",
    )
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--tree",
        type=int,
        default=0,
        metavar="NODES",
        help="propose token trees of this many nodes (default: 0, one continuation of gamma)",
    )
    parser.add_argument(
        "--tree-ranks", type=float, nargs="+", metavar="P", help="the trees' rank_acceptance (default: the config's)"
    )
    parser.add_argument(
        "--tree-dynamic",
        action="store_true",
        help="fill each level of the trees by the proposer's path probabilities (tree.dynamic)",
    )
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--document", choices=DOCUMENT_NAMES, default="lcet10")
    parser.add_argument(
        "--out",
        type=Path,
        help="report path, continued if it holds an earlier run's rows "
        "(default: acceptance.json in a new run directory under $CASCADE_HOME/runs/acceptance/)",
    )
    parser.add_argument("--fresh", action="store_true", help="measure every cell again, replacing --out's rows")
    parser.add_argument(
        "--prompt-cache",
        type=prompt_cache_option,
        default=str(prompt_cache_dir()),
        help="where prefilled prompts are stored and reused (default: %(default)s); 'none'",
    )
    args = parser.parse_args(argv)
    for option, (least, most) in RANGES.items():
        value = getattr(args, option)
        if not least <= value <= most:
            parser.error(f"--{option.replace('_', '-')} must be from {least} to {most}; got {value}")
    if min(args.contexts) < 1:
        parser.error(f"--contexts are prompt lengths in tokens, each >= 1; got {args.contexts}")
    if not all(0 < fraction <= 1 for fraction in args.budgets):
        parser.error(f"--budgets are shares of the prompt in (0, 1]; got {args.budgets}")
    return args


@entry_point
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    rows = sweep(args)
    print(tables(rows))
    return 0


def sweep(args: argparse.Namespace) -> list[dict]:
    """Measure every (context, budget, policy) cell the report lacks, rewriting it after each -> all its rows."""
    rows = finished_rows(args.out, args) if args.out else []
    files = run_files("acceptance", args.out, "acceptance.json")
    done = {(row["context"], row["budget_fraction"], row["policy"]) for row in rows}
    target = default_model("target")
    for context in args.contexts:
        prompt = document_ids(target, args.document, context)
        for fraction in args.budgets:
            budget = budget_for(fraction, context)
            for policy in args.policies:
                if (context, fraction, policy) in done:
                    continue
                started = time.perf_counter()
                row = {
                    "context": context,
                    "budget_fraction": fraction,
                    "budget": budget,
                    "policy": policy,
                    **measure(args, target, prompt, policy, budget),
                }
                rows.append(row)
                print(
                    f"{context:6d} {policy:12} budget {fraction:4.0%} ({budget:5d}): acceptance "
                    f"{row['acceptance']:.3f} (per token {row['acceptance_mle']:.3f}), "
                    f"{row['mean_accepted_run']:.2f} per round of {args.gamma} "
                    f"({time.perf_counter() - started:.0f} s)",
                    flush=True,
                )
                settings = vars(args) | {"out": str(files.report)}
                files.write({"settings": settings, "rows": rows}, settings)
    return rows


if __name__ == "__main__":
    sys.exit(main())
