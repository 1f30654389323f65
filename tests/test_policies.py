"""Properties of the individual cache policies: degenerate cases equal full, selection, eviction."""

from __future__ import annotations

import pytest
import torch

from cache import CacheLayout
from cache.chunk_scoring import score_chunks, score_prompt, sparse_query_attention, summarize_chunks
from cache.full import FullCache, FullCacheConfig
from cache.received_attention import received_attention
from cache.retrieval import RetrievalCache, RetrievalCacheConfig
from cache.streaming import StreamingCache, StreamingCacheConfig
from cascade.checkpoint import load_model
from cascade.errors import CascadeError
from cascade.rope import Rotary, apply_rotary
from cascade.stage import Stage
from tests.conftest import make_checkpoint

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return load_model(make_checkpoint(tmp_path_factory.mktemp("p") / "m", "llama-gqa-tied"), torch.float32, CPU)


def tokens(model, count: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, model.spec.vocab_size, (1, count), generator=torch.Generator().manual_seed(seed))


def decode_logits(model, cache, token_ids: torch.Tensor) -> list[torch.Tensor]:
    logits = []
    for token in token_ids[0]:
        logits.append(model(token.reshape(1, 1), cache))
        cache.commit(cache.length)
    return logits


def test_streaming_with_a_window_covering_everything_equals_full(tiny_model):
    prompt, generated = tokens(tiny_model, 40, 0), tokens(tiny_model, 10, 1)
    layout = tiny_model.cache_layout(64)
    full, streaming = FullCache(layout), StreamingCache(layout, StreamingCacheConfig(sinks=4, window=60))
    for cache in (full, streaming):
        tiny_model(prompt, cache)
        cache.commit(40)
    torch.testing.assert_close(
        decode_logits(tiny_model, streaming, generated), decode_logits(tiny_model, full, generated), atol=1e-5, rtol=0
    )
    assert streaming.dropped == 0


def test_streaming_keeps_sinks_and_window_with_contiguous_rotated_positions():
    """After eviction every kept key equals the raw key rotated at its new in-cache slot."""
    rotary = Rotary(1.0 / (10000 ** (torch.arange(0, 8, 2) / 8)), 1.0, CPU)
    layout = CacheLayout(1, 2, 8, capacity=100, dtype=torch.float32, device=CPU, rotary=rotary, max_pending=4)
    cache = StreamingCache(layout, StreamingCacheConfig(sinks=2, window=6))
    raw = torch.randn(1, 2, 30, 8, generator=torch.Generator().manual_seed(0))  # unrotated keys
    for start in range(0, 30, 3):
        positions = cache.allocate(3)
        rotated = apply_rotary(raw[:, :, start : start + 3], *rotary.cos_sin(positions, torch.float32))
        view = cache.update(0, rotated, raw[:, :, start : start + 3], None)
        cache.commit(cache.length)
    assert cache.dropped == 30 - 8 and cache.used_slots == 8
    kept = torch.cat([raw[:, :, :2], raw[:, :, -6:]], dim=2)  # sinks + the last 6 tokens
    expected = apply_rotary(kept, *rotary.cos_sin(torch.arange(8), torch.float32))
    torch.testing.assert_close(cache.keys[0, :, :, :8], expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(cache.values[0, :, :, :8], kept)
    assert positions.tolist() == [8, 9, 10]  # written after sinks + window, evicted at its commit
    assert view.keys.shape[2] == 11


def test_a_bf16_streaming_key_moved_hundreds_of_times_is_rounded_once_per_move_not_more():
    """Keys that moved down one slot at each of up to 300 commits stay as close to the raw keys
    rotated at their last slots (in float32, rounded to bf16) as a bf16 key can: 0.15% mean error
    here. Re-rotating the rounded keys at each move let the roundings add up to 4.8% (8% for the
    keys moved most)."""
    rotary = Rotary(1.0 / (10000 ** (torch.arange(0, 64, 2) / 64)), 1.0, CPU)
    layout = CacheLayout(1, 1, 64, capacity=700, dtype=torch.bfloat16, device=CPU, rotary=rotary, max_pending=1)
    cache = StreamingCache(layout, StreamingCacheConfig(sinks=1, window=300, evict_every=1))
    raw = torch.randn(1, 1, 600, 64, generator=torch.Generator().manual_seed(0)) * 4  # unrotated keys
    for index in range(600):
        positions = cache.allocate(1)
        cos, sin = rotary.cos_sin(positions, torch.float32)
        cache.update(0, apply_rotary(raw[:, :, index : index + 1], cos, sin).bfloat16(), raw[:, :, :1].bfloat16(), None)
        cache.commit(cache.length)
    slots = torch.arange(1, 301)  # the window: sequence tokens 300..599, the first of them moved 299 times
    direct = apply_rotary(raw[:, :, 300:], *rotary.cos_sin(slots, torch.float32)).bfloat16().float()
    error = (cache.keys[0, :, :, 1:301].float() - direct).abs()
    assert error.mean() < 0.004 * direct.abs().mean()


def test_streaming_prefill_of_the_tail_equals_a_prefill_of_the_sinks_and_the_tail_alone(tiny_model):
    """The tokens between the sinks and the tail are skipped, not fed: the cache holds what a
    prefill of sinks + tail alone leaves (same slots, so same positions), counting the whole prompt."""
    prompt, generated = tokens(tiny_model, 200, 0)[0], tokens(tiny_model, 6, 1)
    layout = tiny_model.cache_layout(256, max_pending=64)
    config = StreamingCacheConfig(sinks=4, window=40, prefill_tail=60)
    tail, alone = Stage("tail", tiny_model, config, layout), Stage("alone", tiny_model, config, layout)
    alone.cache.prefill_tail = None
    tail_logits = tail.prefill(prompt, chunk=64)
    alone_logits = alone.prefill(torch.cat([prompt[:4], prompt[-60:]]), chunk=64)
    assert (tail.length, tail.cache.used_slots, tail.cache.dropped) == (200, 44, 156)
    assert alone.cache.used_slots == 44
    torch.testing.assert_close(tail_logits, alone_logits, atol=1e-5, rtol=0)
    torch.testing.assert_close(
        decode_logits(tiny_model, tail.cache, generated),
        decode_logits(tiny_model, alone.cache, generated),
        atol=1e-5,
        rtol=0,
    )


def test_streaming_prefill_feeds_every_token_of_a_prompt_within_its_tail(tiny_model):
    config = StreamingCacheConfig(sinks=4, window=40, prefill_tail=60)
    stage = Stage("tail", tiny_model, config, tiny_model.cache_layout(128, max_pending=64))
    assert stage.cache.unfed_prompt(64) == range(4, 4) and stage.cache.unfed_prompt(65) == range(4, 5)
    stage.prefill(tokens(tiny_model, 50, 0)[0], chunk=64)
    assert (stage.length, stage.cache.dropped) == (50, 6)


def test_streaming_skips_only_with_nothing_but_the_sinks_held():
    layout = CacheLayout(1, 2, 8, capacity=100, dtype=torch.float32, device=CPU, max_pending=4)
    cache = StreamingCache(layout, StreamingCacheConfig(sinks=2, window=6, prefill_tail=6))
    cache.allocate(3)
    cache.commit(3)
    with pytest.raises(ValueError, match=r"skip\(5\) needs every token committed and only the sinks held"):
        cache.skip(5)


def test_policies_that_hold_every_prompt_token_refuse_to_skip(tiny_model):
    cache = FullCache(tiny_model.cache_layout(64))
    assert cache.unfed_prompt(1000) == range(0)
    with pytest.raises(NotImplementedError, match="FullCache holds every prompt token it is given"):
        cache.skip(1)


def test_streaming_rejects_sinks_not_below_window():
    with pytest.raises(ValueError, match=r"sinks \(8\) must be smaller than window \(8\)"):
        StreamingCacheConfig(sinks=8, window=8)


def test_retrieval_with_budget_covering_the_prompt_equals_full(tiny_model):
    prompt, generated = tokens(tiny_model, 40, 0), tokens(tiny_model, 8, 1)
    layout = tiny_model.cache_layout(64)
    source = FullCache(layout)
    tiny_model(prompt, source)
    source.commit(40)
    retrieval = RetrievalCache(layout, RetrievalCacheConfig(budget=48, chunk_size=8), source)
    reference = FullCache(layout)
    tiny_model(prompt, reference)
    reference.commit(40)
    torch.testing.assert_close(
        decode_logits(tiny_model, retrieval, generated),
        decode_logits(tiny_model, reference, generated),
        atol=1e-5,
        rtol=0,
    )
    assert retrieval.kept == 40


def hand_made_source(prompt: int = 14) -> tuple[FullCache, CacheLayout]:
    """2 KV heads, chunk size 2, key of token t = (t + 1) * e_(t % 4) scaled per head."""
    layout = CacheLayout(1, 2, 4, capacity=32, dtype=torch.float32, device=CPU)
    source = FullCache(layout)
    source.allocate(prompt)
    keys = torch.zeros(1, 2, prompt, 4)
    for t in range(prompt):
        keys[0, 0, t, t % 4] = t + 1
        keys[0, 1, t, (t + 2) % 4] = t + 1
    source.update(0, keys, -keys, None)
    source.commit(prompt)
    return source, layout


def brute_force_chunks(
    source: FullCache,
    query: torch.Tensor,
    prompt: int,
    size: int,
    chosen: int,
    scoring: str = "mean_key",
    query_dims: int = 2,
):
    """Per KV head (2 query heads each): score every whole chunk, keep chunk 0 + the best. mean_key:
    (summed group query) . (mean key); attention: the probability its tokens receive, summed over
    the group's heads; bound: per head, sum over dimensions of the chunk's largest query-key
    product in that dimension, as logits of an attention over chunks, summed over the group;
    sparq: attention from the query_dims dimensions of largest summed |query| in the group, each
    head's logits divided by sqrt(D * the share of its |query| those dimensions hold)."""
    picks = []
    for head in range(source.keys.shape[2]):
        keys, group = source.keys[0, 0, head, :prompt], query[0, 2 * head : 2 * head + 2, 0]  # [S, D], [2, D]
        chunks = keys.unflatten(0, (-1, size))  # [C, size, D]
        if scoring == "mean_key":
            scores = chunks.mean(1) @ group.sum(0)
        elif scoring == "attention":
            received = sum(torch.softmax(keys @ one / keys.shape[-1] ** 0.5, 0) for one in group)  # [S]
            scores = received.unflatten(0, (-1, size)).sum(1)
        elif scoring == "sparq":
            dims = group.abs().sum(0).topk(query_dims).indices
            received = sum(
                torch.softmax(
                    keys[:, dims] @ one[dims] / (keys.shape[-1] * one[dims].abs().sum() / one.abs().sum()) ** 0.5, 0
                )
                for one in group
            )
            scores = received.unflatten(0, (-1, size)).sum(1)
        else:
            bounds = [(chunks * one).amax(1).sum(1) for one in group]  # [C] per head
            scores = sum(torch.softmax(bound / keys.shape[-1] ** 0.5, 0) for bound in bounds)
        scores = scores.tolist()
        rest = sorted(range(1, len(scores)), key=lambda c: -scores[c])[: chosen - 1]
        picks.append(sorted([0, *rest]))
    return picks


def test_retrieval_picks_the_brute_force_chunks_with_gqa():
    source, layout = hand_made_source(prompt=14)  # 7 whole chunks of 2, no tail
    retrieval = RetrievalCache(layout, RetrievalCacheConfig(budget=6, chunk_size=2), source)
    query = torch.zeros(1, 4, 1, 4)  # 4 query heads, 2 per KV head
    query[0, 0, 0] = torch.tensor([0.0, 1.0, 0.0, 0.0])
    query[0, 1, 0] = torch.tensor([0.0, 0.0, 0.0, 2.0])  # head 0's group: sum = (0, 1, 0, 2)
    query[0, 2, 0] = torch.tensor([0.0, 0.0, 1.0, 0.0])
    query[0, 3, 0] = torch.tensor([0.0, 0.0, 1.0, 0.0])  # head 1's group: sum = (0, 0, 2, 0)
    retrieval.allocate(1)
    retrieval.update(0, torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), query)
    expected = brute_force_chunks(source, query, 14, 2, chosen=3)
    for head, chunks in enumerate(expected):
        wanted = torch.cat([source.keys[0, 0, head, c * 2 : c * 2 + 2] for c in chunks])
        torch.testing.assert_close(retrieval.keys[0, 0, head, :6], wanted)
    assert expected == [[0, 3, 5], [0, 4, 6]]  # the two KV heads really read different chunks
    assert all(chunks[0] == 0 for chunks in expected)  # the sink chunk, although it scores lowest


@pytest.mark.parametrize(
    ("scoring", "picks"),
    [("attention", [[0, 1, 6], [0, 5, 6]]), ("bound", [[0, 4, 6], [0, 5, 6]]), ("sparq", [[0, 4, 6], [0, 5, 6]])],
)
def test_retrieval_scored_otherwise_than_by_mean_keys_picks_the_brute_force_chunks(scoring, picks):
    """attention: the chunks receiving the most attention; bound: those whose best key can score most;
    sparq: those receiving the most attention seen through 2 of the query's 4 dimensions."""
    source, layout = hand_made_source(prompt=14)  # 7 whole chunks of 2, no tail
    config = RetrievalCacheConfig(budget=6, chunk_size=2, scoring=scoring, query_dims=2)
    retrieval = RetrievalCache(layout, config, source)
    query = torch.randn(1, 4, 1, 4, generator=torch.Generator().manual_seed(0))
    retrieval.allocate(1)
    retrieval.update(0, torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), query)
    expected = brute_force_chunks(source, query, 14, 2, chosen=3, scoring=scoring)
    for head, chunks in enumerate(expected):
        wanted = torch.cat([source.keys[0, 0, head, c * 2 : c * 2 + 2] for c in chunks])
        torch.testing.assert_close(retrieval.keys[0, 0, head, :6], wanted)
    assert expected == picks
    assert brute_force_chunks(source, query, 14, 2, chosen=3) == [[0, 2, 4], [0, 4, 6]]  # mean keys differ


def test_a_chunks_key_bound_is_at_least_what_each_of_its_keys_scores():
    keys = torch.randn(3, 64, 16, generator=torch.Generator().manual_seed(1))  # [H_kv, S, D], chunks of 8
    query = torch.randn(3, 16, generator=torch.Generator().manual_seed(2))  # one head per KV head
    lowest, highest = summarize_chunks(keys, 8, "bound")
    bound = torch.where(query[:, None] > 0, query[:, None] * highest, query[:, None] * lowest).sum(2)  # [H_kv, C]
    products = torch.einsum("hsd,hd->hs", keys, query).unflatten(1, (-1, 8))  # [H_kv, C, 8]
    assert (products <= bound[:, :, None] + 1e-5).all()
    assert (products.amax(2) < bound - 1e-3).any()  # an upper bound, not the best key's score


def test_sparq_reading_every_query_dimension_is_exact_attention():
    keys = torch.randn(3, 64, 16, generator=torch.Generator().manual_seed(1))  # [H_kv, S, D]
    query = torch.randn(6, 1, 16, generator=torch.Generator().manual_seed(2))  # [H, 1, D], groups of 2
    keys_by_dim = keys.transpose(1, 2).contiguous()  # [H_kv, D, S]
    exact = received_attention(query, keys)  # [H_kv, S]
    torch.testing.assert_close(sparse_query_attention(query, keys_by_dim, 16), exact)
    approximate = sparse_query_attention(query, keys_by_dim, 4)
    torch.testing.assert_close(approximate.sum(1), torch.full((3,), 2.0))  # still two heads' probabilities
    assert not torch.allclose(approximate, exact, atol=1e-3)


def test_sparq_reads_no_more_query_dimensions_than_the_model_has(tiny_model):
    source, layout = prefilled_source(tiny_model)  # head_dim 16
    with pytest.raises(CascadeError, match=r"query_dims \(32\) must be at most the model's head_dim \(16\)"):
        RetrievalCache(layout, RetrievalCacheConfig(budget=16, chunk_size=4, scoring="sparq", query_dims=32), source)


SUMMARY_BYTES_PER_CHUNK_DIM = {"mean_key": 4, "bound": 2 * 4, "sparq": 4 * 4}
"""Per chunk of 4 and head dimension, float32 keys: a mean; a minimum and a maximum; every key again."""


@pytest.mark.parametrize("scoring", ["mean_key", "bound", "sparq"])
def test_retrieval_summarizes_chunks_once_when_it_reselects_and_chooses_as_without(scoring, tiny_model):
    source, layout = prefilled_source(tiny_model)
    caches = [
        RetrievalCache(layout, RetrievalCacheConfig(budget=16, chunk_size=4, scoring=scoring, refresh=refresh), source)
        for refresh in ("never", {"every": 1})
    ]
    for cache in caches:
        decode_logits(tiny_model, cache, tokens(tiny_model, 1, 1))
    once, every = caches
    assert torch.equal(once.keys, every.keys)
    summary_bytes = layout.num_layers * layout.num_kv_heads * 16 * layout.head_dim  # 16 chunks of 4
    assert every.memory_bytes() - once.memory_bytes() == summary_bytes * SUMMARY_BYTES_PER_CHUNK_DIM[scoring]


def test_retrieval_keeps_the_recent_chunks_and_chooses_the_rest_by_score():
    source, layout = hand_made_source(prompt=14)  # 7 whole chunks of 2
    retrieval = RetrievalCache(layout, RetrievalCacheConfig(budget=8, chunk_size=2, recent=3), source)
    query = torch.randn(1, 4, 1, 4, generator=torch.Generator().manual_seed(0))
    retrieval.allocate(1)
    retrieval.update(0, torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), query)
    best_older = brute_force_chunks(source, query, 10, 2, chosen=2)  # sink + best of chunks 1-4
    for head, (sink, chosen) in enumerate(best_older):
        chunks = [sink, chosen, 5, 6]  # 3 recent tokens round up to the last 2 chunks
        wanted = torch.cat([source.keys[0, 0, head, c * 2 : c * 2 + 2] for c in chunks])
        torch.testing.assert_close(retrieval.keys[0, 0, head, :8], wanted)
    with pytest.raises(ValueError, match=r"recent \(12\) must leave room in the budget \(16\) for the sink"):
        RetrievalCacheConfig(budget=16, chunk_size=4, recent=12)


def test_retrieval_selects_by_the_first_query_of_a_pass_only():
    """Later tokens of a pass may be proposals under verification: they must not steer the choice."""
    source, layout = hand_made_source(prompt=14)
    first = torch.randn(1, 4, 1, 4, generator=torch.Generator().manual_seed(0))
    chosen_keys = []
    for seed in (1, 2):
        later = torch.randn(1, 4, 2, 4, generator=torch.Generator().manual_seed(seed)) * 10
        retrieval = RetrievalCache(layout, RetrievalCacheConfig(budget=6, chunk_size=2), source)
        retrieval.allocate(3)
        retrieval.update(0, torch.zeros(1, 2, 3, 4), torch.zeros(1, 2, 3, 4), torch.cat([first, later], 2))
        chosen_keys.append(retrieval.keys[0, 0, :, :6].clone())
    torch.testing.assert_close(chosen_keys[0], chosen_keys[1])


def test_retrieval_first_selects_with_the_prompts_last_queries_before_any_pass():
    """``first_selection: prompt`` picks what a first pass with those queries would, when the cache
    takes the prompt: its passes then select nothing and can all be plain (or captured) ones."""
    source, layout = hand_made_source(prompt=14)
    query = torch.randn(1, 4, 1, 4, generator=torch.Generator().manual_seed(0))  # [B, H, T, D]
    source.hold_last_queries(query[0, :, 0][None])  # [L, H, D]: the prompt's last token
    by_prompt = RetrievalCache(layout, RetrievalCacheConfig(budget=6, chunk_size=2), source)
    assert by_prompt.selections == 1 and by_prompt.graph_ready
    by_pass = RetrievalCache(layout, RetrievalCacheConfig(budget=6, chunk_size=2, first_selection="first_pass"), source)
    assert by_pass.selections == 0 and not by_pass.graph_ready
    for cache in (by_prompt, by_pass):
        cache.allocate(1)
        assert (cache.plain_pass() is not None) == (cache is by_prompt)
        cache.update(0, torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), query)
    assert by_prompt.selections == by_pass.selections == 1
    torch.testing.assert_close(by_prompt.keys[0, 0, :, :6], by_pass.keys[0, 0, :, :6])
    for head, chunks in enumerate(brute_force_chunks(source, query, 14, 2, chosen=3)):
        wanted = torch.cat([source.keys[0, 0, head, c * 2 : c * 2 + 2] for c in chunks])
        torch.testing.assert_close(by_prompt.keys[0, 0, head, :6], wanted)


def test_a_prefill_keeps_its_last_tokens_queries_whatever_its_chunks(tiny_model):
    """The queries a chunked prefill keeps are those of the prompt's last token in one pass; a
    source prefilled outside a stage keeps none, and its retrieval cache selects at its first pass."""
    prompt = tokens(tiny_model, 37, 0)
    kept = []
    for chunk in (37, 8, 12):  # the last pass: all 37 tokens, 5 of them, 1 of them
        stage = Stage("target", tiny_model, FullCacheConfig(), tiny_model.cache_layout(64))
        stage.prefill(prompt[0], chunk)
        assert stage.cache.last_queries_at == 36
        kept.append(stage.cache.last_queries)  # [L, H, D]
    assert kept[0].shape == (tiny_model.spec.num_layers, tiny_model.spec.num_heads, tiny_model.spec.head_dim)
    for queries in kept[1:]:
        torch.testing.assert_close(queries, kept[0], atol=1e-5, rtol=0)
    source, layout = prefilled_source(tiny_model)
    assert source.last_queries_at is None
    source.keep_last_queries()
    source.allocate(1)
    assert source.plain_pass() is None  # the pass that keeps them goes through every layer's update
    source.rollback(64)
    retrieval = RetrievalCache(layout, RetrievalCacheConfig(budget=16, chunk_size=4), source)
    assert retrieval.selections == 0 and not retrieval.graph_ready


def test_retrieval_keeps_the_partial_last_chunk():
    source, layout = hand_made_source(prompt=13)  # 6 whole chunks + 1 tail token
    retrieval = RetrievalCache(layout, RetrievalCacheConfig(budget=6, chunk_size=2), source)
    retrieval.allocate(1)
    retrieval.update(0, torch.zeros(1, 2, 1, 4), torch.zeros(1, 2, 1, 4), torch.ones(1, 4, 1, 4))
    assert retrieval.kept == 5  # sink chunk + 1 chosen chunk + the tail token: within the budget of 6
    torch.testing.assert_close(retrieval.keys[0, 0, :, 4], source.keys[0, 0, :, 12])


def prefilled_source(model, prompt_tokens: int = 64, capacity: int = 96):
    """A full cache holding a committed random prompt, and its layout."""
    layout = model.cache_layout(capacity)
    source = FullCache(layout)
    model(tokens(model, prompt_tokens, 0), source)
    source.commit(prompt_tokens)
    return source, layout


def test_retrieval_refresh_every_n_reselects(tiny_model):
    source, layout = prefilled_source(tiny_model)
    never = RetrievalCache(layout, RetrievalCacheConfig(budget=16, chunk_size=4), source)
    every = RetrievalCache(layout, RetrievalCacheConfig(budget=16, chunk_size=4, refresh={"every": 3}), source)
    for cache in (never, every):
        decode_logits(tiny_model, cache, tokens(tiny_model, 10, 1))
    assert never.selections == 1
    assert every.selections == 4  # at the first token, then after 3, 6 and 9 committed tokens
    assert not torch.equal(never.keys[:, :, :, :16], every.keys[:, :, :, :16])
    never.request_refresh()
    decode_logits(tiny_model, never, tokens(tiny_model, 1, 2))
    assert never.selections == 2


def test_retrieval_refresh_every_pass_reselects_before_each_pass_committed_or_not(tiny_model):
    source, layout = prefilled_source(tiny_model)
    per_pass = RetrievalCache(layout, RetrievalCacheConfig(budget=16, chunk_size=4, refresh="every_pass"), source)
    per_token = RetrievalCache(layout, RetrievalCacheConfig(budget=16, chunk_size=4, refresh={"every": 1}), source)
    for cache in (per_pass, per_token):
        for seed in (1, 2, 3):  # three proposals, none committed yet
            tiny_model(tokens(tiny_model, 1, seed), cache)
    assert (per_pass.selections, per_token.selections) == (3, 1)
    assert not torch.equal(per_pass.keys[:, :, :, :16], per_token.keys[:, :, :, :16])  # the last query chose


def test_retrieval_refreshes_when_acceptance_drops(tiny_model):
    source, layout = prefilled_source(tiny_model)
    config = RetrievalCacheConfig(budget=16, chunk_size=4, refresh={"on_drop": 0.5, "min_proposals": 8})
    cache = RetrievalCache(layout, config, source)
    decode_logits(tiny_model, cache, tokens(tiny_model, 1, 1))
    cache.observe_acceptance(4, 4)
    cache.observe_acceptance(4, 1)  # 5 of 8 since the selection: above 0.5
    decode_logits(tiny_model, cache, tokens(tiny_model, 1, 2))
    assert cache.selections == 1
    cache.observe_acceptance(4, 0)  # 5 of 12: below
    decode_logits(tiny_model, cache, tokens(tiny_model, 1, 3))
    assert cache.selections == 2
    cache.observe_acceptance(4, 0)  # the count restarts at each selection: 0 of 4 is not judged yet
    decode_logits(tiny_model, cache, tokens(tiny_model, 1, 4))
    assert cache.selections == 2


def test_retrieval_takes_the_full_caches_kv_of_committed_generated_tokens(tiny_model):
    source, layout = prefilled_source(tiny_model)  # a 64-token prompt
    generated = tokens(tiny_model, 5, 1)
    caches = {
        exact: RetrievalCache(layout, RetrievalCacheConfig(budget=16, chunk_size=4, exact_generated=exact), source)
        for exact in (True, False)
    }
    for cache in caches.values():
        tiny_model(generated, cache)  # the stage's own K/V: attention over 16 prompt tokens only
    tiny_model(generated, source)
    for cache in caches.values():
        cache.commit(67)  # 3 of the 5 are final
    committed, pending = slice(16, 19), slice(19, 21)  # their slots after the 16 kept prompt tokens
    exact, own = caches[True], caches[False]
    for buffer in ("keys", "values"):
        full = getattr(source, buffer)
        assert torch.equal(getattr(exact, buffer)[..., committed, :], full[..., 64:67, :])
        assert not torch.equal(getattr(own, buffer)[..., committed, :], full[..., 64:67, :])
        assert torch.equal(getattr(exact, buffer)[..., pending, :], getattr(own, buffer)[..., pending, :])
    assert exact.exact_until == 67


def test_retrieval_adopts_tokens_the_full_cache_committed_and_decodes_on_as_if_it_had_fed_them(tiny_model):
    """A bypassed stage resumes without a pass over what it skipped: with exact_generated the K/V
    of committed tokens are the source's either way, so adopting them leaves the same cache."""
    source, layout = prefilled_source(tiny_model)  # a 64-token prompt
    config = RetrievalCacheConfig(budget=16, chunk_size=4)
    fed, adopted = RetrievalCache(layout, config, source), RetrievalCache(layout, config, source)
    exact_off = RetrievalCache(layout, RetrievalCacheConfig(budget=16, chunk_size=4, exact_generated=False), source)
    generated = tokens(tiny_model, 6, 1)
    for cache in (fed, adopted, exact_off):  # each selects its chunks at the first generated token
        tiny_model(generated[:, :1], cache)
        cache.commit(65)
    tiny_model(generated, source)
    source.commit(69)  # 5 of the 6 generated tokens are final
    tiny_model(generated[:, 1:5], fed)
    fed.commit(69)
    assert adopted.adopt(70) == 69  # only what the source has committed
    assert adopted.committed == adopted.exact_until == 69
    for buffer in ("keys", "values"):
        assert torch.equal(getattr(adopted, buffer)[..., :21, :], getattr(fed, buffer)[..., :21, :])
    torch.testing.assert_close(tiny_model(generated[:, 5:], adopted), tiny_model(generated[:, 5:], fed), atol=0, rtol=0)
    assert exact_off.adopt(69) == 65  # its own K/V differ from the source's: it must compute them


def test_retrieval_budget_checks():
    with pytest.raises(ValueError, match=r"budget \(30\) must be a multiple of chunk_size \(8\)"):
        RetrievalCacheConfig(budget=30, chunk_size=8)
    with pytest.raises(ValueError, match="degenerate to the full cache"):
        RetrievalCacheConfig(budget=4096).check_prompt(4000)


def test_retrieval_holds_no_second_copy_of_a_32k_prompt():
    layout = CacheLayout(
        num_layers=2, num_kv_heads=3, head_dim=64, capacity=32_768 + 256, dtype=torch.bfloat16, device=CPU
    )
    source = FullCache(layout)
    source.allocate(32_768)
    source.commit(32_768)
    retrieval = RetrievalCache(layout, RetrievalCacheConfig(budget=4096, chunk_size=8), source)
    assert retrieval.memory_bytes() == (4096 + 256) * layout.bytes_per_token
    assert retrieval.memory_bytes() < 0.14 * source.memory_bytes()
    retrieval.allocate(1)
    view = retrieval.update(
        0,
        torch.zeros(1, 3, 1, 64, dtype=torch.bfloat16),
        torch.zeros(1, 3, 1, 64, dtype=torch.bfloat16),
        torch.ones(1, 9, 1, 64),
    )
    assert view.keys.shape == (1, 3, 4097, 64)
    assert retrieval.read_bytes() == 4097 * layout.bytes_per_token


def test_topk_oracle_reads_the_brute_force_most_attended_tokens():
    from cache.topk_oracle import top_attended

    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(1, 2, 20, 4, generator=generator)
    query = torch.randn(1, 4, 3, 4, generator=generator)  # 2 query heads per KV head, 3 queries
    expected = []
    for head in range(2):
        attention = torch.zeros(20)
        for query_head in (2 * head, 2 * head + 1):
            for t in range(3):
                attention += (keys[0, head] @ query[0, query_head, t] / 2.0).softmax(0)
        expected.append(sorted(attention.argsort(descending=True)[:5].tolist()))
    assert [sorted(row) for row in top_attended(query, keys, 5).tolist()] == expected


def test_topk_oracle_and_h2o_with_room_for_everything_equal_full(tiny_model):
    from cache.h2o import H2OCache, H2OCacheConfig
    from cache.topk_oracle import TopKOracleCache, TopKOracleCacheConfig

    prompt, generated = tokens(tiny_model, 40, 0), tokens(tiny_model, 8, 1)
    layout = tiny_model.cache_layout(64)
    full, h2o = FullCache(layout), H2OCache(layout, H2OCacheConfig(budget=60, recent=8))
    for cache in (full, h2o):
        tiny_model(prompt, cache)
        cache.commit(40)
    oracle = TopKOracleCache(layout, TopKOracleCacheConfig(budget=60), full)  # copies the prompt
    expected = decode_logits(tiny_model, full, generated)
    torch.testing.assert_close(decode_logits(tiny_model, oracle, generated), expected, atol=1e-5, rtol=0)
    torch.testing.assert_close(decode_logits(tiny_model, h2o, generated), expected, atol=1e-5, rtol=0)


def test_topk_oracle_starts_from_the_full_attention_prompt(tiny_model):
    """A prompt longer than the budget, prefilled in chunks: the oracle holds the source's K/V of
    it (full attention), not K/V computed with each chunk reading only its top ``budget`` keys."""
    from cache.topk_oracle import TopKOracleCache, TopKOracleCacheConfig

    prompt = tokens(tiny_model, 40, 0)
    layout = tiny_model.cache_layout(64)
    full = FullCache(layout)
    for chunk in prompt.split(16, dim=1):
        tiny_model(chunk, full)
        full.commit(full.length)
    oracle = TopKOracleCache(layout, TopKOracleCacheConfig(budget=8), full)
    assert (oracle.length, oracle.committed) == (40, 40)
    assert torch.equal(oracle.keys[..., :40, :], full.keys[..., :40, :])
    assert torch.equal(oracle.values[..., :40, :], full.values[..., :40, :])
    with pytest.raises(ValueError, match="copies the prompt from a full cache"):
        TopKOracleCache(layout, TopKOracleCacheConfig(budget=8))


def test_h2o_keeps_the_heavy_hitter_and_the_recent_window():
    from cache.h2o import H2OCache, H2OCacheConfig

    layout = CacheLayout(1, 1, 4, capacity=40, dtype=torch.float32, device=CPU, max_pending=4)
    cache = H2OCache(layout, H2OCacheConfig(budget=6, recent=3))
    heavy = torch.tensor([0.0, 0.0, 0.0, 10.0])
    for t in range(12):
        cache.allocate(1)
        key = torch.full((1, 1, 1, 4), 0.1 * t)
        if t == 2:
            key[0, 0, 0] = heavy  # every query below attends almost only to token 2
        cache.update(0, key, key + 100, heavy.expand(1, 1, 1, 4))
        cache.commit(cache.length)
    assert cache.used_slots == 6 and cache.dropped == 6
    kept_values = cache.values[0, 0, 0, :6, 3] - 100
    # old slots: token 2 (the heavy hitter) and tokens 0-1, which got attention before it existed;
    # tokens 3-8, which no query attends to, were evicted
    torch.testing.assert_close(kept_values[:3], torch.tensor([0.0, 0.1, 10.0]))
    torch.testing.assert_close(kept_values[-3:], torch.tensor([0.9, 1.0, 1.1]))  # the recent window


def test_h2o_ignores_the_attention_of_rolled_back_tokens():
    from cache.h2o import H2OCache, H2OCacheConfig

    layout = CacheLayout(1, 1, 4, capacity=40, dtype=torch.float32, device=CPU, max_pending=4)
    generator = torch.Generator().manual_seed(5)
    keys, queries, rejected = (torch.randn(1, 1, 4, 4, generator=generator) for _ in range(3))
    speculated, plain = (H2OCache(layout, H2OCacheConfig(budget=6, recent=3)) for _ in range(2))
    speculated.allocate(4)  # tokens 0-1, then two that are rejected after the commit of 0-1
    speculated.update(0, keys, keys, torch.cat([queries[:, :, :2], rejected[:, :, 2:]], dim=2))
    speculated.commit(2)
    speculated.rollback(2)
    for cache, passes in ((speculated, [(2, 4)]), (plain, [(0, 2), (2, 4)])):
        for start, end in passes:
            cache.allocate(end - start)
            cache.update(0, keys[:, :, start:end], keys[:, :, start:end], queries[:, :, start:end])
            cache.commit(end)
    torch.testing.assert_close(speculated.scores, plain.scores)
    assert speculated.scores[0, 0, :4].sum().item() == pytest.approx(4.0)  # four queries, each sums to 1


def test_h2o_forgets_the_rolled_back_part_of_a_pass():
    from cache.h2o import H2OCache, H2OCacheConfig

    layout = CacheLayout(1, 1, 4, capacity=40, dtype=torch.float32, device=CPU, max_pending=8)
    generator = torch.Generator().manual_seed(3)
    keys, queries = torch.randn(1, 1, 6, 4, generator=generator), torch.randn(1, 1, 6, 4, generator=generator)
    rejected = torch.randn(1, 1, 2, 4, generator=generator)
    partial, whole = (H2OCache(layout, H2OCacheConfig(budget=30, recent=3)) for _ in range(2))
    partial.allocate(4)
    partial.update(0, keys[:, :, :4], keys[:, :, :4], torch.cat([queries[:, :, :2], rejected], dim=2))
    partial.rollback(2)  # the last two tokens of that pass are rejected ...
    for cache, passes in ((partial, [(2, 6)]), (whole, [(0, 2), (2, 6)])):
        for start, end in passes:  # ... and replaced by other tokens
            cache.allocate(end - start)
            cache.update(0, keys[:, :, start:end], keys[:, :, start:end], queries[:, :, start:end])
    for cache in (partial, whole):
        cache.commit(6)
    torch.testing.assert_close(partial.scores, whole.scores)


def test_at_budget_gives_each_budgeted_policy_that_many_tokens():
    from cache import POLICIES

    assert POLICIES["streaming"].config.at_budget(64).model_dump() == {
        "kind": "streaming",
        "sinks": 4,
        "window": 60,
        "prefill_tail": None,
        "evict_every": 1,
    }
    assert POLICIES["h2o"].config.at_budget(64).recent == 32
    assert POLICIES["retrieval"].config.at_budget(64).budget == 64
    with pytest.raises(
        ValueError,
        match="full caches have no token budget; these kinds have one: h2o, retrieval, streaming, topk_oracle",
    ):
        POLICIES["full"].config.at_budget(64)


def test_budgets_from_a_share_of_the_prompt_are_whole_granules():
    from cache.config import budget_for

    assert [budget_for(share, 8000) for share in (0.01, 0.03, 0.05, 0.1)] == [80, 240, 400, 800]
    assert budget_for(0.001, 8000) == 16  # never below one granule
    assert budget_for(0.05, 3000, granule=64) == 128  # 150 tokens, to the nearest 64


def test_as_settings_keeps_kind_and_what_differs_from_the_defaults():
    from configs import load_config

    settings = RetrievalCacheConfig(budget=64).as_settings()
    assert settings == {"kind": "retrieval", "budget": 64}
    _, config = load_config("self-spec", settings={"stages.0.cache": settings, "stages.0.cache.refresh.every": 16})
    assert config.stages[0].cache == RetrievalCacheConfig(budget=64, refresh={"every": 16})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_one_off_mean_key_selection_scores_keys_as_their_chunks_mean_would(dtype):
    """Without a stored summary, mean_key scores every key against the summed group query and sums
    per chunk: the mean key's score, up to the rounding of the products to the keys' dtype."""
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 64 * 8, 16, generator=generator).to(dtype)  # [H_kv, C*size, D]
    query = torch.randn(4, 1, 16, generator=generator).to(dtype)  # [H, 1, D], 2 per KV head
    direct = score_prompt(query, keys, 8, "mean_key", query_dims=0)
    by_means = score_chunks(query, summarize_chunks(keys, 8, "mean_key"), 8, "mean_key", query_dims=0)
    assert direct.shape == (2, 64) and direct.dtype == torch.float32
    tolerance = 1e-5 if dtype == torch.float32 else 0.05
    torch.testing.assert_close(direct, by_means, atol=tolerance, rtol=tolerance)
    assert direct.topk(8).indices.sort().values.tolist() == by_means.topk(8).indices.sort().values.tolist()
