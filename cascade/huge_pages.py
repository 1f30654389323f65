"""A CPU model's weights and KV caches in transparent huge pages.

A decode step streams every weight once, several gigabytes for a 1.5B model, and on 4 KiB pages
the walk through the page tables costs part of the memory's speed. Linux backs memory advised with
``MADV_HUGEPAGE`` by 2 MiB pages (where transparent huge pages are ``madvise`` or ``always``):
moved there, a Qwen2.5 1.5B step at 1K on the 2-core EPYC took 102 ms instead of 114. Every tensor
moves, small ones included: one left behind would keep the whole checkpoint file mapped. Elsewhere
(no ``MADV_HUGEPAGE``) the weights stay where they are. A KV cache's slot buffers are read whole
by every long pass too, and are allocated there as well (``zeros``): one layer's attention over 32K
keys of SmolLM2 or the Qwen2.5 1.5B took 0.81-0.82 of its time on 4 KiB pages. So is the buffer the
memory-bandwidth probe reads (``cascade.limits``), so a roofline divides by what the same pages deliver.
"""

from __future__ import annotations

import math
import mmap
from pathlib import Path

import torch
from torch import nn

ALIGNMENT = 64
"""Bytes each tensor's start is aligned to in the region (a cache line)."""


def advised_region(nbytes: int) -> torch.Tensor | None:
    """A zeroed uint8 tensor [nbytes] in anonymous memory advised for huge pages, None where huge pages
    cannot be asked for. The tensor (and any view of it) keeps the region mapped while it lives."""
    if not hasattr(mmap, "MADV_HUGEPAGE") or nbytes == 0:
        return None
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)  # before the pages are touched: they fault in as huge pages
    return torch.frombuffer(region, dtype=torch.uint8)


def zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """``torch.zeros(shape, dtype, device)``, in huge pages where it is on the CPU and they can be asked for."""
    nbytes = math.prod(shape) * dtype.itemsize
    memory = advised_region(nbytes) if torch.device(device).type == "cpu" else None
    if memory is None:
        return torch.zeros(shape, dtype=dtype, device=device)
    return memory.view(dtype).view(shape)


def move_to_huge_pages(model: nn.Module) -> int:
    """Copy the model's contiguous CPU parameters and buffers into one memory region advised for huge
    pages (shared tensors stay shared) -> the bytes moved (0 where huge pages cannot be asked for)."""
    tensors = {t.data_ptr(): t for t in (*model.parameters(), *model.buffers()) if t.device.type == "cpu"}
    moving = [t for t in tensors.values() if t.nbytes and t.is_contiguous()]
    sizes = [-(-t.nbytes // ALIGNMENT) * ALIGNMENT for t in moving]
    memory = advised_region(sum(sizes))
    if memory is None:
        return 0
    offset = 0
    for tensor, size in zip(moving, sizes):
        moved = memory[offset : offset + tensor.nbytes].view(tensor.dtype).view(tensor.shape)
        moved.copy_(tensor)
        tensor.data = moved
        offset += size
    return offset


def huge_page_bytes() -> int | None:
    """This process's anonymous memory in transparent huge pages (``AnonHugePages`` of
    /proc/self/smaps_rollup), None where Linux does not report it: how much of a model's weights
    a move actually got, which sets the speed of its passes (the same 1.5B step took 68 ms in one
    process and 102 ms in others)."""
    try:
        lines = Path("/proc/self/smaps_rollup").read_text().splitlines()
    except OSError:
        return None
    sizes = [int(line.split()[1]) * 1024 for line in lines if line.startswith("AnonHugePages:")]
    return sizes[0] if sizes else None
