"""How well a draft serves the target on text it never trained on: agreement and cascade acceptance.

- Greedy top-1 agreement (``cascade.draft.agreement``): teacher forcing on held-out documents at each
  context; the draft reads through the ``triforce`` preset's StreamingLLM cache, the target reads all.
- Acceptance as tier 0 of the ``triforce`` preset, generating ``--new-tokens`` after the first N tokens
  of ``--document`` at temperature 0 and 0.6 (top-p 1): the share of proposed tokens accepted, and
  the per-token acceptance (maximum likelihood over the accepted runs; a proposal after a rejection
  is never judged, so the share of proposals is lower). Below the retrieval budget the optional
  retrieval stage is dropped, so there the draft proposes straight to the full-cache target.

Writes JSON to a new run directory under ``$CASCADE_HOME/runs/evaluate_draft/`` (or ``--out``) with a
manifest (command, commit, machine) and, with ``--card``, stores the figures and a small fixed sample's
agreement (the test's reference) in the draft's ``card.json``.

    python scripts/evaluate_draft.py [--draft DIR] [--contexts 2048 16384] [--card]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from cascade.checkpoint import checkpoint_option, load_model, yarn_scaling
from cascade.data import document_ids
from cascade.draft.agreement import greedy_agreement
from cascade.draft.teacher import HELD_OUT
from cascade.errors import CascadeError
from cascade.llm import LLM
from cascade.logs import show_logs
from cascade.models import default_model
from cascade.runs import run_files
from configs import load_config

SAMPLE = {"document": "lcet10", "tokens": 768, "evaluated": 256, "dtype": "float32"}
"""The card's fixed sample: small enough for a unit test to recompute."""


def agreement(target: Path, draft: Path, document: str, tokens: int, evaluated: int, dtype: torch.dtype) -> float:
    cpu = torch.device("cpu")
    target_model = load_model(target, dtype, cpu, yarn_scaling(target, tokens))
    draft_model = load_model(draft, dtype, cpu)
    return greedy_agreement(target_model, draft_model, torch.tensor(document_ids(target, document, tokens)), evaluated)


def triforce_acceptance(target: Path, draft: Path, prompt: torch.Tensor, new_tokens: int, temperature: float) -> dict:
    settings = {
        "max_new_tokens": new_tokens,
        "sampling.temperature": temperature,
        "sampling.top_p": 1.0,
        "seed": 0,
        "target.path": str(target),
        "draft.path": str(draft),
    }
    if scaling := yarn_scaling(target, prompt.numel() + new_tokens):
        settings["target.rope_scaling"] = scaling
    _, config = load_config("triforce", None, [], settings)
    llm = LLM.from_config(config)
    completion = llm.run(llm.prepare(prompt.tolist(), max_new_tokens=new_tokens, ignore_eos=True))
    tier0, verifier = completion.stats["stages"][:2]
    return {
        "acceptance": tier0["acceptance_rate"],
        "acceptance_per_token": tier0["acceptance_mle"],
        "mean_accepted_run": tier0["mean_accepted_run"],
        "gamma": tier0["mean_gamma"],
        "proposed": tier0["proposed"],
        "verified_by": verifier["name"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--target", type=checkpoint_option, help="name or directory (default: the provisioned SmolLM2)")
    parser.add_argument("--draft", type=checkpoint_option, help="name or directory (default: the provisioned draft)")
    parser.add_argument("--contexts", type=int, nargs="+", default=[2048, 16384])
    parser.add_argument("--evaluated", type=int, default=256, help="positions scored per agreement run")
    parser.add_argument("--document", default="lcet10", help="prompt of the acceptance runs (held out)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument(
        "--out",
        type=Path,
        help="report path (default: draft_evaluation.json in a new run "
        "directory under $CASCADE_HOME/runs/evaluate_draft/); a manifest is written beside it",
    )
    parser.add_argument("--card", action="store_true", help="also store the figures in the draft's card.json")
    args = parser.parse_args()
    show_logs()
    files = run_files("evaluate_draft", args.out, "draft_evaluation.json")
    target = args.target or default_model("target")
    draft = args.draft or default_model("draft")

    results = {"agreement": [], "acceptance": []}
    for context in args.contexts:
        for document in HELD_OUT:
            try:
                value = agreement(target, draft, document, context, args.evaluated, torch.bfloat16)
            except CascadeError as short:
                print(short, file=sys.stderr)
                continue
            results["agreement"].append({"document": document, "context": context, "agreement": value})
            print(f"agreement {document} @ {context}: {value:.3f}", flush=True)
        prompt = torch.tensor(document_ids(target, args.document, context))
        for temperature in (0.0, 0.6):
            row = {
                "document": args.document,
                "context": context,
                "temperature": temperature,
                **triforce_acceptance(target, draft, prompt, args.new_tokens, temperature),
            }
            results["acceptance"].append(row)
            print(
                f"triforce tier-0 acceptance @ {context}, T={temperature}: {row['acceptance']:.3f} of proposals, "
                f"{row['acceptance_per_token']:.3f} per token (verified by {row['verified_by']})",
                flush=True,
            )
    sample = {
        **SAMPLE,
        "agreement": agreement(target, draft, SAMPLE["document"], SAMPLE["tokens"], SAMPLE["evaluated"], torch.float32),
    }
    results["sample"] = sample
    files.write(results, vars(args) | {"target": target, "draft": draft})
    print(f"wrote {files.report} (manifest: {files.manifest})")
    if args.card:
        card_path = draft / "card.json"
        card = json.loads(card_path.read_text())
        card["measured"] = results
        card_path.write_text(json.dumps(card, indent=2) + "\n")
        print(f"updated {card_path}")


if __name__ == "__main__":
    main()
