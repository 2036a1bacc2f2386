"""DDP communication hook with an 8-bit wire, fp32 accumulation and error feedback.

``ddp.register_comm_hook(state, compressed_hook)`` with a :class:`CompressedState` whose
``module`` is the DDP model's module (:func:`register_compressed_hook` does both). Per bucket and
rank ``r`` of ``R``::

    v_r     = g_r + e_r                                   e_r: this rank's residual (0 at first)
    send_r  = encode(v_r, scatter)                        lowp.distributed.wire
    e_r    <- v_r - decode(send_r)                        (error feedback; stored in residual_dtype)
    all_to_all_single of the packed uint8 buffers        (rank k receives every rank's shard k)
    m_k     = fl32(fl32(sum_{r in rank order} decode(send_r)[shard k]) / R)   (fp32 sum, fp32 divide)
    u_k     = m_k + f_k                                   f_k: the owner's residual of the gather
    f_k    <- u_k - decode(encode(u_k, gather))
    all_gather of the packed buffers; every rank decodes the full mean, returned in the bucket dtype.

Error feedback (Seide et al. 2014, "1-bit SGD"; Karimireddy et al. 2019, "Error Feedback Fixes
SignSGD") sends next time what the compression lost this time, so the compression error does not
accumulate in the parameters: the sum of the reduced gradients over T steps differs from the sum
of the exact means by the last residuals only, instead of by T compression errors.

Layout. Each parameter's elements sit in the wire layout at a multiple of ``B`` (the larger block
of the two wire formats) and are padded with zeros to a multiple of ``B``; the layout is cut into
``R`` shards of whole blocks. So every block holds elements of one parameter only, block ``j`` of
a parameter is the same elements whatever the bucket, and the stochastic-rounding bits are
counter-based functions of ``(seed, the parameter's reduction count, parameter index, stream,
element index in the parameter)``: **the reduced gradient of every element does not depend on how
DDP groups parameters into buckets** (bucket size, DDP's bucket rebuild after the first
iteration, a fresh process after a resume), which the tests check bit for bit.

Residuals live **per parameter**, keyed by the parameter's position in ``list(state.module.parameters())``
(found through ``bucket.parameters()``), as flat tensors of ``residual_dtype`` on each rank:
``state.residuals[i]`` (the rank's scatter residual, every element) and
``state.gather_residuals[i]`` (the gather residual, non-zero only where this rank owned the
element at the parameter's last reduction). When the owners change (DDP's bucket rebuild, a
resume) the hook first moves the gather residuals to their new owners with one fp32 all-reduce
of the bucket's gather residuals (exact: each element is non-zero on one rank at most). Memory:
two residual tensors the size of the gradients per rank.

Non-finite gradients: a NaN or inf on any rank makes its block's scale NaN, so the mean of that
block is NaN on every rank (a lowp optimizer's non-finite policy skips the parameter); when the
decoded mean of a bucket holds any non-finite value, no residual of that bucket is updated on any
rank (every rank sees the same decoded mean, so they decide alike).

Overlap: with ``overlap=True`` the hook starts its first collective (the ranks' agreement) with
``async_op=True`` and returns a future completed from the collectives' own futures (the all-to-all
and the all-gather are started from their predecessors' callbacks), so it returns before its
collectives finish and DDP's backward goes on. The next bucket's hook waits until this bucket's
last collective has been *started* (gloo and NCCL pair collectives by the order they are issued
on each rank). The values are the synchronous path's, bit for bit.

Checkpointing: :meth:`CompressedState.state_dict` holds this rank's residuals, the reduction
counts, the call counter, the formats and the world size; save one file per rank with
``torch.save``. :meth:`CompressedState.load_state_dict` refuses (``ValueError``) a checkpoint from
a different world size (the residuals are per rank: a rank-count change is not handled), from a
different rank, with other wire formats, feedback or seed, or with a residual whose shape is not
its parameter's.

Bytes per rank and call (counted in ``state.wire_bytes`` from the buffers given to the
collectives): ``(R - 1) * (wire_bytes(scatter, S) + wire_bytes(gather, S))`` with ``S`` the shard
length, about ``2 (R-1)/R * n * 1.03`` for the default fp8 e4m3 / 32 x e8m0 formats, 0.52 x a bf16
ring all-reduce's ``2 (R-1)/R * n * 2``; plus ``state.control_bytes``: the agreement's
``(R - 1) * 56`` bytes per bucket, and ``state.move_bytes``: the gather-residual moves after a
layout change (DDP's bucket rebuild after the first iteration, a resume).

(No ``from __future__ import annotations``: DDP compares the hook's annotations with
``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` as objects.)
"""
import operator
import threading
from dataclasses import asdict, dataclass, field
from typing import Any, Optional

import torch
import torch.distributed as dist

from lowp.distributed.hooks import (Setting, _agree, _agreement_check, _agreement_table, _all_gather, _collective,
                                    _done, _renamed, check_bucket, check_seed_and_calls)
from lowp.distributed.wire import ELEMENTS, ROUNDINGS, SCALES, WireFormat, decode, encode, wire_bytes

__all__ = ["CompressedState", "compressed_hook", "register_compressed_hook"]

HOOK = "compressed_hook"
_RESIDUAL_DTYPES = (torch.float32, torch.bfloat16)
_BUCKET_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_GATHER_STREAM = 0          # stochastic-rounding streams: the gather's, then 1 + rank for the scatters
_FORMAT_VERSION = "lowp.compressed/1"


@dataclass
class CompressedState:
    """Configuration, residuals and counters of :func:`compressed_hook` (one per DDP model).

    Args:
        process_group: group of the collectives (``None``: the default group).
        scatter: :class:`~lowp.distributed.wire.WireFormat` of the reduce-scatter (default: fp8
            e4m3, blocks of 32 with e8m0 scales, nearest).
        gather: wire format of the all-gather of the reduced shards (default ``None``: ``scatter``).
        error_feedback: keep what compression lost and add it to the next gradient (default True).
        residual_dtype: ``torch.float32`` (default) or ``torch.bfloat16`` (half the memory; the
            residual itself is then rounded to nearest).
        seed: base of the stochastic-rounding keys, an int (default 0).
        overlap: return before the collectives finish (default False); same values.
        module: the DDP model's module, whose ``parameters()`` order keys the residuals (required
            before the first call; :func:`register_compressed_hook` sets it).
        calls: hook calls so far (counted).
        residuals: parameter index -> flat residual of the reduce-scatter's compression (filled by
            the hook).
        gather_residuals: parameter index -> flat residual of the all-gather's compression, nonzero
            on the elements this rank owns (filled by the hook).
        steps: parameter index -> reductions so far (keys of its stochastic-rounding streams).
        wire_bytes: bytes this rank sent in the data collectives (``(R-1)`` x its piece each).
        control_bytes: bytes this rank sent in the ranks' agreement (``(R-1) * 56`` per bucket and call).
        move_bytes: bytes this rank sent moving gather residuals to new owners (an fp32 all-reduce
            of the bucket, counted as ``(R-1) * 4`` bytes per element; only after a layout change).
    """

    process_group: Optional[dist.ProcessGroup] = None
    scatter: WireFormat = field(default_factory=WireFormat)
    gather: Optional[WireFormat] = None
    error_feedback: bool = True
    residual_dtype: torch.dtype = torch.float32
    seed: int = 0
    overlap: bool = False
    module: Optional[torch.nn.Module] = None
    calls: int = 0
    residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    gather_residuals: dict[int, torch.Tensor] = field(default_factory=dict)
    steps: dict[int, int] = field(default_factory=dict)
    wire_bytes: int = 0
    control_bytes: int = 0
    move_bytes: int = 0

    def __post_init__(self) -> None:
        _check_fields(self)
        self._lock = threading.Lock()
        self._issued: Optional[threading.Event] = None
        self._layout: dict[int, tuple[int, int]] = {}
        self._index: dict[int, int] = {}

    @property
    def world_size(self) -> int:
        """Ranks in ``process_group``."""
        return dist.get_world_size(self.process_group)

    @property
    def gather_format(self) -> WireFormat:
        """The all-gather's wire format (``gather``, or ``scatter`` when that is None)."""
        return self.gather or self.scatter

    def state_dict(self) -> dict[str, Any]:
        """This rank's residuals and counters (save one file per rank with ``torch.save``)."""
        with self._lock:
            return {"format": _FORMAT_VERSION, "world_size": self.world_size,
                    "rank": dist.get_rank(self.process_group), "calls": self.calls, "steps": dict(self.steps),
                    "residuals": {k: v.clone() for k, v in self.residuals.items()},
                    "gather_residuals": {k: v.clone() for k, v in self.gather_residuals.items()},
                    "scatter": asdict(self.scatter), "gather": asdict(self.gather_format),
                    "error_feedback": self.error_feedback, "residual_dtype": str(self.residual_dtype),
                    "seed": self.seed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; ``ValueError`` naming what differs (world size, rank, a
        format, ``error_feedback``, ``seed``, ``residual_dtype``, a residual's shape)."""
        if not isinstance(state, dict) or state.get("format") != _FORMAT_VERSION:
            raise ValueError(f"state: expected a CompressedState.state_dict() ({_FORMAT_VERSION!r}), got "
                             f"{type(state).__name__}")
        R, rank = self.world_size, dist.get_rank(self.process_group)
        if state["world_size"] != R:
            raise ValueError(f"world_size: the checkpoint was saved on {state['world_size']} ranks, this group has "
                             f"{R}; the residuals are per rank and a rank-count change is refused (resume on "
                             f"{state['world_size']} ranks, or start the residuals afresh with a new state)")
        if state["rank"] != rank:
            raise ValueError(f"rank: the checkpoint holds rank {state['rank']}'s residuals, this is rank {rank}")
        mine = {"scatter": asdict(self.scatter), "gather": asdict(self.gather_format),
                "error_feedback": self.error_feedback, "residual_dtype": str(self.residual_dtype), "seed": self.seed}
        for name, value in mine.items():
            if state[name] != value:
                raise ValueError(f"{name}: the checkpoint has {state[name]!r}, this state {value!r}")
        sizes = None if self.module is None else [p.numel() for p in self.module.parameters()]
        for kind in ("residuals", "gather_residuals"):
            for key, value in state[kind].items():
                if sizes is not None and (not 0 <= key < len(sizes) or tuple(value.shape) != (sizes[key],)):
                    expected = f"({sizes[key]},)" if 0 <= key < len(sizes) else "no parameter at that index"
                    raise ValueError(f"{kind}[{key}]: shape {tuple(value.shape)} in the checkpoint, expected "
                                     f"{expected} (a checkpoint of another model?)")
        with self._lock:
            self.residuals = {k: v.clone().to(self.residual_dtype) for k, v in state["residuals"].items()}
            self.gather_residuals = {k: v.clone().to(self.residual_dtype)
                                     for k, v in state["gather_residuals"].items()}
            self.steps, self.calls = dict(state["steps"]), int(state["calls"])
            self._layout = {}          # owners unknown: the first call moves the gather residuals (exact)


def _check_fields(state: CompressedState, prefix: str = "") -> None:
    if state.process_group is not None and not isinstance(state.process_group, dist.ProcessGroup):
        raise TypeError(f"{prefix}process_group: expected a torch.distributed.ProcessGroup or None, got "
                        f"{type(state.process_group).__name__}")
    if not isinstance(state.scatter, WireFormat):
        raise TypeError(f"{prefix}scatter: expected a lowp.distributed.wire.WireFormat, got "
                        f"{type(state.scatter).__name__}")
    if state.gather is not None and not isinstance(state.gather, WireFormat):
        raise TypeError(f"{prefix}gather: expected a lowp.distributed.wire.WireFormat or None, got "
                        f"{type(state.gather).__name__}")
    for name in ("error_feedback", "overlap"):
        if not isinstance(getattr(state, name), bool):
            raise ValueError(f"{prefix}{name}: expected True or False, got {getattr(state, name)!r}")
    if state.residual_dtype not in _RESIDUAL_DTYPES:
        raise ValueError(f"{prefix}residual_dtype: expected torch.float32 or torch.bfloat16, got "
                         f"{state.residual_dtype!r}")
    check_seed_and_calls(state, prefix)
    if state.module is not None and not isinstance(state.module, torch.nn.Module):
        raise TypeError(f"{prefix}module: expected the DDP model's torch.nn.Module (ddp.module) or None, got "
                        f"{type(state.module).__name__}")


def register_compressed_hook(ddp: torch.nn.parallel.DistributedDataParallel, state: CompressedState) -> None:
    """Set ``state.module = ddp.module`` and register :func:`compressed_hook` on ``ddp``."""
    state.module = ddp.module
    ddp.register_comm_hook(state, compressed_hook)


def _format_code(fmt: WireFormat) -> int:
    kind = (ELEMENTS.index(fmt.element) * len(SCALES) + SCALES.index(fmt.scale)) * 2 + ROUNDINGS.index(fmt.rounding)
    return kind << 21 | fmt.block


def _show_format(code: int) -> str:
    kind, block = code >> 21, code & ((1 << 21) - 1)
    rest, rounding = divmod(kind, 2)
    element, scale = divmod(rest, len(SCALES))
    return repr(WireFormat(ELEMENTS[element], block, SCALES[scale], ROUNDINGS[rounding]))


def _settings(state: CompressedState) -> tuple[Setting, Setting, Setting]:
    return (("state.scatter", _format_code(state.scatter), _show_format),
            ("state.gather", _format_code(state.gather_format), _show_format),
            ("state.error_feedback", int(state.error_feedback), lambda v: str(bool(v))))


class _Job:
    """One call of the hook on one bucket: the local stages between the collectives."""

    def __init__(self, state: CompressedState, bucket: Any) -> None:
        self.state, self.index = state, operator.index(bucket.index())
        buffer = bucket.buffer()
        self.shape, self.dtype = buffer.shape, buffer.dtype
        self.flat = buffer.reshape(-1).to(torch.float32, copy=True)
        self.n = self.flat.numel()
        self.R, self.rank = state.world_size, dist.get_rank(state.process_group)
        scatter, gather = state.scatter, state.gather_format
        B = max(scatter.block if scatter.blocked else 1, gather.block if gather.blocked else 1)
        params = list(bucket.parameters())
        if state.module is None:
            raise ValueError("state.module: None; set it to the DDP model's module (register_compressed_hook(ddp, "
                             "state) does), whose parameters() order keys the residuals")
        if len(state._index) == 0 or any(id(p) not in state._index for p in params):
            state._index = {id(p): i for i, p in enumerate(state.module.parameters())}
        self.segments: list[tuple[int, int, int, int]] = []     # (bucket offset, numel, parameter index, wire offset)
        offset = wire = 0
        for p in params:
            pid = state._index.get(id(p))
            if pid is None:
                raise ValueError(f"bucket: parameter {offset} of bucket {self.index} (shape {tuple(p.shape)}) is not "
                                 f"in state.module.parameters(); state.module must be the DDP model's module")
            k = p.numel()
            for kind in ("residuals", "gather_residuals"):
                held = getattr(state, kind).get(pid)
                if held is not None and tuple(held.shape) != (k,):
                    raise ValueError(f"state.{kind}[{pid}]: shape {tuple(held.shape)}, but parameter {pid} has {k} "
                                     f"elements (expected ({k},); a residual from another model's checkpoint?)")
            self.segments.append((offset, k, pid, wire))
            offset += k
            wire += -(-k // B) * B
        if offset != self.n:
            raise ValueError(f"bucket: its parameters hold {offset} elements but its buffer {self.n}")
        self.shard = -(-wire // (B * self.R)) * B
        self.where = torch.cat([torch.arange(w, w + k) for _, k, _, w in self.segments]) if self.segments \
            else torch.zeros(0, dtype=torch.int64)
        self.finite = True

    # -- helpers ---------------------------------------------------------------------------
    def _to_wire(self, x: torch.Tensor) -> torch.Tensor:
        out = torch.zeros(self.R * self.shard, dtype=torch.float32)
        out[self.where] = x
        return out

    def _bits(self, start: int, stop: int, stream: int) -> Optional[torch.Tensor]:
        """Counter-based random bits of wire positions ``[start, stop)`` (padding: 0)."""
        from lowp.optim.randomness import random16_range, stream_key

        out = torch.zeros(stop - start, dtype=torch.int32)
        for _, k, pid, w in self.segments:
            a, b = max(start, w), min(stop, w + k)
            if a < b:
                key = stream_key(self.state.seed, self.state.steps.get(pid, 0), pid, stream)
                out[a - start:b - start] = random16_range(a - w, b - a, key)
        return out

    def _gathered_residual(self) -> torch.Tensor:
        parts = [self.state.gather_residuals.get(pid) for _, _, pid, _ in self.segments]
        return torch.cat([torch.zeros(k) if r is None else r.float() for (_, k, _, _), r in zip(self.segments, parts)])

    # -- stages ----------------------------------------------------------------------------
    def needs_move(self) -> bool:
        """Whether this bucket's gather residuals must move to new owners first (same on every rank)."""
        return any(pid in self.state.gather_residuals and self.state._layout.get(pid) != (w, self.shard)
                   for _, _, pid, w in self.segments)

    def move(self) -> None:
        """Gather residuals to their owners under this layout: one exact fp32 all-reduce."""
        full = self._gathered_residual()
        _collective(self.state, HOOK, self.index, dist.all_reduce, full)
        with self.state._lock:
            self.state.move_bytes += (self.R - 1) * full.numel() * 4
        self._store(self.state.gather_residuals, full)

    def _store(self, table: dict[int, torch.Tensor], values: torch.Tensor, owned_only: bool = True) -> None:
        """Split bucket-ordered ``values`` per parameter into ``table`` (``owned_only``: zero where
        another rank owns the element)."""
        lo, hi = self.rank * self.shard, (self.rank + 1) * self.shard
        for offset, k, pid, w in self.segments:
            piece = values[offset:offset + k].to(self.state.residual_dtype, copy=True)
            if owned_only:
                piece[:max(0, min(k, lo - w))] = 0
                piece[max(0, hi - w):] = 0
            table[pid] = piece
            self.state._layout[pid] = (w, self.shard)

    def prepare(self) -> torch.Tensor:
        """Residual in, compression, the new scatter residual; the all-to-all's send buffer."""
        state, scatter = self.state, self.state.scatter
        v = self.flat
        if state.error_feedback:
            parts = [state.residuals.get(pid) for _, _, pid, _ in self.segments]
            if any(r is not None for r in parts):
                v = v + torch.cat([torch.zeros(k) if r is None else r.float()
                                   for (_, k, _, _), r in zip(self.segments, parts)])
        self.v = v
        wire = self._to_wire(v)
        S = self.shard
        pieces = []
        for r in range(self.R):
            bits = self._bits(r * S, (r + 1) * S, 1 + self.rank) if scatter.rounding == "stochastic" else None
            pieces.append(encode(wire[r * S:(r + 1) * S], scatter, bits))
        send = torch.cat(pieces)
        if state.error_feedback:
            sent = torch.cat([decode(p, scatter, S) for p in pieces])
            self.residual = v - sent[self.where]
        return send

    def reduce(self, received: torch.Tensor) -> torch.Tensor:
        """Decode the R pieces of this rank's shard, add in fp32 (rank order), divide by R in fp32,
        add the gather residual and compress; the all-gather's send buffer."""
        state, S, scatter, gather = self.state, self.shard, self.state.scatter, self.state.gather_format
        piece = wire_bytes(scatter, S)
        total = decode(received[:piece], scatter, S)
        for r in range(1, self.R):
            total = total + decode(received[r * piece:(r + 1) * piece], scatter, S)
        u = total / self.R
        lo = self.rank * S
        if state.error_feedback and state.gather_residuals:
            u = u + self._to_wire(self._gathered_residual())[lo:lo + S]
        bits = self._bits(lo, lo + S, _GATHER_STREAM) if gather.rounding == "stochastic" else None
        send = encode(u, gather, bits)
        if state.error_feedback:
            self.gather_residual_shard = u - decode(send, gather, S)
        with state._lock:
            state.wire_bytes += (self.R - 1) * piece
        return send

    def finish(self, gathered: torch.Tensor) -> torch.Tensor:
        """Decode the full mean; commit the residuals when it is finite; the bucket's result."""
        state, S, gather = self.state, self.shard, self.state.gather_format
        piece = wire_bytes(gather, S)
        mean = torch.cat([decode(gathered[r * piece:(r + 1) * piece], gather, S) for r in range(self.R)])[self.where]
        self.finite = bool(torch.isfinite(mean).all())
        with state._lock:
            if state.error_feedback and self.finite:
                self._store(state.residuals, self.residual, owned_only=False)
                full = torch.zeros(self.R * S)
                full[self.rank * S:(self.rank + 1) * S] = self.gather_residual_shard
                self._store(state.gather_residuals, full[self.where])
            for _, _, pid, _ in self.segments:
                state.steps[pid] = state.steps.get(pid, 0) + 1
            state.calls += 1
            state.wire_bytes += (self.R - 1) * piece
        return mean.to(self.dtype).view(self.shape)


def _checked(state: Any, bucket: Any) -> torch.Tensor:
    if not isinstance(state, CompressedState):
        raise TypeError(f"state: expected a lowp.distributed.compressed.CompressedState, got {type(state).__name__}")
    _check_fields(state, "state.")
    return check_bucket(state.process_group, bucket, HOOK, _BUCKET_DTYPES, sparse=False,
                        methods=("buffer", "index", "parameters"))


def _failed(exc: BaseException, job: _Job, what: str) -> BaseException:
    return _renamed(exc, f"{HOOK}: the {what} of bucket {job.index} on a group of {job.R} ranks failed (a rank "
                         f"raised, died or hung before joining it, or the backend refused it): {exc}")


def compressed_hook(state: CompressedState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce-scatter in an 8-bit wire format with error feedback, fp32 sum and divide, and an
    all-gather in ``state.gather_format``; returns the mean in the bucket's dtype (see the module
    docstring for the algorithm, the layout, the residuals and overlap)."""
    buffer = _checked(state, bucket)
    if state._issued is not None:          # the previous bucket's collectives must be started first
        state._issued.wait()
    job = _Job(state, bucket)
    settings = _settings(state)
    R = job.R
    if job.n == 0:
        _agree(state, HOOK, job.index, buffer, (), settings)
        with state._lock:
            state.calls += 1
        return _done(buffer)
    send = job.prepare()
    with state._lock:
        state.control_bytes += (R - 1) * 7 * 8
    move = state.error_feedback and job.needs_move()
    if not state.overlap or move:
        _agree(state, HOOK, job.index, buffer, (), settings)
        if move:
            job.move()
    if not state.overlap:
        received = torch.empty_like(send)
        _collective(state, HOOK, job.index, dist.all_to_all_single, received, send)
        gsend = job.reduce(received)
        gathered = torch.empty(R * gsend.numel(), dtype=torch.uint8)
        _collective(state, HOOK, job.index, _all_gather, gathered, gsend)
        return _done(job.finish(gathered))

    out: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    issued = threading.Event()
    state._issued = issued

    def fail(exc: BaseException) -> None:
        issued.set()
        if not out.done():
            out.set_exception(exc)  # type: ignore[arg-type]  # torch stubs say Tensor

    def after_gather(fut: torch.futures.Future[Any], gathered: torch.Tensor) -> None:
        try:
            fut.wait()
        except BaseException as exc:  # noqa: BLE001 - handed to the future
            return fail(_failed(exc, job, "all_gather"))
        try:
            out.set_result(job.finish(gathered))
        except BaseException as exc:  # noqa: BLE001
            fail(exc)

    def after_scatter(fut: torch.futures.Future[Any], received: torch.Tensor) -> None:
        try:
            fut.wait()
        except BaseException as exc:  # noqa: BLE001
            return fail(_failed(exc, job, "all_to_all_single"))
        try:
            gsend = job.reduce(received)
            gathered = torch.empty(R * gsend.numel(), dtype=torch.uint8)
            gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
            work = gather(gathered, gsend, group=state.process_group, async_op=True)
            issued.set()
            work.get_future().then(lambda f: after_gather(f, gathered))
        except BaseException as exc:  # noqa: BLE001
            fail(exc)

    def start_scatter() -> None:
        received = torch.empty_like(send)
        work = dist.all_to_all_single(received, send, group=state.process_group, async_op=True)
        work.get_future().then(lambda f: after_scatter(f, received))

    if move:                                   # already agreed (synchronously) above
        start_scatter()
        return out
    works: list[Any] = []
    table = _agreement_table(state, HOOK, job.index, buffer, (), settings, works)

    def after_agree(fut: torch.futures.Future[Any]) -> None:
        try:
            fut.wait()
        except BaseException as exc:  # noqa: BLE001
            return fail(_failed(exc, job, "agreement all_gather"))
        try:
            _agreement_check(state, HOOK, job.index, table)
            start_scatter()
        except BaseException as exc:  # noqa: BLE001
            fail(exc)

    works[0].get_future().then(after_agree)
    return out

