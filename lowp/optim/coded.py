"""A step over parameters with block-scaled states (:mod:`lowp.optim.codes`).

Every backend updates fp32, bf16 and fp16 states; coded states reach it decoded. The step cuts
each parameter into pieces of whole blocks, decodes the coded states of a batch of pieces into
fp32, runs the backend on the batch (its kernel stores fp32 states exactly), then encodes them
back, rounding with the state's own random stream (``Stream.STATE + j`` for the ``j``-th state,
the stream a 16-bit state would round with; the backend draws nothing from it for an fp32
state). A piece and a batch hold at most the backend's ``chunk_size`` elements (rounded down to
whole blocks of the largest size), so the decoded fp32 copies of one batch are the only extra
memory, as for the backend's own fp32 working copies.

The pieces of a parameter do not change the result (every block is encoded from its own values
with the random bits of its own elements), so the step is the same on every backend, for any
chunk size, bit for bit.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lowp.optim.codes import BLOCK_SIZES, Code, decode, encode
from lowp.optim.randomness import Stream
from lowp.optim.slices import ParamSlice, StepContext

if TYPE_CHECKING:
    from lowp.optim.backends import Backend, LowpOptimizer

__all__ = ["CodedState", "run_coded"]


@dataclass(frozen=True)
class CodedState:
    """A coded state of a step: its name, its position in the state order (which picks its
    random stream) and its code.

    Args:
        name: the state's name.
        position: its index in the optimizer's state order.
        code: its :class:`~lowp.optim.codes.Code`.
    """

    name: str
    position: int
    code: Code


@dataclass
class _Piece:
    """Elements ``[start, end)`` of a slice, ready for the backend, with where to encode them."""

    plain: ParamSlice
    source: ParamSlice
    scales: dict[str, torch.Tensor]
    start: int
    end: int


def _piece(s: ParamSlice, scales: dict[str, torch.Tensor], coded: list[CodedState], block: int, start: int,
           end: int, whole: bool) -> _Piece:
    """Elements ``[start, end)`` of ``s`` (all of it when ``whole``) with its coded states decoded."""
    def part(t: torch.Tensor) -> torch.Tensor:
        return t if whole else t.view(-1)[start:end]

    names = {c.name: c for c in coded}
    states = {}
    for name, t in s.states.items():
        c = names.get(name)
        if c is None:
            states[name] = part(t)
            continue
        codes = t.view(-1)[start // 2:(end + 1) // 2] if c.code.bits == 4 else t.view(-1)[start:end]
        blocks = scales[name][start // block:(end + block - 1) // block]
        fp32 = decode(codes, blocks, c.code, block, end - start)
        states[name] = fp32.view(s.param.shape) if whole else fp32
    grad = s.grad if whole else s.grad.reshape(-1)[start:end]
    buffer = None if s.buffer is None else part(s.buffer)
    plain = ParamSlice(part(s.param), grad, states, buffer, s.param_id, s.index.shifted(start))
    return _Piece(plain, s, scales, start, end)


def _encode(ctx: StepContext, piece: _Piece, coded: list[CodedState], block: int) -> None:
    """Encode the decoded states of ``piece`` back into its slice's codes and scales."""
    stochastic = ctx.group["state_rounding"] == "stochastic"
    streams = ctx.streams(piece.plain)
    start, end = piece.start, piece.end
    for c in coded:
        codes = piece.source.states[c.name].view(-1)
        codes = codes[start // 2:(end + 1) // 2] if c.code.bits == 4 else codes[start:end]
        noise = streams.bits(Stream.STATE + c.position, (end - start,), codes.device) if stochastic else None
        encode(piece.plain.states[c.name], c.code, block, codes,
               piece.scales[c.name][start // block:(end + block - 1) // block], noise)


def run_coded(backend: "Backend", optimizer: "LowpOptimizer", ctx: StepContext, slices: list[ParamSlice],
              scales: list[dict[str, torch.Tensor]], coded: list[CodedState], elementwise: bool
              ) -> torch.Tensor | None:
    """Run ``backend`` on ``slices`` whose states named in ``coded`` are codes (``scales[i]``:
    the block scales of slice ``i`` by state name); see the module docstring. A parameter is cut
    into pieces only when the optimizer is ``elementwise`` and the parameter contiguous. Returns
    the stalled count (``None`` when ``ctx.count`` is false)."""
    block = ctx.group["state_block"]
    whole_blocks = max(BLOCK_SIZES)
    chunk = max(whole_blocks, backend.chunk_size - backend.chunk_size % whole_blocks)
    counts: list[torch.Tensor] = []
    batch: list[_Piece] = []
    held = 0

    def flush() -> None:
        nonlocal held
        if not batch:
            return
        stalled = backend.run(optimizer, ctx, [p.plain for p in batch])
        if stalled is not None:
            counts.append(stalled)
        for p in batch:
            _encode(ctx, p, coded, block)
        batch.clear()
        held = 0

    for s, sc in zip(slices, scales):
        n, flat = s.numel, s.param.is_contiguous()
        bounds = [(a, min(a + chunk, n)) for a in range(0, n, chunk)] if flat and elementwise else [(0, n)]
        for start, end in bounds:
            batch.append(_piece(s, sc, coded, block, start, end, whole=not flat))
            held += end - start
            if held >= chunk:
                flush()
    flush()
    if not ctx.count:
        return None
    return torch.stack(counts).sum() if counts else torch.zeros((), dtype=torch.int64)
