"""Stage timing: wall-clock on CPU, CUDA events read only once the device has caught up."""

from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from cascade.clock import Clock


def test_on_cpu_a_span_is_added_at_once():
    clock = Clock(torch.device("cpu"))
    counters = SimpleNamespace(busy_s=1.0)
    start = clock.mark()
    time.sleep(0.01)
    clock.add(counters, "busy_s", start, clock.mark())
    assert 1.01 <= counters.busy_s < 2.0
    assert not clock.pending


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_cuda_a_span_is_device_time_added_at_settle_without_syncing_before():
    clock = Clock(torch.device("cuda"))
    counters = SimpleNamespace(busy_s=0.0)
    x = torch.randn(4096, 4096, device="cuda")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        launched = time.perf_counter()
        start = clock.mark()
        for _ in range(50):
            x = torch.tanh(x @ x)
        clock.add(counters, "busy_s", start, clock.mark())
        launched = time.perf_counter() - launched
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert counters.busy_s == 0.0 and len(clock.pending) == 1
    clock.settle()
    assert counters.busy_s > launched  # the matmuls' device time, not the launches'
    assert not clock.pending
