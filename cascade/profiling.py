"""``python -m cascade.generate --profile DIR``: the generation (not the loading) under torch.profiler.

Each stage's passes are labelled with the stage's name (``0:target/retrieval``, ...), prefill with
``prefill``, and a retrieval cache's chunk selection with ``select chunks``, so the trace shows
which pass an operator or kernel belongs to; outside a profiled run the labels cost nothing. DIR
gets ``trace.json`` (a Chrome trace: chrome://tracing or ui.perfetto.dev) and ``operators.txt``,
the operators by self time (the GPU's on CUDA, else the host's), with the labels' totals among them.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity

from cascade.errors import CascadeError

_profiling = False
"""Whether a profiled run is under way (labels are recorded only then)."""

TRACE, OPERATORS = "trace.json", "operators.txt"


def labelled(name: str) -> contextlib.AbstractContextManager:
    """A profiler range called ``name`` within a profiled run, else nothing."""
    return torch.profiler.record_function(name) if _profiling else contextlib.nullcontext()


def check_profile_dir(directory: Path) -> None:
    """Fail before any work if ``directory`` cannot take a profile (a file, or not creatable)."""
    if directory.exists() and not directory.is_dir():
        raise CascadeError(f"cannot write a profile to {directory}: it is a file; give a directory for --profile")
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise CascadeError(f"cannot create the profile directory {directory}: {exc.strerror}") from None


@contextlib.contextmanager
def profiled(directory: Path, device: torch.device) -> Iterator[None]:
    """Profile what runs inside; then write ``directory``'s trace and operator table."""
    global _profiling
    on_cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU, *([ProfilerActivity.CUDA] if on_cuda else [])]
    with torch.profiler.profile(activities=activities) as profiler:
        _profiling = True
        try:
            yield
        finally:
            _profiling = False
    profiler.export_chrome_trace(str(directory / TRACE))
    sort = "self_device_time_total" if on_cuda else "self_cpu_time_total"
    (directory / OPERATORS).write_text(profiler.key_averages().table(sort_by=sort, row_limit=60) + "\n")
