"""The cache-policy contract, checked for every registered policy."""

from __future__ import annotations

import pytest
import torch

from cache import POLICIES, CacheFullError, CacheLayout, build_policy
from cache.full import FullCache
from cache.registry import describe_policies
from cache.slots import SLOT_ALIGNMENT, SlotCache
from cascade.checkpoint import load_model
from tests.conftest import make_checkpoint

LAYOUT = CacheLayout(
    num_layers=2, num_kv_heads=2, head_dim=8, capacity=64, dtype=torch.float32, device=torch.device("cpu")
)

SMALL_CONFIGS = {  # every registered policy, sized so it really drops tokens on a 30-40 token test
    "full": {},
    "streaming": {"sinks": 2, "window": 16},
    "retrieval": {"budget": 16, "chunk_size": 4},
    "h2o": {"budget": 16, "recent": 4},
    "topk_oracle": {"budget": 16},
}


def test_every_policy_has_a_test_config():
    assert set(POLICIES) == set(SMALL_CONFIGS)


def test_the_policy_listing_has_a_line_per_kind_and_per_setting():
    lines = describe_policies().splitlines()
    assert len(lines) == sum(len(entry.config.model_fields) for entry in POLICIES.values())  # "kind" heads
    scoring = "    scoring: 'mean_key' | 'bound' | 'attention' | 'sparq' = 'mean_key'  How a chunk is ranked against"
    assert scoring in "\n".join(lines)


def after_prompt(kind: str, model, prompt: torch.Tensor, capacity: int = 64, restarted=None):
    """A ``kind`` policy that has seen ``prompt`` [1, T] (via a full source where it reads one)
    and decoded one committed token after it (retrieval selects its chunks there): a new one, or
    the policy ``restarted`` (and its source) emptied for it."""
    layout = model.cache_layout(capacity, max_pending=8)
    config = POLICIES[kind].config(**SMALL_CONFIGS[kind])
    if POLICIES[kind].policy.reads_source:
        source = restarted.source if restarted else FullCache(layout)
        source.restart()
        model(prompt, source)
        source.commit(source.length)
        policy = restarted or build_policy(config, layout, source)
        chunks = [prompt[:, -1:]]
    else:
        policy = restarted or build_policy(config, layout)
        chunks = [*prompt.split(8, dim=1), prompt[:, -1:]]
    policy.restart()
    for chunk in chunks:
        model(chunk, policy)
        policy.commit(policy.length)
    return policy


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return load_model(
        make_checkpoint(tmp_path_factory.mktemp("c") / "m", "llama-gqa-tied"), torch.float32, torch.device("cpu")
    )


def random_tokens(model, count: int, seed: int) -> torch.Tensor:
    return torch.randint(0, model.spec.vocab_size, (1, count), generator=torch.Generator().manual_seed(seed))


def decode_each(model, cache, tokens: torch.Tensor) -> list[torch.Tensor]:
    """Feed tokens [1, T] one pass each -> each pass's logits [1, 1, V]."""
    return [model(token[None], cache) for token in tokens[0, :, None]]


@pytest.mark.parametrize("kind", sorted(POLICIES))
def test_rollback_then_rewrite_equals_never_written(kind, tiny_model):
    prompt, tokens, rejected = (random_tokens(tiny_model, n, seed) for seed, n in enumerate((30, 6, 5)))
    clean = after_prompt(kind, tiny_model, prompt)
    expected = decode_each(tiny_model, clean, tokens)

    rolled = after_prompt(kind, tiny_model, prompt)
    tiny_model(rejected, rolled)  # speculative tokens that get rejected
    rolled.rollback(rolled.committed)
    got = decode_each(tiny_model, rolled, tokens)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


@pytest.mark.parametrize("kind", sorted(POLICIES))
def test_a_restarted_cache_equals_a_new_one(kind, tiny_model):
    first, second, tokens = (random_tokens(tiny_model, n, seed) for seed, n in enumerate((36, 26, 6)))
    new = after_prompt(kind, tiny_model, second)
    expected = decode_each(tiny_model, new, tokens)

    used = after_prompt(kind, tiny_model, first)
    tiny_model(tokens, used)  # left mid-round, with tokens neither committed nor rolled back
    restarted = after_prompt(kind, tiny_model, second, restarted=used)
    assert restarted is used
    got = decode_each(tiny_model, restarted, tokens)
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


@pytest.mark.parametrize("kind", sorted(POLICIES))
def test_commit_and_rollback_bounds(kind, tiny_model):
    cache = after_prompt(kind, tiny_model, random_tokens(tiny_model, 30, 0))
    committed = cache.committed
    tiny_model(random_tokens(tiny_model, 4, 1), cache)
    cache.commit(committed + 2)
    with pytest.raises(ValueError, match="outside"):
        cache.rollback(committed + 1)
    with pytest.raises(ValueError, match="outside"):
        cache.commit(committed + 5)
    cache.rollback(committed + 2)
    assert cache.length == committed + 2


@pytest.mark.parametrize("kind", sorted(POLICIES))
def test_capacity_is_enforced(kind, tiny_model):
    cache = after_prompt(kind, tiny_model, random_tokens(tiny_model, 30, 0), capacity=37)
    with pytest.raises(CacheFullError, match="cannot add 7 more"):
        tiny_model(random_tokens(tiny_model, 7, 1), cache)
    if isinstance(cache, SlotCache):  # its buffer is padded to aligned rows; the capacity is not
        assert cache.keys.shape[3] % SLOT_ALIGNMENT == 0 and cache.keys.shape[3] > cache.slots


def test_full_cache_views_are_bottom_right_causal_without_a_mask():
    cache = FullCache(LAYOUT)
    cache.allocate(3)
    positions = cache.allocate(2)
    view = cache.update(0, torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8), torch.zeros(1, 4, 2, 8))
    assert positions.tolist() == [3, 4]
    assert view.keys.shape == (1, 2, 5, 8)
    assert view.causal and view.mask is None  # the pass's 2 tokens are the last 2 of 5 keys
    cache.allocate(1)
    one = cache.update(0, torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), torch.zeros(1, 4, 1, 8))
    assert one.mask is None and not one.causal


def test_full_cache_reports_bytes():
    cache = FullCache(LAYOUT)
    assert cache.memory_bytes() == 2 * 2 * 2 * 64 * 8 * 4  # K and V, layers, heads, capacity, dim, fp32
    cache.allocate(10)
    assert cache.read_bytes() == 10 * LAYOUT.bytes_per_token == 10 * 2 * 2 * 2 * 8 * 4
