"""Timing device work for the stage counters and the cost model.

On CPU an op has finished when it returns, so wall-clock marks time the work. On CUDA a round's
passes are queued without the host waiting (nothing is read back until the verdict), so a
wall-clock mark taken after launching the proposals would time their launches and charge their
device time to the verification that waits for them. There a mark is a CUDA event recorded on the
current stream. A round's split is read with ``seconds`` after its verdict, which the host waits
for anyway; a timed plain step is read right after it (a wait, before its token is read anyway
at the top level, possibly a little early one level down); pass times are noted with ``add`` and
summed at ``settle``, between rounds, so the lowest stage's decoding never waits for timing.
"""

from __future__ import annotations

import time

import torch

Mark = float | torch.cuda.Event


class Clock:
    def __init__(self, device: torch.device) -> None:
        self.on_cuda = device.type == "cuda"
        self.pending: list[tuple[object, str, torch.cuda.Event, torch.cuda.Event]] = []

    def mark(self) -> Mark:
        """Now, in the order of the work queued so far."""
        if not self.on_cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def seconds(self, start: Mark, end: Mark) -> float:
        """The time from ``start`` to ``end`` (on CUDA: waits for ``end`` if it has not run)."""
        if not self.on_cuda:
            return end - start
        end.synchronize()
        return start.elapsed_time(end) / 1000

    def add(self, counters: object, name: str, start: Mark, end: Mark) -> None:
        """Add the seconds from ``start`` to ``end`` to ``counters.<name>`` (on CUDA: at ``settle``)."""
        if self.on_cuda:
            self.pending.append((counters, name, start, end))
        else:
            setattr(counters, name, getattr(counters, name) + end - start)

    def settle(self) -> None:
        """Add every pending span; call where the device has caught up (it waits if it has not)."""
        for counters, name, start, end in self.pending:
            setattr(counters, name, getattr(counters, name) + self.seconds(start, end))
        self.pending.clear()
