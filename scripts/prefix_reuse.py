"""Questions about one long document, with and without prefix reuse: time to first token per question.

The prompt of each question is the document (its first ``--context`` tokens), then the question.
``cascade.LLM`` answers them in order twice, greedy: once storing and reusing prefilled prompts (a
fresh prompt cache: the first question prefills the document, the others load its whole prefill
passes and prefill only what follows), once prefilling every prompt whole. The report has each
question's time to first token, decode speed and reused tokens, the totals, and whether both runs
generated the same tokens (they must: a reused prefix is bitwise a cold prefill).

    python scripts/prefix_reuse.py [--document plrabn12] [--context 16000] [--new-tokens 64]
        [--preset self-spec] [--questions 5] [--target DIR] [--set KEY=VALUE ...]

The report goes to a new run directory under ``$CASCADE_HOME/runs/prefix_reuse/`` with a manifest,
or to ``--out FILE``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from cascade.checkpoint import checkpoint_option, yarn_scaling
from cascade.data import DOCUMENT_NAMES, document_ids
from cascade.errors import CascadeError, entry_point
from cascade.llm import LLM
from cascade.models import default_model
from cascade.runs import run_files
from configs import load_config

SETTINGS = ("document", "context", "questions", "new_tokens", "preset", "dtype", "set")
QUESTIONS = [
    "\n\nIn one sentence, what is the text above about?",
    "\n\nWho are the main people or parts in the text above?",
    "\n\nWhat happens at the end of the text above?",
    "\n\nWhat is the most surprising detail in the text above?",
    "\n\nWrite a short title for the text above.",
    "\n\nWhat would a reader ask the author of the text above?",
    "\n\nList three words that describe the text above.",
    "\n\nWhat comes before the text above, most likely?",
]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--document", default="plrabn12", choices=DOCUMENT_NAMES)
    parser.add_argument("--context", type=int, default=16000, help="document tokens before each question")
    parser.add_argument("--questions", type=int, default=5, choices=range(2, len(QUESTIONS) + 1), metavar="2-8")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--preset", default="self-spec")
    parser.add_argument("--target", type=checkpoint_option, help="target checkpoint (default: SmolLM2)")
    parser.add_argument("--draft", type=checkpoint_option, help="draft checkpoint (default: the target's)")
    parser.add_argument("--dtype", default="auto", choices=["auto", "bfloat16", "float32"])
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    parser.add_argument("--out", type=Path, help="write the report here (default: a new run directory)")
    args = parser.parse_args(argv)
    if args.context < 16 or args.new_tokens < 1:
        raise CascadeError("--context must be at least 16 and --new-tokens at least 1")
    return args


def build_llm(args: argparse.Namespace, target: Path, store: str | None) -> LLM:
    """The preset on ``target``, storing prompts in ``store`` (None: prefilling each whole)."""
    settings = {"dtype": args.dtype, "target.path": str(target), "prompt_cache.dir": store}
    if args.draft:
        settings["draft.path"] = str(args.draft)
    if scaling := yarn_scaling(target, args.context + 64 + args.new_tokens):
        settings["target.rope_scaling"] = scaling
    name, config = load_config(args.preset, None, args.set, settings)
    return LLM.from_config(config, name)


def answer(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[dict]:
    """Each prompt's answer, in order: time to first token, decode speed, reused tokens, tokens."""
    rows = []
    for prompt in prompts:
        completion = llm.run(llm.prepare(prompt, max_new_tokens=new_tokens, ignore_eos=True))
        stats = completion.stats
        rows.append(
            {
                "prompt_tokens": len(prompt),
                "ttft_s": stats["prefill_s"],
                "decode_tokens_per_s": stats["tokens_per_s"],
                "total_s": stats["prefill_s"] + stats["decode_s"],
                "reused_tokens": stats["stages"][-1]["prefill_reused"],
                "token_ids": completion.token_ids,
            }
        )
        print(f"  {len(rows)}: ttft {stats['prefill_s']:.2f} s, reused {rows[-1]['reused_tokens']}", file=sys.stderr)
    return rows


def summary(rows: list[dict]) -> dict:
    later = [row["ttft_s"] for row in rows[1:]]
    return {
        "ttft_first_s": rows[0]["ttft_s"],
        "ttft_later_median_s": statistics.median(later),
        "ttft_later_over_first": max(later) / rows[0]["ttft_s"],
        "total_s": sum(row["total_s"] for row in rows),
    }


@entry_point
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    files = run_files("prefix_reuse", args.out, "prefix_reuse.json")
    target = args.target or default_model("target")
    document = document_ids(target, args.document, args.context)
    cold = build_llm(args, target, None)
    prompts = [document + cold.tokenizer.encode(question) for question in QUESTIONS[: args.questions]]
    print("prefilling every prompt whole:", file=sys.stderr)
    cold_rows = answer(cold, prompts, args.new_tokens)
    del cold
    with tempfile.TemporaryDirectory(prefix="cascade-prefix-reuse-") as store:
        print("reusing the stored prefix:", file=sys.stderr)
        reuse_rows = answer(build_llm(args, target, store), prompts, args.new_tokens)
    report = {
        "settings": {
            key: getattr(args, key)
            for key in ("document", "context", "questions", "new_tokens", "preset", "dtype", "set")
        },
        "with_reuse": {"questions": reuse_rows, **summary(reuse_rows)},
        "without_reuse": {"questions": cold_rows, **summary(cold_rows)},
        "same_tokens": [a["token_ids"] == b["token_ids"] for a, b in zip(reuse_rows, cold_rows, strict=True)],
    }
    files.write(report, vars(args))
    with_reuse, without = report["with_reuse"], report["without_reuse"]
    print(
        f"time to first token: question 1 {with_reuse['ttft_first_s']:.2f} s, questions 2-{args.questions} "
        f"at most {with_reuse['ttft_later_over_first']:.1%} of it (median {with_reuse['ttft_later_median_s']:.2f} s; "
        f"without reuse {without['ttft_later_median_s']:.2f} s); total {with_reuse['total_s']:.1f} s with reuse, "
        f"{without['total_s']:.1f} s without; same tokens: {all(report['same_tokens'])}"
    )
    print(f"wrote {files.report} (manifest: {files.manifest})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
