"""Top-1 agreement of the target under each cache policy with the full-cache target, by budget.

The full-cache target generates ``--new-tokens`` greedy tokens after the first N tokens of a long
document. Each policy then reads the same tokens (teacher forcing) and, after each one, predicts
the next; the scores are the fraction of predictions equal to the full target's and the mean
KL divergence of its next-token distribution from the full target's. Retrieval and the
top-k oracle read the prompt from the full cache (as in TriForce); the other policies process the
prompt themselves in one pass, then keep what their policy keeps. Budgets are fractions of the prompt.
The report goes to a new run directory under ``$CASCADE_HOME/runs/agreement/`` (or ``--out``) with a
manifest (command, commit, machine), rewritten after each row.

    python scripts/agreement.py [--contexts 7936 16000] [--budgets 0.01 0.03 0.05 0.1]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch

from cache import POLICIES, build_policy
from cache.config import budget_for
from cache.full import FullCache
from cascade.checkpoint import load_checkpoint, yarn_scaling
from cascade.data import document_text
from cascade.logs import show_logs
from cascade.models import default_model
from cascade.runs import run_files
from configs.loading import policy_at_budget, policy_option


def reference_run(model, prompt: torch.Tensor, new_tokens: int) -> tuple[FullCache, list[int], torch.Tensor]:
    """Full-cache greedy generation: the cache as it was after the prompt, the tokens, and the
    log-probabilities [new_tokens - 1, V] of the token after each but the last."""
    full = FullCache(model.cache_layout(prompt.numel() + new_tokens))
    logits = model(prompt[None], full, 1)[0, -1]
    full.commit(full.length)
    tokens, log_probs = [], []
    for _ in range(new_tokens):
        tokens.append(int(logits.argmax()))
        logits = model(torch.tensor([[tokens[-1]]]), full, 1)[0, -1]
        log_probs.append(logits.float().log_softmax(-1))
    full.rollback(prompt.numel())
    return full, tokens, torch.stack(log_probs[:-1])


def agreement(
    model, policy: str, budget: int, prompt: torch.Tensor, full: FullCache, tokens: list[int], reference: torch.Tensor
) -> tuple[float, float]:
    """Top-1 agreement with the full cache's next tokens, and the mean KL(full || policy) per token."""
    layout = model.cache_layout(prompt.numel() + len(tokens))
    settings = policy_at_budget(policy, budget)
    entry = POLICIES[settings["kind"]]
    cache = build_policy(entry.config(**settings), layout, full if entry.policy.reads_source else None)
    if not entry.policy.reads_source:  # processes the prompt itself, in one pass
        model(prompt[None], cache, 1)
        cache.commit(cache.length)
    log_probs = []
    for current in tokens[:-1]:
        log_probs.append(model(torch.tensor([[current]]), cache, 1)[0, -1].float().log_softmax(-1))
        cache.commit(cache.length)
    predicted = torch.stack(log_probs)  # [N - 1, V]
    matches = predicted.argmax(-1) == torch.tensor(tokens[1:])
    divergence = (reference.exp() * (reference - predicted)).sum(-1)  # [N - 1]
    return float(matches.float().mean()), float(divergence.mean())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[7936, 16000])
    parser.add_argument("--budgets", type=float, nargs="+", default=[0.01, 0.03, 0.05, 0.10])
    parser.add_argument(
        "--policies",
        nargs="+",
        type=policy_option,
        default=["topk_oracle", "retrieval", "h2o", "streaming"],
        help="cache policies compared with the full cache (each at every budget): a kind, "
        "or kind:key=value,... (e.g. retrieval:scoring=attention,refresh.every=1)",
    )
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--document", default="plrabn12")
    parser.add_argument(
        "--out",
        type=Path,
        help="report path (default: agreement.json in a new run directory "
        "under $CASCADE_HOME/runs/agreement/); a manifest is written beside it",
    )
    args = parser.parse_args()
    show_logs()
    files = run_files("agreement", args.out, "agreement.json")
    text = document_text(args.document)
    rows = []
    for context in args.contexts:
        path = default_model("target")
        scaling = yarn_scaling(path, context + args.new_tokens)
        target = load_checkpoint(path, torch.bfloat16, torch.device("cpu"), scaling)
        prompt = torch.tensor(target.tokenizer.encode(text)[:context])
        started = time.perf_counter()
        full, tokens, reference = reference_run(target.model, prompt, args.new_tokens)
        print(f"context {context}: reference in {time.perf_counter() - started:.0f} s", flush=True)
        for fraction in args.budgets:
            budget = budget_for(fraction, context)
            for policy in args.policies:
                started = time.perf_counter()
                score, divergence = agreement(target.model, policy, budget, prompt, full, tokens, reference)
                rows.append(
                    {
                        "context": context,
                        "budget_fraction": fraction,
                        "budget": budget,
                        "policy": policy,
                        "top1_agreement": score,
                        "kl_from_full": divergence,
                        "rope_scaling": scaling,
                    }
                )
                print(
                    f"  {policy:12} budget {fraction:4.0%} ({budget:5d} tokens): top-1 agreement "
                    f"{score:.3f}, KL {divergence:.4f} ({time.perf_counter() - started:.0f} s)",
                    flush=True,
                )
                files.write({"document": args.document, "new_tokens": args.new_tokens, "rows": rows}, vars(args))
    print(f"wrote {files.report} (manifest: {files.manifest})")


if __name__ == "__main__":
    main()
