"""A step over parameters with block-scaled states (:mod:`lowp.optim.codes`): the part of
:meth:`lowp.optim.backends.Backend.step` for a job whose context names coded states.

Every backend updates fp32, bf16 and fp16 states; coded states reach it decoded, unless its
kernel takes them as they are (:meth:`~lowp.optim.backends.Backend.take_coded`). The step cuts
each parameter into pieces of whole blocks, decodes the coded states of a batch of pieces into
fp32, runs the backend on the batch (its kernel stores fp32 states exactly), then encodes them
back, rounding with the state's own random stream (``Stream.STATE + j`` for the ``j``-th state,
the stream a 16-bit state would round with; the backend draws nothing from it for an fp32
state). A piece holds at most ``chunk`` elements (the backend's ``chunk_size`` rounded down to
whole blocks of the largest size, at least one such block; a non-contiguous parameter is one
piece), and a batch is run as soon as it holds ``chunk`` elements or more (so less than twice
that), so the decoded fp32 copies of one batch are the only extra memory, as for the backend's
own fp32 working copies, besides the copies that keep each parameter whole should a batch fail
part-way (its weights, buffers, codes and scales; :mod:`lowp.optim.journal`): a parameter
counts the step once its last piece is encoded.

The pieces of a parameter do not change the result (every block is encoded from its own values
with the random bits of its own elements), so the step is the same on every backend, for any
chunk size, bit for bit.

On the CPU the decode and encode passes take the native codec
(:mod:`lowp.optim.kernels.native.codec`: one C++ call per state and batch, the fp32 copies in the
step's scratch buffers) where it builds, and a backend may run all three inside its kernel
(:meth:`~lowp.optim.backends.Backend.take_coded`: ``backend="native"`` for the slices
:mod:`lowp.optim.kernels.coded_slices` admits, ``backend="triton"`` likewise on CUDA); the
torch functions of :mod:`lowp.optim.codes` are the definition and the path for everything else.
"""
from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Protocol

import torch

from lowp.optim.codes import BLOCK_SIZES, SCALE_DTYPES, decode, encode
from lowp.optim.journal import Journal
from lowp.optim.kernels.native import codec as native_codec
from lowp.optim.kernels.checks import kernel_memory
from lowp.optim.randomness import Stream
from lowp.optim.slices import CodedState, ParamSlice, StepContext
from lowp.optim.stalled import Stalled, added

__all__ = ["run_coded", "load_codec", "Stepper"]


class Stepper(Protocol):
    """What :func:`run_coded` asks of the backend it runs (:class:`lowp.optim.backends.Backend`,
    which imports this module)."""

    def chunk_for(self, device: torch.device) -> int:
        """The chunk size for tensors on ``device``."""

    def take_coded(self, optimizer: Any, ctx: StepContext, slices: list[ParamSlice]
                   ) -> tuple[Callable[[], Stalled] | None, list[ParamSlice]]:
        """The slices its kernel steps with their codes: (their prepared step, the others)."""

    def run(self, optimizer: Any, ctx: StepContext, slices: list[ParamSlice]) -> Stalled:
        """The step over slices of plain states."""


@dataclass
class _Piece:
    """Elements ``[start, end)`` of a slice (all of it, in its shape, when ``whole``) with the
    block scales of its coded states (flat)."""

    source: ParamSlice
    scales: dict[str, torch.Tensor]
    start: int
    end: int
    whole: bool

    def part(self, t: torch.Tensor) -> torch.Tensor:
        """This piece of ``t``, a tensor of the slice's shape."""
        return t if self.whole else t.view(-1)[self.start:self.end]

    def codes(self, c: CodedState, block: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The codes and block scales of coded state ``c`` in this piece."""
        t = self.source.states[c.name].view(-1)   # flat, whatever shape the codes keep
        if not self.whole:
            t = t[self.start // 2:(self.end + 1) // 2] if c.code.bits == 4 else t[self.start:self.end]
        blocks = self.scales[c.name][self.start // block:(self.end + block - 1) // block]
        return t, blocks


def _written(ctx: StepContext, piece: _Piece, coded: list[CodedState], block: int) -> list[torch.Tensor]:
    """What the step writes of ``piece``: its weight and buffer (unless the step is states-only),
    the codes and block scales of its coded states, its part of the plain ones."""
    s = piece.source
    out = [piece.part(s.param), *([piece.part(s.buffer)] if s.buffer is not None else [])] \
        if ctx.update_weights else []
    by_name = {c.name: c for c in coded}
    for name, t in s.states.items():
        out += list(piece.codes(by_name[name], block)) if name in by_name else [piece.part(t)]
    return out


def _native(pieces: list[_Piece], coded: list[CodedState], block: int) -> bool:
    """Whether the native codec takes the coded states of ``pieces``: it is available and every
    code and scale tensor is CPU kernel memory (:func:`~lowp.optim.kernels.checks.kernel_memory`)."""
    if not native_codec.available():
        return False
    for p in pieces:
        for c in coded:
            codes, scales = p.codes(c, block)
            if not (codes.is_cpu and kernel_memory(codes, (c.code.storage,))
                    and kernel_memory(scales, SCALE_DTYPES)):
                return False
    return True


def _decode(ctx: StepContext, pieces: list[_Piece], coded: list[CodedState], block: int, native: bool
            ) -> list[ParamSlice]:
    """The slices the backend runs: ``pieces`` with their coded states decoded into fp32 buffers
    of ``ctx.scratch``."""
    device = pieces[0].source.param.device
    sizes = [(p.end - p.start,) for p in pieces]
    decoded = {c.name: ctx.scratch.split(f"coded {c.name}", sizes, torch.float32, device) for c in coded}
    for c in coded:
        outs = decoded[c.name]
        if native:
            native_codec.decode_many([native_codec.Decoding(*p.codes(c, block), out) for p, out in zip(pieces, outs)],
                                     c.code, block)
        else:
            for p, out in zip(pieces, outs):
                decode(*p.codes(c, block), c.code, block, p.end - p.start, out=out)
    plain = []
    for k, p in enumerate(pieces):
        s = p.source
        states = {}
        for name, t in s.states.items():
            if name not in decoded:
                states[name] = p.part(t)
            else:
                states[name] = decoded[name][k].view(s.param.shape) if p.whole else decoded[name][k]
        grad = s.grad if p.whole else s.grad.reshape(-1)[p.start:p.end]
        buffer = None if s.buffer is None else p.part(s.buffer)
        plain.append(ParamSlice(p.part(s.param), grad, states, buffer, s.param_id, s.index.shifted(p.start)))
    return plain


def _encode(ctx: StepContext, pieces: list[_Piece], plain: list[ParamSlice], coded: list[CodedState], block: int,
            native: bool) -> None:
    """Encode the decoded states of ``plain`` back into the codes and scales of ``pieces``,
    rounding with the state's own random stream."""
    stochastic = ctx.group["state_rounding"] == "stochastic"
    streams = [ctx.streams(q) for q in plain]
    for c in coded:
        stream = Stream.STATE + c.position
        jobs = []
        for p, q, st in zip(pieces, plain, streams):
            values, (codes, scales), n = q.states[c.name], p.codes(c, block), p.end - p.start
            if not native:
                noise = st.bits(stream, (n,), codes.device) if stochastic else None
                encode(values, c.code, block, codes, scales, noise)
                continue
            index = q.index
            bits: native_codec.Noise = None
            if stochastic:
                bits = (native_codec.CountedBits(index.first(), st.key(stream)) if index.contiguous
                        else st.bits(stream, (n,), codes.device))
            jobs.append(native_codec.Encoding(values, codes, scales, bits))
        if jobs:
            native_codec.encode_many(jobs, c.code, block)


def load_codec(slices: list[ParamSlice]) -> None:
    """Load the native codec's library now when :func:`run_coded` may call it for ``slices`` (CPU
    memory, the codec available here), before the step's first write
    (:meth:`~lowp.optim.backends.Backend.prepare`)."""
    if any(s.param.device.type == "cpu" for s in slices) and native_codec.available():
        native_codec.load()


def run_coded(backend: Stepper, optimizer: Any, ctx: StepContext, slices: list[ParamSlice],
              taken: Callable[[], Stalled] | None = None) -> Stalled:
    """Run ``backend`` on ``slices`` whose states named in ``ctx.coded`` are codes (each slice
    with their block scales); see the module docstring. ``taken``: the prepared step of the
    slices the backend's kernel takes with their codes (:meth:`Stepper.take_coded`, which left
    ``slices``), run first. A parameter is cut into pieces only when the optimizer is elementwise
    and the parameter contiguous. Returns the stalled count (``None`` when ``ctx.count`` is
    false)."""
    coded = list(ctx.coded)
    block = ctx.group["state_block"]
    whole_blocks = max(BLOCK_SIZES)
    size = backend.chunk_for(slices[0].param.device) if slices else 1
    chunk = max(whole_blocks, size - size % whole_blocks)
    count = taken() if taken is not None else None
    pieces = []
    for s in slices:
        n, flat = s.numel, s.param.is_contiguous()
        bounds = [(a, min(a + chunk, n)) for a in range(0, n, chunk)] if flat and optimizer.elementwise else [(0, n)]
        pieces += [_Piece(s, s.scales, start, end, whole=not flat) for start, end in bounds]
    # the same scratch: the backend sees plain states; this journal keeps them whole, not the backend's
    decoded = replace(ctx, coded=(), stepped=None)
    if ctx.stepped is not None:
        ctx.stepped.update(s.param_id for s in slices if not s.numel)   # nothing to write
    journal = Journal((p.source.param_id for p in pieces), ctx.stepped)
    batch: list[_Piece] = []

    def flush() -> None:
        nonlocal count
        if not batch:
            return
        journal.save([(p.source.param_id, _written(ctx, p, coded, block)) for p in batch])
        native = _native(batch, coded, block)
        plain = _decode(ctx, batch, coded, block, native)
        stalled = backend.run(optimizer, decoded, plain)
        _encode(ctx, batch, plain, coded, block, native)
        count = added([count, stalled])   # before the batch counts as written
        journal.written(p.source.param_id for p in batch)
        batch.clear()

    try:
        held = 0
        for piece in pieces:
            batch.append(piece)
            held += piece.end - piece.start
            if held >= chunk:
                flush()
                held = 0
        flush()
    except BaseException:
        journal.restore()
        raise
    if not ctx.count:
        return None
    return count if count is not None else 0
