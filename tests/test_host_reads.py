"""No host sync inside a speculation round: the lowest stage feeds each token it draws to its next
pass as a device tensor, and a greedy verification reads its verdict in one transfer.

On CPU a host read is counted where it happens: the ops that read a tensor's value into Python
(``int()``, ``.item()``, ``bool()``, ``float()`` of a tensor, ``torch.equal``) or size an output
by it (``nonzero``, boolean-mask indexing), with or without inference mode (which reaches them by
other ops), and ``Tensor.tolist``. On CUDA the same rounds run under
``torch.cuda.set_sync_debug_mode("error")``, which fails on any synchronising call.
"""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from cascade.verification import verify, verify_greedy
from tests.test_pipeline import PROMPT, SMALL_CACHES, generate, runtime_for

HOST_READ_OPS = {
    torch.ops.aten._local_scalar_dense.default,
    torch.ops.aten.item.default,
    torch.ops.aten.is_nonzero.default,
    torch.ops.aten.equal.default,
    torch.ops.aten.nonzero.default,
}
"""Each read reaches exactly one of these: in inference mode ``.item()`` arrives as ``item`` and
``bool()`` as ``is_nonzero``, outside it both as ``_local_scalar_dense``."""
MASK_INDEXING_OPS = {torch.ops.aten.index.Tensor, torch.ops.aten.index_put.default, torch.ops.aten.index_put_.default}
"""Indexing that reads the host when an index is a boolean mask (its true entries size the result)."""


class HostReads(TorchDispatchMode):
    """Counts the reads of tensor values into Python while active."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        super().__init__()
        self.count = 0
        tolist = torch.Tensor.tolist

        def counted_tolist(tensor):
            self.count += 1
            return tolist(tensor)

        monkeypatch.setattr(torch.Tensor, "tolist", counted_tolist)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        masked = func in MASK_INDEXING_OPS and any(index is not None and index.dtype == torch.bool for index in args[1])
        self.count += func in HOST_READ_OPS or masked
        return func(*args, **(kwargs or {}))


def reads_per_call(pipeline, method: str, monkeypatch: pytest.MonkeyPatch, reads: HostReads) -> list[int]:
    """Host reads during each call of ``pipeline``'s ``method``, filled in as it generates."""
    counts, run = [], getattr(pipeline, method)

    def counted(*args):
        before = reads.count
        result = run(*args)
        counts.append(reads.count - before)
        return result

    monkeypatch.setattr(pipeline, method, counted)
    return counts


RESELECTING = ["stages.0.cache.scoring=attention", "stages.0.cache.refresh.every=1"]
"""``self-spec`` whose retrieval stage re-selects its chunks on the first pass of every round."""
SELECTING_EVERY_PASS = [
    "stages.0.cache.scoring=sparq",
    "stages.0.cache.query_dims=8",
    "stages.0.cache.refresh=every_pass",
]
FIXED = ["stages.0.schedule=fixed"]
"""Rounds at the configured gamma throughout: the cost model would bypass a tiny model's stages, whose
proposals cost as much as the verifier's steps, after their first round."""
TREE = ["stages.0.tree.nodes=10"]
SELF_SPEC = SMALL_CACHES["self-spec"] + FIXED
CASES = {
    "triforce": ("triforce", SMALL_CACHES["triforce"] + FIXED + ["stages.1.schedule=fixed"]),
    "self-spec": ("self-spec", SELF_SPEC),
    "self-spec-reselecting": ("self-spec", SELF_SPEC + RESELECTING),
    "self-spec-selecting-every-pass": ("self-spec", SELF_SPEC + SELECTING_EVERY_PASS),
    "self-spec-tree": ("self-spec", SELF_SPEC + SELECTING_EVERY_PASS + TREE),
    "self-spec-dynamic-tree": ("self-spec", SELF_SPEC + TREE + ["stages.0.tree.dynamic=true"]),
}
DECODES = {"self-spec-tree": "_propose_tree", "self-spec-dynamic-tree": "_propose_tree"}
"""How each case's lowest stage decodes its proposals when not by ``_decode``."""


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_the_lowest_stage_decodes_a_round_without_host_reads(case, temperature, tiny_dir, tiny_draft_dir, monkeypatch):
    preset, overrides = CASES[case]
    runtime = runtime_for(
        preset, tiny_dir, tiny_draft_dir, overrides, kernels="eager", **{"sampling.temperature": temperature}
    )
    pipeline = runtime.pipeline_for(len(PROMPT), 24)
    reads = HostReads(monkeypatch)
    counts = reads_per_call(pipeline, DECODES.get(case, "_decode"), monkeypatch, reads)
    with reads:
        result = generate(runtime, PROMPT, 24, pipeline=pipeline)
    assert len(result.token_ids) == 24
    assert len(counts) >= 4 and reads.count > 0  # it decoded, and reads elsewhere are seen
    assert counts == [0] * len(counts)


@pytest.mark.parametrize("case", ["self-spec-tree", "self-spec-dynamic-tree"])
@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_a_token_tree_round_reads_the_host_once(temperature, case, tiny_dir, tiny_draft_dir, monkeypatch):
    """Its nodes and their parents, the verifier's choices and the proposer's ranks of them, in one transfer."""
    preset, overrides = CASES[case]
    runtime = runtime_for(
        preset, tiny_dir, tiny_draft_dir, overrides, kernels="eager", **{"sampling.temperature": temperature}
    )
    pipeline = runtime.pipeline_for(len(PROMPT), 24)
    reads = HostReads(monkeypatch)
    counts = reads_per_call(pipeline, "_speculate_tree", monkeypatch, reads)
    with reads:
        generate(runtime, PROMPT, 24, pipeline=pipeline)
    assert len(counts) >= 4 and counts == [1] * len(counts)


@pytest.mark.parametrize("inference", [False, True])
def test_every_kind_of_host_read_is_counted_once_in_and_out_of_inference_mode(inference, monkeypatch):
    value = torch.tensor([1.0, -1.0])
    reads = HostReads(monkeypatch)
    with torch.inference_mode(inference), reads:
        value[0].item(), int(value[0]), float(value[0]), bool(value[0]), torch.equal(value, value)
        value[value > 0], value.nonzero(), [1, 2][value[0].long()], value.tolist()
        value.clone()[value < 0] = 0.0
        value * 2 + 1, value[torch.tensor([1, 0])]  # no reads: arithmetic, indexing by positions
    assert reads.count == 10


def test_a_greedy_verdict_is_read_in_one_transfer(monkeypatch):
    draft = torch.tensor([5, 7, 9, 2])
    target = torch.tensor([5, 7, 3, 2, 8])  # argmaxes: the third proposal is rejected, 3 recovered
    reads = HostReads(monkeypatch)
    with reads:
        verdict = verify_greedy(draft, target)
    assert (verdict.accepted, verdict.next_token) == (2, 3)
    assert reads.count == 1


@pytest.mark.parametrize("target_row", [[0.0, 0.0, 1.0], [1.0, 0.0, 0.0]])  # a rejection; all accepted
def test_a_sampled_verdict_is_read_in_one_transfer(target_row, monkeypatch):
    draft_probs = torch.tensor([[1.0, 0.0, 0.0], [1.0, 0.0, 0.0]])  # [G=2, V=3]
    target_probs = torch.tensor([[1.0, 0.0, 0.0], target_row, [0.0, 1.0, 0.0]])  # [G + 1, V]
    reads = HostReads(monkeypatch)
    with reads:
        verdict = verify(torch.tensor([0, 0]), draft_probs, target_probs, torch.tensor([0.5, 0.5]), None)
    assert (verdict.accepted, verdict.next_token) == ((1, 2) if target_row[2] else (2, 1))
    assert reads.count == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("case", list(CASES))
def test_the_lowest_stage_decodes_without_syncing_on_cuda(case, tiny_dir, tiny_draft_dir, monkeypatch):
    preset, overrides = CASES[case]
    runtime = runtime_for(preset, tiny_dir, tiny_draft_dir, overrides)
    pipeline = runtime.pipeline_for(len(PROMPT), 24)
    method = DECODES.get(case, "_decode")
    decode = getattr(pipeline, method)

    def strict_decode(*args):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            return decode(*args)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    monkeypatch.setattr(pipeline, method, strict_decode)
    assert len(generate(runtime, PROMPT, 24, pipeline=pipeline).token_ids) == 24
