"""Weights moved into huge-page memory: the same model, tied weights still tied."""

from __future__ import annotations

import mmap
from pathlib import Path

import pytest
import torch

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
