"""Token trees: the best-first shape against brute force, the verifier's walk, a tree pass's logits
against each node's path fed causally, kept paths, and tree rounds equal to autoregressive greedy."""

from __future__ import annotations

import itertools

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from cache import build_policy
from cache.full import FullCacheConfig
from cache.retrieval import RetrievalCacheConfig
from cache.streaming import StreamingCacheConfig
from cascade import kernels
from cascade.checkpoint import load_model
from cascade.errors import CascadeError
from cascade.graphs import MAX_GRAPH_TOKENS, PassGraphs
from cascade.tree import ROOT, TokenTree, TreeGrowth, TreePlan, choice_ranks
from configs import load_config
from tests.conftest import make_checkpoint
from tests.test_graphs import compiled_capture, eager_capture, fresh_compile_caches  # noqa: F401 (autouse)
from tests.test_pipeline import PROMPT, SMALL_CACHES, generate, runtime_for


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    checkpoint = make_checkpoint(tmp_path_factory.mktemp("tree") / "llama", "llama-gqa-tied")
    return load_model(checkpoint, torch.float32, torch.device("cpu"))


TREE = TokenTree(parents=(ROOT, ROOT, ROOT, 0, 0, 1, 3, 3, 5), ranks=(0, 1, 2, 0, 1, 0, 0, 1, 0))
"""Three children of the root; nodes 3-4 below node 0, 5 below node 1; 6-7 below 3, 8 below 5."""


def paths(tree: TokenTree) -> list[list[int]]:
    """Each node's path from the root (itself last)."""
    found: list[list[int]] = []
    for node, parent in enumerate(tree.parents):
        found.append((found[parent] if parent != ROOT else []) + [node])
    return found


def test_levels_ancestry_and_depths_of_a_tree():
    assert TREE.depths == (1, 1, 1, 2, 2, 2, 3, 3, 3) and TREE.depth == 3
    assert [TREE.level(depth) for depth in (1, 2, 3)] == [range(0, 3), range(3, 6), range(6, 9)]
    for node, path in enumerate(paths(TREE)):
        assert TREE.ancestry[node].nonzero().flatten().tolist() == path
    assert TREE.up_to(2) == TokenTree(TREE.parents[:6], TREE.ranks[:6])


def test_a_chain_is_the_best_tree_when_only_the_argmax_is_ever_accepted():
    assert TokenTree.best_first([0.8], nodes=5, depth=9) == TokenTree.chain(5)
    assert TokenTree.chain(3).expected_accepted([0.5]) == pytest.approx(0.5 + 0.25 + 0.125)


def rank_paths(depth: int, ranks: int) -> list[tuple[int, ...]]:
    return [path for length in range(1, depth + 1) for path in itertools.product(range(ranks), repeat=length)]


def best_by_brute_force(rank_acceptance: list[float], nodes: int, depth: int) -> float:
    """The most tokens accepted in expectation over every tree of at most ``nodes`` nodes and
    ``depth`` levels (node sets closed under taking the parent)."""
    chance = {}
    for path in rank_paths(depth, len(rank_acceptance)):
        chance[path] = (chance[path[:-1]] if len(path) > 1 else 1.0) * rank_acceptance[path[-1]]
    best = 0.0
    for size in range(1, nodes + 1):
        for chosen in itertools.combinations(chance, size):
            if all(len(path) == 1 or path[:-1] in chosen for path in chosen):
                best = max(best, sum(chance[path] for path in chosen))
    return best


@pytest.mark.parametrize("rank_acceptance", [[0.6, 0.2, 0.1], [0.3, 0.3, 0.2], [0.9, 0.05, 0.01]])
@pytest.mark.parametrize("nodes,depth", [(3, 2), (5, 3), (6, 2)])
def test_best_first_is_the_best_tree_of_its_size(rank_acceptance, nodes, depth):
    tree = TokenTree.best_first(rank_acceptance, nodes, depth)
    assert len(tree) == nodes and tree.depth <= depth
    assert tree.expected_accepted(rank_acceptance) == pytest.approx(best_by_brute_force(rank_acceptance, nodes, depth))
    assert list(tree.depths) == sorted(tree.depths)  # breadth-first
    for node, parent in enumerate(tree.parents):
        assert parent < node
        siblings = [tree.ranks[other] for other in range(node) if tree.parents[other] == parent]
        assert siblings == list(range(tree.ranks[node]))  # each rank's elder siblings come first


def test_the_verifier_follows_its_choices_down_the_tree():
    tokens = [10, 11, 12, 20, 21, 22, 30, 31, 32]
    choices = [11, 0, 22, 0, 0, 0, 32, 0, 0, 7]  # after the root, then after each node
    assert TREE.follow(tokens, choices) == ([1, 5, 8], 7)
    assert TREE.follow(tokens, [99] + choices[1:]) == ([], 99)
    assert TREE.follow(tokens, [10, 21] + [5] * 8) == ([0, 4], 5)


def test_choice_ranks_names_the_proposers_rank_or_none():
    ranked = torch.tensor([[5, 6, 7], [1, 2, 3]])
    assert choice_ranks(ranked, torch.tensor([7, 9])).tolist() == [2, 3]


def fed_causally(model, tokens: torch.Tensor, prefix: int, path_tokens: list[int]) -> torch.Tensor:
    """Logits [P, V] of ``path_tokens`` after ``tokens[:prefix]`` in a fresh full cache."""
    cache = build_policy(FullCacheConfig(), model.cache_layout(capacity=128))
    sequence = torch.cat([tokens[:prefix], torch.tensor(path_tokens, dtype=torch.long)])
    return model(sequence[None], cache)[0, prefix:]


@pytest.mark.parametrize("capture", [None, "eager", "compiled"])
@pytest.mark.parametrize("kind", ["full", "retrieval", "streaming"])
def test_a_tree_pass_gives_each_node_the_logits_of_its_path_fed_in_order(kind, capture, tiny_model):
    """The root's context first (causal), then the tree one level per pass as a proposer feeds it,
    in a static pass when ``capture`` is given: every node's logits equal its path's fed causally
    (for the policies that keep every token, here none are dropped: budgets hold the prompt)."""
    model = tiny_model
    tokens = torch.randint(0, model.spec.vocab_size, (40,), generator=torch.Generator().manual_seed(1))
    node_tokens = torch.randint(0, model.spec.vocab_size, (len(TREE),), generator=torch.Generator().manual_seed(2))
    layout = model.cache_layout(capacity=128, max_pending=16)
    full = build_policy(FullCacheConfig(), layout)
    model(tokens[None, :30], full)
    full.commit(30)
    configs = {
        "full": None,
        "retrieval": RetrievalCacheConfig(budget=64, chunk_size=4),
        "streaming": StreamingCacheConfig(sinks=4, window=60),
    }
    cache = full if kind == "full" else build_policy(configs[kind], layout, full)
    if kind == "streaming":
        model(tokens[None, :30], cache)
        cache.commit(30)
    counter = CompileCounter()
    graphs = None
    if capture:
        graphs = PassGraphs(model, cache, eager_capture if capture == "eager" else compiled_capture(counter))
    run = (
        (lambda ids, count, tree: graphs(ids, count, tree))
        if graphs
        else (lambda ids, count, tree: model(ids, cache, count, tree))
    )
    root_logits = run(tokens[None, 30:40], 1, None)[0]  # the root is token 39
    node_logits = torch.cat(
        [
            run(
                node_tokens[None, TREE.level(depth).start : TREE.level(depth).stop],
                len(TREE.level(depth)),
                TREE.tree_pass(model.device, depth),
            )[0]
            for depth in (1, 2, 3)
        ]
    )  # [N, V]
    torch.testing.assert_close(root_logits[0], fed_causally(model, tokens, 39, [tokens[39].item()])[0])
    for node, path in enumerate(paths(TREE)):
        expected = fed_causally(model, tokens, 40, node_tokens[path].tolist())[-1]
        torch.testing.assert_close(node_logits[node], expected, rtol=1e-4, atol=1e-4)
    if capture == "compiled":  # one per level (and the root's pass, but retrieval's first pass selects: eager)
        assert counter.frame_count == len(graphs.graphs) == (3 if kind == "retrieval" else 4)


TREE_SETTINGS = ["stages.0.tree.nodes=12", "stages.0.tree.rank_acceptance=[0.6, 0.2, 0.1]", "stages.0.schedule=fixed"]
CLOSE_PROPOSER = ["stages.0.cache.budget=280"]
"""A retrieval budget just below the 300-token prompt: the proposer's argmax is often the
verifier's token, and often enough its second or third (random tiny models are far less sure of
their tokens than trained ones)."""
SPARQ_EVERY_PASS = ["stages.0.cache.scoring=sparq", "stages.0.cache.query_dims=8", "stages.0.cache.refresh=every_pass"]


@pytest.mark.parametrize(
    "preset,overrides",
    [
        ("self-spec", CLOSE_PROPOSER),
        ("self-spec", [*SMALL_CACHES["self-spec"], *SPARQ_EVERY_PASS]),
        ("speculative", []),
        ("triforce", [*SMALL_CACHES["triforce"], "stages.1.schedule=fixed"]),
        ("self-spec", [*CLOSE_PROPOSER, "stages.0.tree.dynamic=true"]),
        ("triforce", [*SMALL_CACHES["triforce"], "stages.1.schedule=fixed", "stages.0.tree.dynamic=true"]),
    ],
    ids=["self-spec", "self-spec-sparq-every-pass", "speculative", "triforce", "self-spec-dynamic", "triforce-dynamic"],
)
def test_tree_rounds_greedy_equal_autoregressive(preset, overrides, tiny_dir, tiny_draft_dir):
    """With the target itself proposing (a good proposer: long accepted paths) and a random draft."""
    autoregressive = generate(runtime_for("autoregressive", tiny_dir, tiny_draft_dir), PROMPT).token_ids
    runtime = runtime_for(preset, tiny_dir, tiny_draft_dir, [*overrides, *TREE_SETTINGS])
    result = generate(runtime, PROMPT)
    assert result.token_ids == autoregressive
    proposer = result.stats.stages[0]
    assert proposer.rounds > 0 and proposer.proposed < proposer.tree_nodes <= 12 * proposer.rounds
    assert sum(proposer.choice_ranks) >= proposer.rounds  # the root's choice at least, every round


@pytest.mark.skipif(not kernels.attention_kernel_available(), reason="cascade's attention kernel does not run here")
@pytest.mark.parametrize("preset,overrides", [("self-spec", CLOSE_PROPOSER), ("speculative", [])])
def test_bf16_tree_rounds_greedy_equal_autoregressive_through_cascades_kernels(
    preset, overrides, tiny_dir, tiny_draft_dir
):
    """In bf16 a near tie between two tokens goes by rounding: a tree's verification pass must round
    as the decode steps do (cascade's attention kernel reads each node's keys as its step would)."""
    autoregressive = runtime_for("autoregressive", tiny_dir, tiny_draft_dir, dtype="bfloat16")
    expected = generate(autoregressive, PROMPT, max_new_tokens=96).token_ids
    runtime = runtime_for(preset, tiny_dir, tiny_draft_dir, [*overrides, *TREE_SETTINGS], dtype="bfloat16")
    result = generate(runtime, PROMPT, max_new_tokens=96)
    assert result.token_ids == expected
    assert result.stats.stages[0].tree_nodes > 0


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed-shape", "dynamic"])
def test_a_tree_stops_growing_below_a_level_drafted_in_doubt_and_stays_exact(dynamic, tiny_dir, tiny_draft_dir):
    """A random draft's most likely token has far less than 0.99 of its probability, so each tree
    ends at its first level (the root's children); far more than 1e-9, so trees grow as without
    ``stop_below``."""
    autoregressive = generate(runtime_for("autoregressive", tiny_dir, tiny_draft_dir), PROMPT).token_ids
    first_level = len(TokenTree.best_first([0.6, 0.2, 0.1], nodes=12, depth=8).level(1))

    def proposer(stop_below):
        shape = f"stages.0.tree.dynamic={str(dynamic).lower()}"
        settings = [*TREE_SETTINGS, shape, f"stages.0.stop_below={stop_below}"]
        result = generate(runtime_for("speculative", tiny_dir, tiny_draft_dir, settings), PROMPT)
        assert result.token_ids == autoregressive
        stats = result.stats.stages[0]
        return stats.rounds, stats.proposed, stats.tree_nodes

    rounds, proposed, nodes = proposer(0.99)
    assert rounds > 1 and proposed == rounds and nodes == first_level * rounds
    whole = proposer("null")
    assert proposer(1e-9) == whole and whole[1] > whole[0]


@pytest.mark.parametrize("dynamic", [False, True], ids=["fixed-shape", "dynamic"])
def test_a_tree_accepts_what_a_chain_of_its_depth_rejects(dynamic, tiny_dir, tiny_draft_dir):
    stats = {}
    for shape, settings in (
        ("chain", ["stages.0.schedule=fixed"]),
        ("tree", [*TREE_SETTINGS, f"stages.0.tree.dynamic={str(dynamic).lower()}"]),
    ):
        runtime = runtime_for("self-spec", tiny_dir, tiny_draft_dir, [*CLOSE_PROPOSER, *settings])
        stats[shape] = generate(runtime, PROMPT).stats.stages[0]
    tree, chain = stats["tree"], stats["chain"]
    assert sum(tree.choice_ranks[1:]) > 0  # the verifier chose a token the proposer ranked lower
    assert tree.mean_accepted_run > chain.mean_accepted_run and tree.rounds < chain.rounds


def test_a_dynamic_tree_keeps_the_most_likely_paths_of_each_level():
    """Levels of 2 and 2 nodes: the second level's two are the best of the four root-to-grandchild
    paths by probability, here both below the root's second token."""
    plan = TreePlan(TokenTree(parents=(ROOT, ROOT, 0, 1), ranks=(0, 1, 0, 0)), torch.device("cpu"))
    growth = TreeGrowth(plan, dynamic=True, device=torch.device("cpu"))
    root = torch.tensor([[0.5, 0.3, 0.2, 0.0]]).log()  # [1, V=4]: tokens 0 and 1 below the root
    feed = growth.grow(plan.levels[0], root)
    assert growth.tokens[0].tolist() == [0, 1] and feed.ancestry.tolist() == [[True, False], [False, True]]
    below = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.0, 0.05, 0.9, 0.05]]).log()  # after token 0, after token 1
    feed = growth.grow(plan.levels[1], below)  # paths: 0.2, 0.15 below token 0; 0.27, 0.015 below token 1
    assert growth.tokens[1].tolist() == [2, 0] and growth.parents[1].tolist() == [1, 0]
    assert feed.ancestry.tolist() == [[False, True, True, False], [True, False, False, True]]
    assert growth.whole().ancestry.shape == (4, 4) and growth.whole().depths.tolist() == [1, 1, 2, 2]


@pytest.mark.parametrize(
    "capture,dynamic,nodes",
    [
        ("eager", False, 12),
        ("eager", True, 12),
        ("compiled", False, 12),
        ("compiled", True, 12),
        ("compiled", False, 24),
    ],
    ids=["eager-fixed-shape", "eager-dynamic", "compiled-fixed-shape", "compiled-dynamic", "compiled-wider-than-16"],
)
def test_graphed_tree_rounds_equal_autoregressive_and_compile_once_per_shape(
    capture, dynamic, nodes, tiny_dir, tiny_draft_dir
):
    """Tree passes are graphed whatever their width: 24 nodes make a verification pass of 25 tokens."""
    autoregressive = generate(runtime_for("autoregressive", tiny_dir, tiny_draft_dir), PROMPT).token_ids
    overrides = [
        *CLOSE_PROPOSER,
        *SPARQ_EVERY_PASS,
        *TREE_SETTINGS,
        f"stages.0.tree.nodes={nodes}",
        f"stages.0.tree.dynamic={str(dynamic).lower()}",
    ]
    runtime = runtime_for("self-spec", tiny_dir, tiny_draft_dir, overrides, kernels="eager")
    counter = CompileCounter()
    runtime.capture = eager_capture if capture == "eager" else compiled_capture(counter)
    pipeline = runtime.pipeline_for(len(PROMPT), 40)
    assert generate(runtime, PROMPT, pipeline=pipeline).token_ids == autoregressive
    proposer, verifier = pipeline.stages
    assert any(key[3] is not None for key in proposer.graphs.graphs)  # tree levels replayed
    verifier_tree_passes = [key[0] for key in verifier.graphs.graphs if key[3] is not None]  # tokens per pass
    assert max(verifier_tree_passes, default=0) >= min(nodes, MAX_GRAPH_TOKENS + 1)
    if capture == "compiled":
        assert counter.frame_count == sum(len(stage.graphs.graphs) for stage in pipeline.stages)


def test_keeping_a_path_leaves_the_cache_as_feeding_the_path_would(tiny_model):
    model = tiny_model
    tokens = torch.randint(0, model.spec.vocab_size, (30,), generator=torch.Generator().manual_seed(4))
    node_tokens = torch.randint(0, model.spec.vocab_size, (len(TREE),), generator=torch.Generator().manual_seed(5))
    layout = model.cache_layout(capacity=64, max_pending=16)
    tree_cache, path_cache = (build_policy(FullCacheConfig(), layout) for _ in range(2))
    for cache in (tree_cache, path_cache):
        model(tokens[None], cache)
        cache.commit(30)
    model(node_tokens[None], tree_cache, None, TREE.tree_pass(model.device))
    tree_cache.keep_path(30, [1, 5, 8])
    model(node_tokens[None, [1, 5, 8]], path_cache)
    assert tree_cache.length == path_cache.length == 33
    torch.testing.assert_close(tree_cache.keys[:, :, :, :33], path_cache.keys[:, :, :, :33], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(tree_cache.values[:, :, :, :33], path_cache.values[:, :, :, :33], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "settings,message",
    [
        ({"stages.1.tree.nodes": 4}, "only the first stage of two or more"),
        (
            {"stages.0.cache": {"kind": "h2o", "budget": 640}, "stages.0.tree.nodes": 4},
            "a h2o cache cannot run token-tree",
        ),
        ({"stages.0.tree.rank_acceptance": [0.6, 0.5]}, "summing to at most 1"),
        ({"stages.0.tree.rank_acceptance": [0.2, 0.5]}, "must not increase"),
        ({"stages.0.tree.nodes": 0}, "greater than or equal to 1"),
    ],
)
def test_tree_settings_that_cannot_work_are_refused_with_the_reason(settings, message):
    with pytest.raises(CascadeError, match=message):
        load_config("triforce", None, [], settings)
