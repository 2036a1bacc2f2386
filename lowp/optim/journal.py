"""Whole parameters on the reference pipeline: copies of what a batch is about to write, put back
when the batch fails part-way.

The reference pipeline (:mod:`lowp.optim.reference`) writes one batch of slices at a time, and its
writes allocate (the roundings' and the write-back's temporaries, random bits): an allocation that
fails there (out of memory, on a GPU near its limit) would leave a parameter with some elements
stepped and its step count behind, which the next step reads as if none were. A :class:`Journal`
makes each parameter stepped whole or left as it was:

- before a batch's first write, :meth:`Journal.save` copies every tensor the batch writes (its
  weights, mode buffers and states; block-scaled codes and their scales), one flat copy per dtype
  and device; should the device be out of memory for it, each tensor is copied to the host;
- when a parameter's last piece has been written (:meth:`Journal.written`), its copies are
  dropped and its id joins ``stepped`` (:attr:`~lowp.optim.slices.StepContext.stepped`), whose
  counters the step advances even when a later batch of the job fails;
- on a failure, :meth:`Journal.restore` copies the held copies back, in reverse order, with
  ``copy_`` from copies of the same dtype and shape, which allocates nothing (a host copy keeps
  its tensor's strides); distinct parameters never share memory (:mod:`lowp.optim.preflight`
  refuses them).

Memory: a batch's written bytes in their own dtypes (for AdamW with bf16 weights, states and a
Kahan buffer 8 bytes per element, against about 50 for the batch's fp32 working copies), freed
after the batch; a parameter cut into pieces over several batches keeps the copies of its pieces
until its last one is written. Time: one more read and write of the bytes written, on the device
(over the bus for what went to the host).
"""
from __future__ import annotations

from collections import Counter
from itertools import accumulate
from typing import Iterable, Sequence

import torch

__all__ = ["Journal", "note_stepped"]

_HOST = torch.device("cpu")


def _flat(tensors: list[torch.Tensor]) -> tuple[list[torch.Tensor], list[int]]:
    """Copies of ``tensors`` (one dtype and device), with the offset of each: one flat copy on
    their device (each at its offset), or, when that device is out of memory, a copy of each on
    the host in its own layout (offset -1: the whole copy), so that neither taking it nor putting
    it back needs device memory (a dense tensor's strides are kept)."""
    try:
        flat = torch.cat([t if t.dim() == 1 else t.reshape(-1) for t in tensors])
    except torch.OutOfMemoryError:
        if tensors[0].device == _HOST:
            raise
        return [t.to(_HOST, copy=True) for t in tensors], [-1] * len(tensors)
    offsets = list(accumulate((t.numel() for t in tensors), initial=0))
    return [flat] * len(tensors), offsets[:-1]


class Journal:
    """The copies of one job's writes on the reference pipeline (module docstring).

    Args:
        pieces: the parameter id of every piece the job will write, once per piece (a parameter
            cut into chunks appears once per chunk).
        stepped: the set that receives the id of each parameter whose every piece was written;
            ``None``: the caller keeps the parameters whole with a journal of its own, and this
            one copies and records nothing.
    """

    def __init__(self, pieces: Iterable[int], stepped: set[int] | None) -> None:
        self.active = stepped is not None
        self.left = Counter(pieces) if self.active else Counter()
        self.stepped: set[int] = stepped if stepped is not None else set()
        #: per parameter id: (order saved, target, copy, offset of the target's copy in it or -1)
        self.held: dict[int, list[tuple[int, torch.Tensor, torch.Tensor, int]]] = {}
        self.saved = 0

    def save(self, writes: Sequence[tuple[int, Sequence[torch.Tensor]]]) -> None:
        """Copy the tensors each piece ``(parameter id, tensors)`` of the next batch writes, before
        its first write."""
        if not self.active:
            return
        groups: dict[tuple[torch.dtype, torch.device], list[tuple[int, torch.Tensor]]] = {}
        for param_id, tensors in writes:
            for t in tensors:
                if t.numel():
                    groups.setdefault((t.dtype, t.device), []).append((param_id, t))
        for members in groups.values():
            with torch.no_grad():
                flats, offsets = _flat([t for _, t in members])
            for (param_id, t), flat, offset in zip(members, flats, offsets):
                self.held.setdefault(param_id, []).append((self.saved, t, flat, offset))
                self.saved += 1

    def written(self, param_ids: Iterable[int]) -> None:
        """Each of ``param_ids`` had one more piece written: a parameter with none left is stepped
        whole, its copies dropped."""
        if not self.active:
            return
        for param_id in param_ids:
            self.left[param_id] -= 1
            if self.left[param_id] <= 0:
                self.held.pop(param_id, None)
                self.stepped.add(param_id)

    def restore(self) -> None:
        """Put every held copy back, the last saved first, and drop them; should one fail, the
        others are still put back, then its error is raised."""
        entries = sorted((e for held in self.held.values() for e in held), key=lambda e: e[0], reverse=True)
        self.held = {}
        failed: BaseException | None = None
        with torch.no_grad():
            for _, target, flat, offset in entries:
                try:
                    target.copy_(flat if offset < 0 else flat[offset:offset + target.numel()].view(target.shape))
                except BaseException as exc:   # every other copy still goes back
                    failed = failed or exc
        if failed is not None:
            try:
                raise failed
            finally:
                failed = None


def note_stepped(exc: BaseException, done: int, planned: int) -> None:
    """Add to ``exc`` (``add_note``, Python 3.11 on) that the step failed after ``done`` of its
    ``planned`` parameters were stepped whole, when any was: the step was not a no-op. The others
    are as they were on lowp's backends; a backend of one's own that fails part-way may leave
    them otherwise."""
    add_note = getattr(exc, "add_note", None)
    if done and add_note is not None:
        add_note(f"lowp: the step failed while writing: {done} of {planned} parameters were stepped whole "
                 "(weights, states and step count), the others are as they were")
