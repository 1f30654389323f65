"""How often a preset's greedy output differs from autoregressive greedy output in the same dtype.

In float32 the cascade reproduces autoregressive decoding token for token (the tests check it).
In bfloat16 a verification pass over several tokens rounds differently from one-token steps, so a
near-tie between the two best tokens can flip; this measures how often, and how early, that
happens on real text: ``--prompts`` windows of ``--context`` tokens from a document, greedy. The
report goes to a new run directory under ``$CASCADE_HOME/runs/divergence/`` (or ``--out``) with a
manifest (command, commit, machine).

    python scripts/divergence.py [--presets self-spec] [--context 2048] [--prompts 8] [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from cascade.checkpoint import checkpoint_option
from cascade.data import DOCUMENT_NAMES, document_text
from cascade.llm import LLM
from cascade.logs import show_logs
from cascade.runs import run_files
from configs import load_config


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python scripts/divergence.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--presets", nargs="+", default=["self-spec"])
    parser.add_argument("--context", type=int, default=2048, help="prompt tokens")
    parser.add_argument("--prompts", type=int, default=8, help="prompts, consecutive windows of the document")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument("--document", choices=DOCUMENT_NAMES, default="lcet10")
    parser.add_argument(
        "--draft", type=checkpoint_option, help="draft checkpoint: name or directory (presets with a draft stage)"
    )
    parser.add_argument(
        "--set",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="config override for the presets (e.g. stages.0.cache.budget=512)",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="report path (default: divergence.json in a new run directory "
        "under $CASCADE_HOME/runs/divergence/); a manifest is written beside it",
    )
    return parser.parse_args(argv)


def preset_llm(preset: str, args: argparse.Namespace, overrides: list[str]) -> LLM:
    settings = {"dtype": args.dtype, "max_new_tokens": args.new_tokens}
    if args.draft:
        settings["draft.path"] = str(args.draft)
    _, config = load_config(preset, None, overrides, settings)
    return LLM.from_config(config, preset)


def greedy_tokens(llm: LLM, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    return [llm.run(llm.prepare(prompt, max_new_tokens=new_tokens, ignore_eos=True)).token_ids for prompt in prompts]


def first_difference(a: list[int], b: list[int]) -> int | None:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), None)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    show_logs()
    files = run_files("divergence", args.out, "divergence.json")
    report = {
        "settings": {
            k: getattr(args, k) for k in ("presets", "context", "prompts", "new_tokens", "dtype", "document", "set")
        },
        "presets": {},
    }
    autoregressive = preset_llm("autoregressive", args, [])
    ids = autoregressive.tokenizer.encode(document_text(args.document))
    prompts = [ids[i * args.context : (i + 1) * args.context] for i in range(args.prompts)]
    reference = greedy_tokens(autoregressive, prompts, args.new_tokens)
    del autoregressive
    for preset in args.presets:
        outputs = greedy_tokens(preset_llm(preset, args, args.set), prompts, args.new_tokens)
        firsts = [first_difference(out, ref) for out, ref in zip(outputs, reference, strict=True)]
        diverged = [f for f in firsts if f is not None]
        report["presets"][preset] = {"diverged": len(diverged), "of": len(firsts), "first_difference": firsts}
        print(
            f"{preset}: {len(diverged)} of {len(firsts)} outputs differ from autoregressive "
            f"({args.dtype}); first differing positions: {diverged or 'none'}"
        )
    files.write(report, vars(args))
    print(f"wrote {files.report} (manifest: {files.manifest})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
