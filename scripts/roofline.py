"""Each stage's step cost next to its roofline on this machine (CPU or CUDA).

Measures the memory bandwidth (reading a 1 GiB tensor) and the matmul peak (a large square
product) in the chosen dtype, then times the passes the cascade runs at each context, the memory
bandwidth measured again right before them (a VM's memory can change speed within minutes): a one-token
step under the full cache (autoregressive decoding), a one-token step under the retrieval cache
(the self-speculating stage's proposals), a (gamma + 1)-token verification pass under the full
cache, and one under the retrieval cache (the middle stage of ``triforce`` verifying the draft).
A pass's roofline is max(bytes read / bandwidth, FLOPs / matmul peak), where bytes read are the
weights once plus the KV the cache policy reports, and FLOPs are 2 per weight per token plus the
attention products. The KV is random: only the timing matters.

With ``--acceptance`` (the retrieval stage's per-token acceptance at each context, e.g. the
``acceptance_mle`` a bench run reports), it also prints the ceiling of ``self-spec``: the best
speed-up over autoregressive decoding the cost model predicts at any gamma, from the measured pass
times and from the rooflines, i.e. what faster kernels alone could reach at that acceptance. With
``--draft-shape`` and ``--draft-acceptance`` (the draft's per-token acceptance by the retrieval
stage) it also prints the ceiling of ``triforce``'s three tiers; with ``--speculative-acceptance``
(the draft's per-token acceptance by the full-cache target), that of ``speculative``'s two.

The model is the provisioned SmolLM2 or ``--target`` (a catalog name or a directory; YaRN-stretched
to the context where it needs it), or with ``--shape`` a random-weight model of a published shape,
for cost-only figures that feed the cost model (e.g. Llama-2-7B at 120K tokens on a GPU;
``--draft-shape llama-68m`` adds TriForce's draft step). On CUDA, passes of up to 16 tokens
replay as CUDA graphs unless ``--no-graphs``.

With ``--tree N`` and ``--tree-accepted`` (the tokens a tree of N nodes had accepted per round
with each ``--reselect`` scoring selecting once per round: ``scripts/acceptance.py --tree N``'s
``mean_accepted_run``) it times the verification pass over such a tree and its widest level's
proposal pass, and prints ``self-spec``'s ceiling with trees: a selecting pass at the root, a pass
per level but the last, one verification pass.

    python scripts/roofline.py [--contexts 8000 16000 32000] [--gamma 6] [--budget 4096]
        [--reselect mean_key attention sparq [--every-pass-acceptance 0.62 0.87 0.73]
        [--every-round-acceptance 0.59 0.67 0.6] [--tree 32 --tree-accepted 1.9 2.6 2.2]]
        [--roofline-of docs/results/data/roofline_h100_smollm2_cuda_matmul.json]
    python scripts/roofline.py --shape llama-2-7b --draft-shape llama-68m --contexts 120000 \
        [--acceptance 0.9 --draft-acceptance 0.7]
    python scripts/roofline.py --shape qwen2.5-coder-1.5b --draft-shape qwen2.5-coder-0.5b \
        --draft-window 4092 --contexts 1000 32000 --speculative-acceptance 0.9 0.7
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import get_args

import torch
from transformers import LlamaConfig, PreTrainedConfig, Qwen2Config

from cache import build_policy
from cache.base import TreePass
from cache.chunk_scoring import Scoring
from cache.full import FullCache
from cache.retrieval import RetrievalCacheConfig
from cache.streaming import StreamingCacheConfig
from cascade.attention import KERNELS
from cascade.checkpoint import checkpoint_option, load_checkpoint, model_spec, yarn_scaling
from cascade.costs import expected_speedup, expected_tokens
from cascade.graphs import PassGraphs, cuda_graph
from cascade.limits import matmul_peak, median_seconds, memory_bandwidth
from cascade.logs import show_logs
from cascade.model import CausalLM, PassOptions
from cascade.models import default_model
from cascade.rope import Rotary, rope_frequencies
from cascade.runs import run_files
from cascade.runtime import pass_options
from cascade.tree import TokenTree
from configs.schema import TreeConfig


def qwen25_coder(hidden: int, intermediate: int, layers: int, heads: int) -> Qwen2Config:
    """A Qwen2.5-Coder shape: 2 KV heads, the 151,936-token vocabulary, rope theta 1e6."""
    return Qwen2Config(
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=2,
        vocab_size=151936,
        rope_theta=1e6,
    )


SHAPES = {  # random-weight models in published shapes: Llama-2-7B, TriForce's 68M draft, the Qwen2.5-Coder pair
    "llama-2-7b": LlamaConfig(
        hidden_size=4096,
        intermediate_size=11008,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=32,
        vocab_size=32000,
    ),
    "llama-68m": LlamaConfig(
        hidden_size=768,
        intermediate_size=3072,
        num_hidden_layers=2,
        num_attention_heads=12,
        num_key_value_heads=12,
        vocab_size=32000,
    ),
    "qwen2.5-coder-1.5b": qwen25_coder(hidden=1536, intermediate=8960, layers=28, heads=12),
    "qwen2.5-coder-0.5b": qwen25_coder(hidden=896, intermediate=4864, layers=24, heads=14),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python scripts/roofline.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--contexts", type=int, nargs="+", default=[8000, 16000, 32000])
    parser.add_argument("--gamma", type=int, default=6, help="proposals per verification pass")
    parser.add_argument("--budget", type=int, default=4096, help="retrieval budget")
    parser.add_argument("--repeats", type=int, default=7, help="timed passes per figure (median)")
    parser.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    parser.add_argument(
        "--kernels",
        choices=["compiled", "eager"],
        default="compiled",
        help="short passes through the compiled kernels (as the runtime runs them) or eagerly",
    )
    parser.add_argument("--attention", choices=["auto", *KERNELS], default="auto")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--no-graphs", action="store_true", help="on CUDA, run every pass eagerly")
    models = parser.add_mutually_exclusive_group()
    models.add_argument("--target", type=checkpoint_option, help="name or directory (default: the provisioned SmolLM2)")
    models.add_argument("--shape", choices=list(SHAPES), help="a random-weight model of this shape, not SmolLM2")
    parser.add_argument(
        "--draft-shape",
        choices=list(SHAPES),
        help="also time this shape's draft step (streaming cache of --draft-window tokens)",
    )
    parser.add_argument("--draft-window", type=int, default=256)
    parser.add_argument(
        "--speculative-acceptance",
        type=float,
        nargs="+",
        metavar="A",
        help="with --draft-shape: the draft's per-token acceptance by the full-cache target at each "
        "context (one value, or one per context): also print speculative's speed-up ceiling there",
    )
    parser.add_argument(
        "--acceptance",
        type=float,
        nargs="+",
        metavar="A",
        help="the retrieval stage's per-token acceptance at each context (one value, or one "
        "per context): also print self-spec's speed-up ceiling there",
    )
    parser.add_argument(
        "--draft-acceptance",
        type=float,
        nargs="+",
        metavar="A",
        help="with --draft-shape and --acceptance: the draft's per-token acceptance by the "
        "retrieval stage at each context; also print triforce's speed-up ceiling there",
    )
    parser.add_argument(
        "--reselect",
        nargs="+",
        default=[],
        choices=list(get_args(Scoring)),
        metavar="SCORING",
        help="also time a proposal that re-selects the retrieval chunks first, scored each of "
        "these ways (mean_key, bound, attention, sparq), as refresh every_pass runs it",
    )
    for schedule, how in (("every-pass", "before every proposal"), ("every-round", "once per round")):
        parser.add_argument(
            f"--{schedule}-acceptance",
            type=float,
            nargs="+",
            default=[],
            metavar="A",
            help=f"with --reselect: the per-token acceptance of each of those scorings re-selecting "
            f"{how} (one per scoring, at every context): also print self-spec's ceiling so",
        )
    parser.add_argument(
        "--tree",
        type=int,
        default=0,
        metavar="NODES",
        help="with --tree-accepted: the token trees' nodes (shaped as the runtime shapes them)",
    )
    parser.add_argument(
        "--tree-ranks",
        type=float,
        nargs="+",
        default=TreeConfig().rank_acceptance,
        metavar="P",
        help="the trees' rank_acceptance (default: %(default)s)",
    )
    parser.add_argument(
        "--tree-accepted",
        type=float,
        nargs="+",
        default=[],
        metavar="RUN",
        help="with --reselect and --tree: tokens accepted per tree round with each of those scorings "
        "selecting once per round (one per scoring): also print self-spec's ceiling so",
    )
    parser.add_argument(
        "--roofline-of",
        type=Path,
        metavar="REPORT",
        help="take the rooflines' memory bandwidth and matmul peak from this earlier report (e.g. "
        "a GPU's) instead of measuring this machine's: that machine's ceilings from these bytes",
    )
    parser.add_argument(
        "--out",
        type=Path,
        help="report path (default: roofline.json in a new run directory under "
        "$CASCADE_HOME/runs/roofline/); a manifest is written beside it",
    )
    args = parser.parse_args(argv)
    for option in ("every_pass_acceptance", "every_round_acceptance", "tree_accepted"):
        values = getattr(args, option)
        if values and len(values) != len(args.reselect):
            parser.error(
                f"--{option.replace('_', '-')} takes one value per --reselect scoring "
                f"({len(args.reselect)}), got {len(values)}"
            )
    if bool(args.tree) != bool(args.tree_accepted):
        parser.error("--tree and --tree-accepted go together (the tree's nodes, and what it had accepted)")
    if args.draft_acceptance is not None and not (args.draft_shape and args.acceptance):
        parser.error(
            "--draft-acceptance needs --draft-shape (the draft's step) and --acceptance (the retrieval stage's own)"
        )
    if args.speculative_acceptance is not None and not args.draft_shape:
        parser.error("--speculative-acceptance needs --draft-shape (the draft's step)")
    for option in ("acceptance", "draft_acceptance", "speculative_acceptance"):
        setattr(args, option, per_context(parser, option, getattr(args, option), len(args.contexts)))
    return args


def per_context(
    parser: argparse.ArgumentParser, option: str, values: list[float] | None, contexts: int
) -> list[float | None]:
    """An acceptance option's values, one per context (a single value stands for every context)."""
    flag = "--" + option.replace("_", "-")
    if values is None:
        return [None] * contexts
    if len(values) not in (1, contexts):
        parser.error(f"{flag} takes one value or one per context ({contexts}), not {len(values)}")
    if not all(0.0 <= a < 1.0 for a in values):
        parser.error(f"{flag} values are probabilities in [0, 1); got {values}")
    return values * contexts if len(values) == 1 else values


def random_model(config: PreTrainedConfig, dtype: torch.dtype, device: torch.device, options: PassOptions) -> CausalLM:
    """A model of ``config``'s shape with random weights (std 0.02; norms at 1), built on ``device``:
    an output projection of its own (untied, as the provisioned checkpoints), q/k/v biases for Qwen2."""
    config.max_position_embeddings = 1 << 20  # cost only: positions past the trained range are fine
    names = ["lm_head.weight"] + (["model.layers.0.self_attn.q_proj.bias"] if config.model_type == "qwen2" else [])
    spec = model_spec(config, dict.fromkeys(names))
    rotary = Rotary(*rope_frequencies(config), device=device)
    with torch.device("meta"):
        model = CausalLM(spec, rotary, options)
    model = model.to(dtype).to_empty(device=device).eval()
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            parameter.fill_(1.0) if "norm" in name else parameter.normal_(0.0, 0.02)
    return model


def pass_figures(
    model, cache, tokens: int, args, bandwidth: float, peak: float, selects: bool = False, tree: TreePass | None = None
) -> dict:
    """Time a ``tokens``-token pass at the cache's end (rolled back after each) against its roofline;
    ``selects``: the retrieval cache re-selects its chunks at each pass, and what that reads counts;
    ``tree``: the pass's tokens are the nodes of this token tree."""
    spec = model.spec
    start = cache.length
    ids = torch.randint(0, spec.vocab_size, (1, tokens), device=model.device)
    graphed = model.device.type == "cuda" and not args.no_graphs
    forward = PassGraphs(model, cache, cuda_graph) if graphed else (lambda ids, n, tree: model(ids, cache, n, tree))

    def run() -> None:
        forward(ids, tokens, tree)
        cache.rollback(start)

    seconds = median_seconds(run, args.repeats, model.device)
    weight_bytes = model.pass_weight_bytes()
    kv_bytes = cache.read_bytes() + (cache.selection_read_bytes() if selects else 0)
    weights = weight_bytes // model.dtype.itemsize  # the weights a pass multiplies by (unquantised models)
    keys_read = kv_bytes // cache.layout.bytes_per_token
    attention_flops = 4 * spec.num_layers * spec.num_heads * spec.head_dim * keys_read * tokens
    flops = 2 * weights * tokens + attention_flops
    roofline = max((weight_bytes + kv_bytes) / bandwidth, flops / peak)
    return {
        "tokens": tokens,
        "graphed": graphed,
        "ms": seconds * 1000,
        "bytes_read": weight_bytes + kv_bytes,
        "flops": flops,
        "memory_ms": (weight_bytes + kv_bytes) / bandwidth * 1000,
        "compute_ms": flops / peak * 1000,
        "roofline_ms": roofline * 1000,
        "measured_over_roofline": seconds / roofline,
    }


def verification_cost(one: dict, wide: dict) -> tuple[Callable[[int], float], Callable[[int], float]]:
    """(measured, roofline) ms of a pass of g + 1 tokens over the cache that ``one`` (a one-token
    pass) and ``wide`` (a timed wider pass) read: measured interpolated linearly between the two (the
    cost model's line in the pass width), the roofline exact (the bytes do not change with the
    width, the FLOPs grow with it)."""
    widest = wide["tokens"] - 1
    return (
        lambda gamma: one["ms"] + (wide["ms"] - one["ms"]) * gamma / widest,
        lambda gamma: max(one["memory_ms"], one["compute_ms"] * (gamma + 1)),
    )


def best_speedup(
    acceptance: float, propose_ms: float, verify_ms: Callable[[int], float], step_ms: float, widest: int
) -> dict:
    """The gamma in 1..``widest`` the cost model expects the most of, and that speed-up."""
    speedups = {g: expected_speedup(acceptance, propose_ms, verify_ms(g), step_ms, g) for g in range(1, widest + 1)}
    gamma = max(speedups, key=speedups.get)
    return {"gamma": gamma, "speedup": speedups[gamma]}


def self_spec_ceiling(
    step: dict, proposal: dict, verification: dict, acceptance: float, selecting: dict | None = None
) -> dict:
    """The best (gamma, speed-up) of ``self-spec`` at ``acceptance`` (or of ``speculative``, with the
    draft's step as the ``proposal``), from measured pass times and from rooflines, for gammas up to
    the verification pass's width - 1; with a ``selecting`` proposal, the
    first proposal of every round is that one (chunks re-selected once per round)."""
    widest = verification["tokens"] - 1
    ceiling = {"acceptance": acceptance}
    verify_costs = verification_cost(step, verification)
    for (name, key), verify in zip((("measured", "ms"), ("roofline", "roofline_ms")), verify_costs, strict=True):
        selection = selecting[key] - proposal[key] if selecting else 0.0
        ceiling[name] = best_speedup(
            acceptance,
            proposal[key],
            lambda g, verify=verify, selection=selection: verify(g) + selection,
            step[key],
            widest,
        )
    return ceiling


def tree_ceiling(
    step: dict, proposal: dict, selecting: dict, level: dict, verification: dict, tree: TokenTree, accepted_run: float
) -> dict:
    """``self-spec``'s speed-up with token trees that had ``accepted_run`` tokens accepted per round:
    per round a ``selecting`` pass at the root, a pass per level but the last (a level of W nodes
    costs what the line through the one-token ``proposal`` and the widest ``level`` gives) and a
    ``verification`` pass over the whole tree, from measured pass times and from rooflines."""
    widths = [len(tree.level(depth)) for depth in range(1, tree.depth)]  # the levels the proposer feeds
    level_costs, verify_costs = verification_cost(proposal, level), verification_cost(step, verification)
    ceiling = {"accepted_run": accepted_run, "nodes": len(tree), "depth": tree.depth}
    for index, (name, key) in enumerate((("measured", "ms"), ("roofline", "roofline_ms"))):
        levels_ms = sum(level_costs[index](width - 1) for width in widths)
        round_ms = selecting[key] + levels_ms + verify_costs[index](len(tree))
        ceiling[name] = {"speedup": (accepted_run + 1) * step[key] / round_ms, "round_ms": round_ms}
    return ceiling


def triforce_ceiling(
    draft: dict,
    proposal: dict,
    retrieval_verification: dict,
    step: dict,
    verification: dict,
    draft_acceptance: float,
    acceptance: float,
) -> dict:
    """The best speed-up of TriForce's three tiers (a draft proposing to the retrieval stage, which
    proposes to the full cache) at per-token acceptances ``draft_acceptance`` and ``acceptance``,
    from measured pass times and from rooflines.

    The retrieval stage's cost per token it hands up is the cheapest of its own one-token proposal
    (the draft bypassed: draft gamma 0) and, per draft gamma g, g draft steps and its pass of g + 1
    tokens over the tokens such a round yields; the top tier is ``self-spec``'s model at that cost.
    """
    widest = verification["tokens"] - 1
    middle_costs, top_costs = verification_cost(proposal, retrieval_verification), verification_cost(step, verification)
    ceiling = {"draft_acceptance": draft_acceptance, "acceptance": acceptance}
    for index, (name, key) in enumerate((("measured", "ms"), ("roofline", "roofline_ms"))):
        per_token = {
            g: (g * draft[key] + middle_costs[index](g)) / expected_tokens(draft_acceptance, g)
            for g in range(1, widest + 1)
        }
        per_token[0] = proposal[key]
        draft_gamma = min(per_token, key=per_token.get)
        top = best_speedup(acceptance, per_token[draft_gamma], top_costs[index], step[key], widest)
        ceiling[name] = {"draft_gamma": draft_gamma, **top}
    return ceiling


def load_target(args, path: Path | None, context: int) -> tuple[CausalLM, dict | None]:
    """The model whose passes are timed at ``context``, and the rope scaling it runs with."""
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    options = pass_options(args.kernels, args.attention, device, dtype)
    if args.shape:
        return random_model(SHAPES[args.shape], dtype, device, options), None
    scaling = yarn_scaling(path, context + 64)
    return load_checkpoint(path, dtype, device, scaling, options).model, scaling


def filled_cache(cache, tokens: int):
    """``cache`` after ``tokens`` more random committed tokens (written directly: no forward pass)."""
    cache.allocate(tokens)
    cache.keys.normal_()
    cache.values.normal_()
    cache.commit(cache.length)
    return cache


def context_figures(
    args,
    path: Path | None,
    context: int,
    bandwidth: float | None,
    peak: float,
    acceptance: float | None,
    draft_acceptance: float | None,
    speculative_acceptance: float | None,
) -> dict:
    """The passes' figures at ``context``; their memory roofline from ``bandwidth``, or where it is
    None from the bandwidth measured once the caches are filled, right before the passes run."""
    model, scaling = load_target(args, path, context)
    layout = model.cache_layout(context + 64, args.gamma + 2)
    full = filled_cache(FullCache(layout), context)
    retrieval = build_policy(RetrievalCacheConfig(budget=args.budget), layout, full)
    if bandwidth is None:
        bandwidth = memory_bandwidth(args.repeats, model.device)
    verify = args.gamma + 1
    step = pass_figures(model, full, 1, args, bandwidth, peak)
    proposal = pass_figures(model, retrieval, 1, args, bandwidth, peak)
    retrieval_verification = pass_figures(model, retrieval, verify, args, bandwidth, peak)
    verification = pass_figures(model, full, verify, args, bandwidth, peak)
    passes = {
        "full, 1 token (autoregressive step)": step,
        f"retrieval {args.budget}, 1 token (proposal)": proposal,
        f"retrieval {args.budget}, {verify} tokens (verifying the draft)": retrieval_verification,
        f"full, {verify} tokens (verification)": verification,
    }
    reselecting_ceilings = {"every_pass": {}, "every_round": {}, "tree": {}}
    if args.tree:
        tree = TokenTree.best_first(args.tree_ranks, args.tree, args.gamma)
        widest = max(len(tree.level(depth)) for depth in range(1, tree.depth))
        level = TreePass(
            torch.ones(widest, dtype=torch.long, device=model.device),
            torch.eye(widest, dtype=torch.bool, device=model.device),
        )  # the root's children
        passes[f"retrieval {args.budget}, a tree level of {widest} tokens"] = tree_level = pass_figures(
            model, retrieval, widest, args, bandwidth, peak, tree=level
        )
        passes[f"full, a tree of {len(tree)} tokens after one (verification)"] = tree_verification = pass_figures(
            model, full, len(tree) + 1, args, bandwidth, peak, tree=tree.tree_pass(model.device)
        )
    for index, scoring in enumerate(args.reselect):
        config = RetrievalCacheConfig(budget=args.budget, scoring=scoring, refresh="every_pass")
        selecting = build_policy(config, layout, full)
        selecting_proposal = pass_figures(model, selecting, 1, args, bandwidth, peak, selects=True)
        passes[f"retrieval {args.budget}, 1 token re-selecting ({scoring})"] = selecting_proposal
        del selecting
        if args.every_pass_acceptance:
            reselecting_ceilings["every_pass"][scoring] = self_spec_ceiling(
                step, selecting_proposal, verification, args.every_pass_acceptance[index]
            )
        if args.every_round_acceptance:
            reselecting_ceilings["every_round"][scoring] = self_spec_ceiling(
                step, proposal, verification, args.every_round_acceptance[index], selecting_proposal
            )
        if args.tree:
            reselecting_ceilings["tree"][scoring] = tree_ceiling(
                step, proposal, selecting_proposal, tree_level, tree_verification, tree, args.tree_accepted[index]
            )
    if args.draft_shape:
        draft = random_model(SHAPES[args.draft_shape], model.dtype, model.device, model.options)
        window = StreamingCacheConfig(sinks=4, window=args.draft_window)
        streaming = build_policy(window, draft.cache_layout(context + 64, args.gamma + 2))
        held = min(4 + args.draft_window, context)  # its window, or the whole context within it
        for start in range(0, held, args.gamma + 2):  # filled within its pending room
            filled_cache(streaming, min(args.gamma + 2, held - start))
        draft_step = pass_figures(draft, streaming, 1, args, bandwidth, peak)
        passes[f"draft {args.draft_shape}, streaming {4 + args.draft_window}, 1 token"] = draft_step
    figures = {"context": context, "rope_scaling": scaling, "fused_tokens": model.fused_tokens, "passes": passes}
    figures["bandwidth_bytes_per_s"] = bandwidth
    del model, full, retrieval
    torch.cuda.empty_cache() if args.device == "cuda" else None
    if acceptance is not None:
        figures["self_spec_ceiling"] = self_spec_ceiling(step, proposal, verification, acceptance)
    for schedule, ceilings in reselecting_ceilings.items():
        if ceilings:
            figures[f"{schedule}_ceilings"] = ceilings
    if speculative_acceptance is not None:
        figures["speculative_ceiling"] = self_spec_ceiling(step, draft_step, verification, speculative_acceptance)
    if draft_acceptance is not None:
        figures["triforce_ceiling"] = triforce_ceiling(
            draft_step, proposal, retrieval_verification, step, verification, draft_acceptance, acceptance
        )
    return figures


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    show_logs()
    files = run_files("roofline", args.out, "roofline.json")
    dtype, device = getattr(torch, args.dtype), torch.device(args.device)
    hardware = torch.cuda.get_device_name() if device.type == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    if args.roofline_of:
        rooflines = json.loads(args.roofline_of.read_text())
        bandwidth, peak = rooflines["bandwidth_bytes_per_s"], rooflines["matmul_flops_per_s"]
        print(f"{hardware}, rooflines of {rooflines['hardware']} ({args.roofline_of}): ", end="")
    else:
        bandwidth, peak = memory_bandwidth(args.repeats, device), matmul_peak(dtype, args.repeats, device)
        print(f"{hardware}: ", end="")
    print(f"memory bandwidth {bandwidth / 1e9:.1f} GB/s, {args.dtype} matmul peak {peak / 1e9:.0f} GFLOP/s")
    path = None if args.shape else args.target or default_model("target")
    rows = []
    print("| context | pass | measured ms | memory-bound ms | compute-bound ms | measured / roofline |")
    print("|---:|---|---:|---:|---:|---:|")
    acceptances = zip(args.contexts, args.acceptance, args.draft_acceptance, args.speculative_acceptance, strict=True)
    for context, acceptance, draft_acceptance, speculative_acceptance in acceptances:
        context_bandwidth = bandwidth if args.roofline_of else None  # else measured again there
        figures = context_figures(
            args, path, context, context_bandwidth, peak, acceptance, draft_acceptance, speculative_acceptance
        )
        rows.append(figures)
        for name, row in figures["passes"].items():
            print(
                f"| {context} | {name} | {row['ms']:.1f} | {row['memory_ms']:.1f} | {row['compute_ms']:.1f} | "
                f"{row['measured_over_roofline']:.1f}x |"
            )
        measured_bandwidth = figures["bandwidth_bytes_per_s"] / 1e9
        print(f"| {context} | (the memory read {measured_bandwidth:.1f} GB/s right before these passes) | | | | |")
    for figures in rows:
        ceilings = {
            "": figures.get("self_spec_ceiling"),
            **{
                f", re-selecting {schedule.replace('_', ' ')} ({scoring})": ceiling
                for schedule in ("every_pass", "every_round")
                for scoring, ceiling in figures.get(f"{schedule}_ceilings", {}).items()
            },
        }
        for selection, ceiling in ceilings.items():
            if ceiling is not None:
                print(
                    f"self-spec ceiling at {figures['context']}{selection} (acceptance {ceiling['acceptance']:.2f}): "
                    f"{ceiling['measured']['speedup']:.2f}x at gamma {ceiling['measured']['gamma']} from measured "
                    f"passes, {ceiling['roofline']['speedup']:.2f}x at gamma {ceiling['roofline']['gamma']} "
                    "at the rooflines"
                )
        for scoring, ceiling in figures.get("tree_ceilings", {}).items():
            print(
                f"self-spec ceiling at {figures['context']} with trees of {ceiling['nodes']} nodes (depth "
                f"{ceiling['depth']}), re-selecting every round ({scoring}, {ceiling['accepted_run']:.2f} accepted "
                f"per round): {ceiling['measured']['speedup']:.2f}x from measured passes, "
                f"{ceiling['roofline']['speedup']:.2f}x at the rooflines"
            )
        if "speculative_ceiling" in figures:
            ceiling = figures["speculative_ceiling"]
            print(
                f"speculative ceiling at {figures['context']} (acceptance {ceiling['acceptance']:.2f}): "
                f"{ceiling['measured']['speedup']:.2f}x at gamma {ceiling['measured']['gamma']} from measured "
                f"passes, {ceiling['roofline']['speedup']:.2f}x at gamma {ceiling['roofline']['gamma']} "
                "at the rooflines"
            )
        if "triforce_ceiling" in figures:
            ceiling = figures["triforce_ceiling"]
            print(
                f"triforce ceiling at {figures['context']} (acceptance {ceiling['draft_acceptance']:.2f} / "
                f"{ceiling['acceptance']:.2f}): "
                + ", ".join(
                    f"{ceiling[name]['speedup']:.2f}x at gammas {ceiling[name]['draft_gamma']} / "
                    f"{ceiling[name]['gamma']} {where}"
                    for name, where in (("measured", "from measured passes"), ("roofline", "at the rooflines"))
                )
            )
    report = {
        "hardware": hardware,
        "rooflines_of": str(args.roofline_of) if args.roofline_of else None,
        "model": args.shape or path.name,
        "dtype": args.dtype,
        "kernels": args.kernels,
        "attention": args.attention,
        "graphs": device.type == "cuda" and not args.no_graphs,
        "bandwidth_bytes_per_s": bandwidth,
        "matmul_flops_per_s": peak,
        "threads": torch.get_num_threads(),
        "contexts": rows,
    }
    files.write(report, vars(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
