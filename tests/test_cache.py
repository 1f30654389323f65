"""The cache-policy contract, checked for every registered policy."""

from __future__ import annotations

import pytest
import torch

from cache import POLICIES, CacheFullError, CacheLayout, build_policy
from cascade.checkpoint import load_model
from tests.conftest import make_checkpoint

LAYOUT = CacheLayout(num_layers=2, num_kv_heads=2, head_dim=8, capacity=64, dtype=torch.float32,
                     device=torch.device("cpu"))


def policy(kind: str, layout: CacheLayout = LAYOUT):
    return build_policy(POLICIES[kind].config(), layout)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return load_model(make_checkpoint(tmp_path_factory.mktemp("c") / "m", "llama-gqa-tied"),
                      torch.float32, torch.device("cpu"))


@pytest.mark.parametrize("kind", sorted(POLICIES))
def test_rollback_then_rewrite_equals_never_written(kind, tiny_model):
    tokens = torch.randint(0, tiny_model.spec.vocab_size, (1, 40), generator=torch.Generator().manual_seed(0))
    rejected = torch.randint(0, tiny_model.spec.vocab_size, (1, 5), generator=torch.Generator().manual_seed(1))
    layout = tiny_model.cache_layout(64)

    clean = build_policy(POLICIES[kind].config(), layout)
    tiny_model(tokens[:, :30], clean)
    expected = tiny_model(tokens[:, 30:], clean)

    rolled = build_policy(POLICIES[kind].config(), layout)
    tiny_model(tokens[:, :30], rolled)
    rolled.commit(30)
    tiny_model(rejected, rolled)  # speculative tokens that get rejected
    rolled.rollback(30)
    torch.testing.assert_close(tiny_model(tokens[:, 30:], rolled), expected, atol=0, rtol=0)


@pytest.mark.parametrize("kind", sorted(POLICIES))
def test_capacity_is_enforced(kind):
    cache = policy(kind)
    cache.allocate(60)
    with pytest.raises(CacheFullError, match="cannot add 5 more"):
        cache.allocate(5)


@pytest.mark.parametrize("kind", sorted(POLICIES))
def test_rollback_never_goes_below_committed(kind):
    cache = policy(kind)
    cache.allocate(10)
    cache.commit(8)
    with pytest.raises(ValueError, match="outside"):
        cache.rollback(7)
    with pytest.raises(ValueError, match="outside"):
        cache.commit(11)
    cache.rollback(8)
    assert cache.length == 8


def test_full_cache_masks_are_bottom_right_causal():
    cache = policy("full")
    cache.allocate(3)
    positions = cache.allocate(2)
    view = cache.update(0, torch.zeros(1, 2, 2, 8), torch.zeros(1, 2, 2, 8), torch.zeros(1, 4, 2, 8))
    assert positions.tolist() == [3, 4]
    assert view.keys.shape == (1, 2, 5, 8)
    assert (view.mask == 0).tolist() == [[True] * 4 + [False], [True] * 5]
    assert view.causal and view.mask[0, 4] == float("-inf")
    cache.allocate(1)
    assert cache.update(0, torch.zeros(1, 2, 1, 8), torch.zeros(1, 2, 1, 8), torch.zeros(1, 4, 1, 8)).mask is None


def test_full_cache_reports_bytes():
    cache = policy("full")
    assert cache.memory_bytes() == 2 * 2 * 2 * 64 * 8 * 4  # K and V, layers, heads, capacity, dim, fp32
    cache.allocate(10)
    assert cache.read_bytes() == 10 * LAYOUT.bytes_per_token == 10 * 2 * 2 * 2 * 8 * 4
