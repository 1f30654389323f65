"""Weights moved into huge-page memory: the same model, tied weights still tied; KV buffers allocated there."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

from cache.base import CacheLayout
from cache.full import FullCache
from cascade import huge_pages
from cascade.checkpoint import load_model
from cascade.huge_pages import huge_page_bytes, move_to_huge_pages
from tests.test_model import CPU, our_logits


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")
def test_moved_weights_give_the_same_logits_and_tied_weights_stay_tied(tiny_dir):
    model = load_model(tiny_dir, torch.float32, CPU)
    assert model.lm_head.weight is model.embed_tokens.weight
    token_ids = torch.arange(40)
    before = our_logits(model, token_ids)
    before_moving = {t.data_ptr() for t in (*model.parameters(), *model.buffers())}
    moved = move_to_huge_pages(model)
    assert moved >= sum(t.nbytes for t in model.parameters())
    assert not before_moving & {t.data_ptr() for t in (*model.parameters(), *model.buffers())}  # every tensor moved
    assert model.lm_head.weight is model.embed_tokens.weight
    assert torch.equal(our_logits(model, token_ids), before)


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="Linux reports no AnonHugePages here")
def test_the_bytes_in_huge_pages_are_read_from_the_kernels_report():
    held = huge_page_bytes()
    assert isinstance(held, int) and held >= 0 and held % 4096 == 0


@pytest.mark.skipif(not hasattr(mmap, "MADV_HUGEPAGE"), reason="no MADV_HUGEPAGE on this platform")
def test_zeros_in_huge_pages_are_zeros_that_own_their_memory():
    first = huge_pages.zeros((3, 5, 7), torch.bfloat16, CPU)
    second = huge_pages.zeros((3, 5, 7), torch.bfloat16, CPU)
    assert first.shape == (3, 5, 7) and first.dtype == torch.bfloat16 and not first.any()
    first.fill_(2.0)  # writable, and not shared with another buffer
    assert not second.any() and bool((first == 2.0).all())


def test_a_cpu_kv_buffer_comes_from_the_huge_page_region(monkeypatch):
    asked = []
    real = huge_pages.zeros
    monkeypatch.setattr(huge_pages, "zeros", lambda *args: asked.append(args) or real(*args))
    layout = CacheLayout(num_layers=2, num_kv_heads=3, head_dim=8, capacity=100, dtype=torch.bfloat16, device=CPU)
    cache = FullCache(layout)
    assert len(asked) == 2 and cache.keys.shape == cache.values.shape == (2, 1, 3, 128, 8)
    assert not cache.keys.any() and cache.keys.data_ptr() != cache.values.data_ptr()
