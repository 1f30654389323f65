"""Static passes and their graphs, checked on CPU: a static pass computes what the dynamic pass
does; captured with torch.compile(fullgraph=True, dynamic=False) it compiles exactly once per
pass shape however the cache's length moves (no graph break, no host value baked in), which is
what a CUDA graph replay relies on; graphed presets stay exactly autoregressive."""

from __future__ import annotations

import time

import pytest
import torch
from torch._dynamo.testing import CompileCounter

from cache import build_policy
from cache.full import FullCacheConfig
from cache.retrieval import RetrievalCacheConfig
from cache.streaming import StreamingCacheConfig
from cascade import attention
from cascade.checkpoint import load_model
from cascade.graphs import MAX_GRAPH_TOKENS, PassGraphs, cuda_graph
from cascade.model import PassOptions
from tests.conftest import make_checkpoint
from tests.test_pipeline import PROMPT, SMALL_CACHES, generate, runtime_for

CONFIGS = {
    "full": FullCacheConfig(),
    "streaming": StreamingCacheConfig(sinks=4, window=24),
    "retrieval": RetrievalCacheConfig(budget=32, chunk_size=4),
    "retrieval-bound-every-2": RetrievalCacheConfig(budget=32, chunk_size=4, scoring="bound", refresh={"every": 2}),
    "retrieval-attention-every-3": RetrievalCacheConfig(
        budget=32, chunk_size=4, scoring="attention", refresh={"every": 3}
    ),
    "retrieval-sparq-every-pass": RetrievalCacheConfig(
        budget=32, chunk_size=4, scoring="sparq", query_dims=4, refresh="every_pass"
    ),
}
"""Retrieval re-selecting on a schedule captures its selecting passes too."""
PASSES = [1, 1, 4, 1, 3, 1, 1, 4, 2, 1]
"""Tokens per pass after the prompt; each pass keeps all but its last token (a rejection)."""


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    return make_checkpoint(tmp_path_factory.mktemp("graphs") / "llama", "llama-gqa-tied")


@pytest.fixture(scope="module")
def tiny_model(tiny_checkpoint):
    return load_model(tiny_checkpoint, torch.float32, torch.device("cpu"))


def eager_capture(run):
    return run


def compiled_capture(counter: CompileCounter):
    return lambda run: torch.compile(run, fullgraph=True, dynamic=False, backend=counter)


@pytest.fixture(autouse=True)
def fresh_compile_caches():
    """Every capture compiles the same ``run`` code: start each test with none compiled yet, and
    room for every shape of a three-stage pipeline."""
    torch._dynamo.reset()
    with torch._dynamo.config.patch(recompile_limit=64):
        yield


def run_passes(model, kind: str, capture=None) -> tuple[list[torch.Tensor], PassGraphs | None]:
    """Prefill 60 tokens, then PASSES with rollbacks and commits -> each pass's logits [T, V], and
    the graphs that ran them (given a ``capture``)."""
    layout = model.cache_layout(capacity=96, max_pending=8)
    tokens = torch.randint(0, model.spec.vocab_size, (60 + sum(PASSES),), generator=torch.Generator().manual_seed(3))
    tokens = tokens.to(model.device)
    full = build_policy(FullCacheConfig(), layout)
    model(tokens[None, :60], full)
    full.commit(60)
    cache = full if kind == "full" else build_policy(CONFIGS[kind], layout, full)
    if kind == "streaming":
        for start in range(0, 60, 6):  # within its pending room
            model(tokens[None, start : start + 6], cache)
            cache.commit(start + 6)
    graphs = PassGraphs(model, cache, capture) if capture else None
    logits, length = [], 60
    for count in PASSES:
        ids = tokens[None, length : length + count]
        logits.append((graphs(ids, count) if graphs else model(ids, cache, count))[0])
        length += count - 1 if count > 1 else count
        cache.rollback(length)
        cache.commit(length)
        if cache is not full:  # the source holds every committed token, as the target stage would
            model(tokens[None, full.length : length], full)
            full.commit(length)
    return logits, graphs


@pytest.mark.parametrize("kind", list(CONFIGS))
def test_static_passes_compute_what_dynamic_passes_do(kind, tiny_model):
    dynamic, _ = run_passes(tiny_model, kind)
    static, _ = run_passes(tiny_model, kind, eager_capture)
    for expected, got in zip(dynamic, static, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fused_tokens", [0, MAX_GRAPH_TOKENS], ids=["eager", "fused"])
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_a_static_pass_compiles_once_per_shape_whatever_the_length(kind, fused_tokens, tiny_model, monkeypatch):
    """Also with every pass through the fused kernels, as on CUDA: no graph break or host sync there."""
    counter = CompileCounter()
    dynamic, _ = run_passes(tiny_model, kind)
    monkeypatch.setattr(tiny_model, "options", PassOptions(fused_tokens))
    compiled, graphs = run_passes(tiny_model, kind, compiled_capture(counter))
    for expected, got in zip(dynamic, compiled, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == len(graphs.graphs)
    selecting = {key[0] for key in graphs.graphs if key[2] is not None}
    if kind.endswith("every-pass"):  # every pass selected: one graph per shape
        assert graphs.cache.selections == len(PASSES) and selecting == set(PASSES) == {k[0] for k in graphs.graphs}
    elif kind.startswith("retrieval-"):  # shapes that selected and shapes that did not, each compiled once
        assert graphs.cache.selections > 2 and selecting and len(graphs.graphs) > len(set(PASSES))
    else:
        assert not selecting and len(graphs.graphs) == len(set(PASSES))  # retrieval's one selection is eager


@pytest.mark.parametrize("kind", ["full", "streaming", "retrieval-sparq-every-pass"])
def test_flex_attention_traces_whole_inside_a_compiled_pass(kind, tiny_model, monkeypatch):
    """Under ``attention: flex`` a static pass captured whole (fullgraph) traces FlexAttention with
    the rest of the pass: no graph break, one compile per shape, the dynamic passes' logits."""
    counter = CompileCounter()
    dynamic, _ = run_passes(tiny_model, kind)
    monkeypatch.setattr(tiny_model, "options", PassOptions(attention="flex"))
    compiled, graphs = run_passes(tiny_model, kind, compiled_capture(counter))
    for expected, got in zip(dynamic, compiled, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert counter.frame_count == len(graphs.graphs)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("attention_family", ["auto", "flex"])
@pytest.mark.parametrize("fused_tokens", [0, MAX_GRAPH_TOKENS], ids=["eager", "fused"])
@pytest.mark.parametrize("kind", list(CONFIGS))
def test_cuda_graph_replays_compute_what_dynamic_passes_do(kind, fused_tokens, attention_family, tiny_checkpoint):
    """Replays against eager dynamic passes, with the graphed passes eager or as Triton kernels,
    their attention the device's default or FlexAttention's."""
    model = load_model(tiny_checkpoint, torch.float32, torch.device("cuda"))
    dynamic, _ = run_passes(model, kind)
    model.options = PassOptions(fused_tokens, attention_family)
    replayed, _ = run_passes(model, kind, cuda_graph)
    for expected, got in zip(dynamic, replayed, strict=True):
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_a_new_prompt_drops_the_graphs_that_selected_over_the_last_one(tiny_model):
    """A selecting graph reads its prompt's chunk summaries: after a restart they are new tensors."""
    layout = tiny_model.cache_layout(capacity=96)
    full = build_policy(FullCacheConfig(), layout)
    tokens = torch.randint(0, tiny_model.spec.vocab_size, (1, 62), generator=torch.Generator().manual_seed(4))
    for prompt in (60, 50):
        full.restart()
        tiny_model(tokens[:, :prompt], full)
        full.commit(prompt)
        if prompt == 60:
            retrieval = build_policy(CONFIGS["retrieval-bound-every-2"], layout, full)
            graphs = PassGraphs(tiny_model, retrieval, compiled_capture(CompileCounter()))
        else:
            retrieval.restart()
        graphs(tokens[:, prompt : prompt + 1], 1)  # selects
        retrieval.commit(prompt + 1)
        graphs(tokens[:, prompt + 1 : prompt + 2], 1)  # does not
    assert set(graphs.graphs) == {(1, 1, None, None), (1, 1, ("select", 2), None)}


def test_long_passes_and_one_off_selecting_passes_run_eagerly(tiny_model):
    layout = tiny_model.cache_layout(capacity=96)
    full = build_policy(FullCacheConfig(), layout)
    counter = CompileCounter()
    graphs = PassGraphs(tiny_model, full, compiled_capture(counter))
    graphs(torch.zeros(1, MAX_GRAPH_TOKENS + 1, dtype=torch.long), 1)
    assert counter.frame_count == 0 and not graphs.graphs
    full.commit(full.length)
    retrieval = build_policy(CONFIGS["retrieval"], layout, full)
    assert not retrieval.graph_ready
    tiny_model(torch.zeros(1, 1, dtype=torch.long), retrieval)
    assert retrieval.graph_ready


@pytest.mark.parametrize("fused_tokens", [0, MAX_GRAPH_TOKENS], ids=["eager", "fused"])
@pytest.mark.parametrize("preset", ["self-spec", "triforce"])
def test_graphed_presets_greedy_equal_autoregressive_and_keep_their_graphs(
    preset, fused_tokens, tiny_dir, tiny_draft_dir
):
    """A runtime's next request (here a shorter prompt) restarts the last one's stages: same
    caches, and not one pass shape compiled twice; with every graphed pass fused, as on CUDA, too.
    Fixed gammas, so that every stage proposes (the cost model may drop a tiny model's tier at once)."""
    autoregressive = runtime_for("autoregressive", tiny_dir, tiny_draft_dir, kernels="eager")
    fixed = [f"stages.{index}.schedule=fixed" for index in range(2 if preset == "triforce" else 1)]
    runtime = runtime_for(preset, tiny_dir, tiny_draft_dir, [*SMALL_CACHES[preset], *fixed], kernels="eager")
    runtime.target.model.options = runtime.draft.model.options = PassOptions(fused_tokens)
    counter = CompileCounter()
    runtime.capture = compiled_capture(counter)
    used = []  # per request: its stages and their caches
    for prompt in (PROMPT, PROMPT[:250]):
        pipeline = runtime.pipeline_for(len(prompt), 40)
        assert generate(runtime, prompt, pipeline=pipeline).token_ids == generate(autoregressive, prompt).token_ids
        used.append([(stage, stage.cache) for stage in pipeline.stages])
    assert used[0] == used[1]
    shapes = [len(stage.graphs.graphs) for stage in pipeline.stages]
    assert all(shapes) and counter.frame_count == sum(shapes)


@pytest.mark.parametrize(
    "selection",
    [
        ["stages.0.cache.scoring=mean_key", "stages.0.cache.refresh.every=1"],
        ["stages.0.cache.scoring=attention", "stages.0.cache.refresh.every=1"],
        ["stages.0.cache.scoring=sparq", "stages.0.cache.query_dims=8", "stages.0.cache.refresh=every_pass"],
    ],
    ids=["mean_key-every-round", "attention-every-round", "sparq-every-pass"],
)
def test_graphed_self_spec_reselecting_replays_its_selections(selection, tiny_dir, tiny_draft_dir):
    autoregressive = runtime_for("autoregressive", tiny_dir, tiny_draft_dir, kernels="eager")
    overrides = [*SMALL_CACHES["self-spec"], *selection, "stages.0.schedule=fixed"]
    runtime = runtime_for("self-spec", tiny_dir, tiny_draft_dir, overrides, kernels="eager")
    counter = CompileCounter()
    runtime.capture = compiled_capture(counter)
    pipeline = runtime.pipeline_for(len(PROMPT), 40)
    assert generate(runtime, PROMPT, pipeline=pipeline).token_ids == generate(autoregressive, PROMPT).token_ids
    proposer = pipeline.stages[0]
    assert proposer.cache.selections > 5 and any(key[2] is not None for key in proposer.graphs.graphs)
    assert counter.frame_count == sum(len(stage.graphs.graphs) for stage in pipeline.stages)


def test_graphed_self_spec_through_flex_attention_equals_autoregressive(tiny_dir, tiny_draft_dir, monkeypatch):
    """With ``attention: flex`` every static pass of both stages reads its cache through a
    FlexAttention kernel compiled for its shape (run as a CUDA graph's warm-up runs it), and
    greedy output stays autoregressive's."""
    autoregressive = runtime_for("autoregressive", tiny_dir, tiny_draft_dir, kernels="eager")
    overrides = [*SMALL_CACHES["self-spec"], "stages.0.schedule=fixed", "stages.0.gamma=3"]
    runtime = runtime_for("self-spec", tiny_dir, tiny_draft_dir, overrides, kernels="eager", attention="flex")
    runtime.capture = eager_capture
    compiled, shapes = attention._compiled_flex_under_mask, set()

    def recording(query, keys, values, *rest):
        shapes.add((query.shape[2], keys.shape[2]))
        return compiled(query, keys, values, *rest)

    monkeypatch.setattr(attention, "_compiled_flex_under_mask", recording)
    pipeline = runtime.pipeline_for(len(PROMPT), 24)
    assert generate(runtime, PROMPT, 24, pipeline=pipeline).token_ids == generate(autoregressive, PROMPT, 24).token_ids
    graphed = {(key[0], stage.cache.keys.shape[3]) for stage in pipeline.stages for key in stage.graphs.graphs}
    assert shapes == graphed and len({keys for _, keys in shapes}) == 2  # the retrieval and the full cache


def test_rounds_that_capture_a_graph_are_not_timed(tiny_dir, tiny_draft_dir):
    """A capture's eager run and recording must not reach the cost model's pass times: every
    capture here takes a second, and the timed rounds together take far less."""

    def slow_capture(run):
        time.sleep(1.0)
        return run

    runtime = runtime_for("self-spec", tiny_dir, tiny_draft_dir, SMALL_CACHES["self-spec"], kernels="eager")
    runtime.capture = slow_capture
    pipeline = runtime.pipeline_for(len(PROMPT), 40)
    stats = generate(runtime, PROMPT, pipeline=pipeline).stats.stages[0]
    assert pipeline.stages[1].captured_passes >= 2  # the verifier captured passes of several widths
    assert 0 < stats.timed_rounds < stats.rounds and stats.timed_proposed < stats.proposed
    assert stats.propose_s + stats.verify_s + stats.plain_s < 1.0
