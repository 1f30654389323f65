"""Top-1 agreement of the target under each cache policy with the full-cache target, by budget.

The full-cache target generates ``--new-tokens`` greedy tokens after the first N tokens of a long
document. Each policy then reads the same tokens (teacher forcing) and, after each one, predicts
the next; the score is the fraction of predictions equal to the full target's. Retrieval reads the
prompt from the full cache (as in TriForce); the other policies process the prompt themselves in
one pass, then keep what their policy keeps. Budgets are fractions of the prompt.

    python scripts/agreement.py [--contexts 7936 16000] [--budgets 0.01 0.03 0.05 0.1]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from cache import POLICIES, build_policy
from cache.config import budget_for
from cache.full import FullCache
from cascade.checkpoint import load_checkpoint, yarn_scaling
from cascade.data import document_text
from cascade.models import default_model


def reference_run(model, prompt: torch.Tensor, new_tokens: int) -> tuple[FullCache, list[int]]:
    """Full-cache greedy generation; returns the cache as it was after the prompt, and the tokens."""
    full = FullCache(model.cache_layout(prompt.numel() + new_tokens))
    logits = model(prompt[None], full, 1)[0, -1]
    full.commit(full.length)
    tokens = []
    for _ in range(new_tokens):
        tokens.append(int(logits.argmax()))
        logits = model(torch.tensor([[tokens[-1]]]), full, 1)[0, -1]
    full.rollback(prompt.numel())
    return full, tokens


def agreement(model, kind: str, budget: int, prompt: torch.Tensor, full: FullCache, tokens: list[int]) -> float:
    layout = model.cache_layout(prompt.numel() + len(tokens))
    config = POLICIES[kind].config.at_budget(budget)
    if kind == "retrieval":
        cache = build_policy(config, layout, full)
    else:
        cache = build_policy(config, layout)
        model(prompt[None], cache, 1)
        cache.commit(cache.length)
    matches = 0
    for current, following in zip(tokens, tokens[1:]):
        logits = model(torch.tensor([[current]]), cache, 1)[0, -1]
        cache.commit(cache.length)
        matches += int(logits.argmax()) == following
    return matches / (len(tokens) - 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[7936, 16000])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.01, 0.03, 0.05, 0.10])
    parser.add_argument("--policies", nargs="+", default=["topk_oracle", "retrieval", "h2o", "streaming"],
                        choices=sorted(kind for kind in POLICIES if kind != "full"),
                        help="cache policies compared with the full cache (each at every budget)")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--document", default="plrabn12")
    parser.add_argument("--out", type=Path, default=Path("results/agreement.json"))
    args = parser.parse_args()
    text = document_text(args.document)
    rows = []
    for context in args.contexts:
        path = default_model("target", print)
        scaling = yarn_scaling(path, context + args.new_tokens)
        target = load_checkpoint(path, torch.bfloat16, torch.device("cpu"), scaling)
        prompt = torch.tensor(target.tokenizer.encode(text)[:context])
        started = time.perf_counter()
        full, tokens = reference_run(target.model, prompt, args.new_tokens)
        print(f"context {context}: reference in {time.perf_counter() - started:.0f} s", flush=True)
        for fraction in args.budgets:
            budget = budget_for(fraction, context)
            for kind in args.policies:
                started = time.perf_counter()
                score = agreement(target.model, kind, budget, prompt, full, tokens)
                rows.append({"context": context, "budget_fraction": fraction, "budget": budget,
                             "policy": kind, "top1_agreement": score, "rope_scaling": scaling})
                print(f"  {kind:12} budget {fraction:4.0%} ({budget:5d} tokens): top-1 agreement "
                      f"{score:.3f} ({time.perf_counter() - started:.0f} s)", flush=True)
                args.out.parent.mkdir(parents=True, exist_ok=True)
                args.out.write_text(json.dumps({"document": args.document, "new_tokens": args.new_tokens,
                                                "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
