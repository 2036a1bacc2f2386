"""Reusable buffers for the temporaries of one optimizer step.

The reference pipeline (:meth:`lowp.optim.base.LowpOptimizer.apply_batch`) runs chunk after chunk
and needs the same temporaries for each: fp32 working copies, random bits, differences. Fresh
tensors for every chunk cost more than their arithmetic on a CPU: glibc serves allocations of
chunk size (about 1 MiB) from ``mmap`` or returns them to the system when they are freed at the
top of the heap (``M_MMAP_THRESHOLD`` / ``M_TRIM_THRESHOLD`` in ``mallopt(3)``), so every chunk
touches new pages and takes a page fault per 4 KiB (measured: 50 000 faults per AdamW step of 8M
parameters in chunks of 2**18). A :class:`Scratch` lives for one backend run (one group's slices
of one step) and hands out the same memory to every chunk, so the pages are faulted in once.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import torch

__all__ = ["Scratch"]


class Scratch:
    """Named flat buffers, each grown to the largest size asked for and reused by later requests.

    A request returns views of the buffer of its name, dtype and device: two temporaries that
    are alive at the same time need different names, and a view must not be used after the
    next request of its name.
    """

    def __init__(self) -> None:
        self._buffers: dict[tuple[str, torch.dtype, torch.device], torch.Tensor] = {}

    def split(self, name: str, shapes: Sequence[torch.Size | tuple[int, ...]], dtype: torch.dtype,
              device: torch.device) -> list[torch.Tensor]:
        """Non-overlapping contiguous tensors of ``shapes``, one after the other in buffer ``name``."""
        sizes = [math.prod(s) for s in shapes]
        buffer = self._buffer(name, sum(sizes), dtype, device)
        if len(sizes) == 1:
            return [buffer[:sizes[0]].view(shapes[0])]
        return [piece.view(shape) for piece, shape in zip(torch.split_with_sizes(buffer[:sum(sizes)], sizes), shapes)]

    def take(self, name: str, shape: torch.Size | tuple[int, ...], dtype: torch.dtype,
             device: torch.device) -> torch.Tensor:
        """A contiguous tensor of ``shape`` in buffer ``name``."""
        return self._buffer(name, math.prod(shape), dtype, device)[:math.prod(shape)].view(shape)

    def _buffer(self, name: str, numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        key = (name, dtype, device)
        buffer = self._buffers.get(key)
        if buffer is None or buffer.numel() < numel:
            buffer = self._buffers[key] = torch.empty(numel, dtype=dtype, device=device)
        return buffer
