"""FSDP2 reduce-scatter with an 8-bit wire, fp32 accumulation and error feedback.

:func:`set_compressed_reduce_scatter` installs one :class:`CompressedReduceScatter` on every
FSDP module of a model (FSDP2's ``set_custom_reduce_scatter``, see :mod:`lowp.distributed.fsdp`).
FSDP2 hands each call the flat reduce-scatter input of one *parameter group* (one FSDP module):
R equal shards, shard ``k`` holding every parameter's ``k``-th dim-0 chunk, zero-padded. On rank
``r`` of ``R``, for the group ``key``::

    v_r     = fl32(input_r) + e_r[key]                 e_r: this rank's residual (0 at first)
    send_r  = cat_k encode(v_r[shard k], wire)         lowp.distributed.wire; one piece per shard
    e_r     <- v_r - decode(send_r)                    (error feedback; stored in residual_dtype)
    all_to_all_single of the packed uint8 pieces      (rank k receives every rank's piece k)
    out_k   = fl32(sum_{r in rank order} decode(send_r)[shard k])      fp32, one rank at a time
    out_k   = fl32(out_k / R)                          (op=AVG, in fp32)
    output  <- out_k in the output's dtype             (one rounding when reduce_dtype is bf16)

so the bytes on the wire per rank and call are ``(R - 1) * wire_bytes(wire, n / R)``: with the
default fp8 e4m3 and 32-element blocks of e8m0 scales, 1.03 bytes per element, 0.52 x a bf16
reduce-scatter. Blocks start at each shard's first element (a shard is encoded alone, so every
piece is self-contained). Stochastic rounding (``WireFormat(rounding="stochastic")``) draws the
counter-based bits of :func:`lowp.optim.randomness.random16` for element ``j`` of the flat input
under the key ``stream_key(seed, call of this group, crc32(key), 1 + rank)``: the same bits on a
resumed run.

Residuals. One flat tensor per rank and parameter group (``residuals[key]``, ``n`` elements of
``residual_dtype``: fp32, or bf16 for half the memory, rounded to nearest), keyed by the FSDP
module's name in ``model.named_modules()`` (``"root"`` for the model itself), so the keys are
the same in every process that builds the same model. Their size is fixed when installed: the
sum over the group's parameters of ``R x padded_sharded_param_size``, which is what FSDP2 sends.
Each call checks it: a call of another size (a parameter without a gradient this step, so FSDP
leaves it out of the input; another model) would add the residual to the wrong elements, so it
raises ``ValueError`` naming ``input_tensor`` and the group by default
(``on_layout_change="raise"``); ``on_layout_change="reset"`` warns and starts that group's
residual afresh (zeros of the new size). Memory: one gradient-sized fp32 (or bf16) tensor per
rank, like the unsharded gradient FSDP2 already holds during the reduce-scatter.

Non-finite values: a block holding NaN or inf is sent with a NaN scale (see
:mod:`lowp.distributed.wire`), so that block of the result is NaN on its owner and a lowp
optimizer's non-finite policy skips the parameter; the sending rank keeps its old residual on
the elements of that block (each rank decides from what it sent, without a collective) and
updates it elsewhere, so one bad step does not poison the residual.

Checkpointing (DCP). :class:`CompressedReduceScatter` is a ``Stateful``: put it into the state
given to ``torch.distributed.checkpoint.save``/``load`` beside the model and optimizer (it must
be installed first, so that the residuals have their shapes when DCP asks for the load template).
:meth:`~CompressedReduceScatter.state_dict` holds, in this order, ``world_size`` (an int64 tensor
``arange(R)``, the same on every rank), the version, the wire format, the feedback switch, the
residual dtype, the seed, the call count of each group and ``residuals``: each group's residuals as
one ``DTensor`` of global shape ``(R, n)``, sharded by rows over the group's mesh (row ``r`` is rank
``r``'s residual; DCP writes each rank's row once, bit for bit). Resuming is bit-exact. A
checkpoint saved on another number of ranks is refused before anything is read: DCP's own shape
check on the first key fails with ``Size mismatch between saved torch.Size([R_saved]) and
current: torch.Size([R]) for <key>.world_size``; :meth:`~CompressedReduceScatter.load_state_dict`
given such a state directly raises ``ValueError`` naming ``world_size``. The residuals are per
rank and reflect that rank's data stream, so no rank-count change is attempted: resume on the
same number of ranks, or start the residuals afresh (a new, unloaded object).

The collective runs to completion inside the call, as FSDP2 calls its reduce-scatter
synchronously on its own stream (no ``async_op``).
"""
from __future__ import annotations

import warnings
import zlib
from dataclasses import asdict
from typing import TYPE_CHECKING, Any

import torch
import torch.distributed as dist

from lowp.distributed.fsdp import FP32SumReduceScatter, install, param_groups
from lowp.distributed.wire import WireFormat, decode, encode, wire_bytes

if TYPE_CHECKING:
    from torch.distributed.fsdp import FSDPModule

__all__ = ["CompressedReduceScatter", "GroupReduceScatter", "set_compressed_reduce_scatter", "ROOT"]

_RESIDUAL_DTYPES = (torch.float32, torch.bfloat16)
_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_LAYOUT_CHANGES = ("raise", "reset")
_FORMAT_VERSION = "lowp.compressed_fsdp/1"
_DEFAULT_WIRE = WireFormat()
#: the key of the model's own parameter group (its name in ``named_modules()`` is ``""``)
ROOT = "root"


def _group_id(key: str) -> int:
    return zlib.crc32(key.encode())


class CompressedReduceScatter(FP32SumReduceScatter):
    """FSDP2 reduce-scatter with an 8-bit wire and error feedback (see the module docstring).

    Install it with :func:`set_compressed_reduce_scatter`, which gives each FSDP module a
    :class:`GroupReduceScatter` bound to this object and that module's residual. Called directly
    (FSDP2's ``ReduceScatter`` interface), it reduces under the key ``"root"``.

    Args:
        wire: the :class:`~lowp.distributed.wire.WireFormat` (default: fp8 e4m3, blocks of 32 with
            e8m0 scales, nearest), or an element name (``"fp8_e4m3"``, ``"fp8_e5m2"``, ``"int8"``,
            ``"bf16"``, ``"fp16"``, ``"fp32"``) for that format's defaults; anything else raises
            ``ValueError``/``TypeError`` naming ``wire``.
        error_feedback: keep what compression lost and add it to the next input (default True).
        residual_dtype: ``torch.float32`` (default) or ``torch.bfloat16``.
        seed: base of the stochastic-rounding keys, an int (default 0).
        on_layout_change: ``"raise"`` (default) or ``"reset"`` (warn, zero the group's residual)
            when a call's input size differs from the group's residual.

    Attributes:
        residuals: group key -> this rank's flat residual (with error feedback).
        calls: group key -> calls so far (keys of the stochastic-rounding streams).
        wire_bytes: bytes this rank sent (``(R - 1)`` x its piece per call).
    """

    def __init__(self, wire: WireFormat | str = _DEFAULT_WIRE, error_feedback: bool = True,
                 residual_dtype: torch.dtype = torch.float32, seed: int = 0,
                 on_layout_change: str = "raise") -> None:
        if isinstance(wire, str):
            try:
                wire = WireFormat(wire)
            except ValueError as exc:
                raise ValueError(f"wire: {exc}") from None
        if not isinstance(wire, WireFormat):
            raise TypeError(f"wire: expected a lowp.distributed.wire.WireFormat or an element name, got "
                            f"{type(wire).__name__} ({wire!r})")
        if not isinstance(error_feedback, bool):
            raise ValueError(f"error_feedback: expected True or False, got {error_feedback!r}")
        if residual_dtype not in _RESIDUAL_DTYPES:
            raise ValueError(f"residual_dtype: expected torch.float32 or torch.bfloat16, got {residual_dtype!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed: expected an int, got {seed!r}")
        if on_layout_change not in _LAYOUT_CHANGES:
            raise ValueError(f"on_layout_change: expected 'raise' or 'reset', got {on_layout_change!r}")
        self.wire, self.error_feedback, self.residual_dtype = wire, error_feedback, residual_dtype
        self.seed, self.on_layout_change = seed, on_layout_change
        self.residuals: dict[str, torch.Tensor] = {}
        self.calls: dict[str, int] = {}
        self.wire_bytes = 0
        self._sizes: dict[str, int] = {}
        self._groups: dict[str, dist.ProcessGroup] = {}
        self._meshes: dict[int, Any] = {}

    # -- set-up ------------------------------------------------------------------------------
    def register(self, key: str, numel: int, group: dist.ProcessGroup | None = None,
                 device: torch.device | str = "cpu") -> None:
        """Fix group ``key``'s input size to ``numel`` elements on ``group`` (default: the world)
        and, with error feedback, give it a zero residual (:func:`set_compressed_reduce_scatter`
        does this for every FSDP module). Registering a key again with another size raises."""
        if not isinstance(key, str) or not key:
            raise ValueError(f"key: expected a non-empty str, got {key!r}")
        if isinstance(numel, bool) or not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel: expected an int >= 0, got {numel!r}")
        if key in self._sizes and self._sizes[key] != numel:
            raise ValueError(f"key: group {key!r} is registered with {self._sizes[key]} elements, not {numel}")
        pg = group if group is not None else dist.group.WORLD
        if pg is None:
            raise RuntimeError("group: torch.distributed is not initialized")
        self._sizes[key], self._groups[key] = numel, pg
        self.calls.setdefault(key, 0)
        if self.error_feedback and key not in self.residuals:
            self.residuals[key] = torch.zeros(numel, dtype=self.residual_dtype, device=device)

    def for_group(self, key: str) -> GroupReduceScatter:
        """The ``ReduceScatter`` FSDP2 calls for group ``key`` (reducing under that key)."""
        return GroupReduceScatter(self, key)

    # -- the collective ----------------------------------------------------------------------
    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object = dist.ReduceOp.SUM, async_op: bool = False) -> None:
        """:meth:`reduce_scatter` under the key ``"root"``."""
        self.reduce_scatter(ROOT, output_tensor, input_tensor, group, op)

    def reduce_scatter(self, key: str, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                       group: dist.ProcessGroup, op: object = dist.ReduceOp.SUM) -> None:
        """Reduce-scatter ``input_tensor`` (R equal shards, flat) into ``output_tensor`` over
        ``group`` with group ``key``'s residual: shard r of the fp32 sum (``op=AVG``: mean) of every
        rank's decoded input goes to rank r. ``ValueError`` (naming ``op``, ``input_tensor`` or
        ``output_tensor``) before anything is sent for an op other than SUM/AVG, sizes that do not
        match, a dtype other than fp32/bf16/fp16, or (``on_layout_change="raise"``) an input size
        other than the group's."""
        R, average = self._begin(output_tensor, input_tensor, group, op)
        for name, t in (("input_tensor", input_tensor), ("output_tensor", output_tensor)):
            if t.dtype not in _INPUT_DTYPES:
                raise ValueError(f"{name}: expected float32, bfloat16 or float16, got {t.dtype}")
        n = input_tensor.numel()
        if key not in self._sizes:
            self.register(key, n, group, input_tensor.device)
        elif self._sizes[key] != n:
            message = (f"input_tensor: group {key!r} sends {n} elements, but its residual holds "
                       f"{self._sizes[key]} (the reduce-scatter layout changed: a parameter without a gradient "
                       f"this step, or another model)")
            if self.on_layout_change == "raise":
                raise ValueError(message + "; on_layout_change='reset' starts the residual afresh instead")
            warnings.warn(message + "; on_layout_change='reset': its residual starts afresh", stacklevel=3)
            self._sizes[key] = n
            self.residuals.pop(key, None)
            self.register(key, n, group, input_tensor.device)
        rank, S, wire = dist.get_rank(group), n // R, self.wire
        v = input_tensor.reshape(-1).to(torch.float32, copy=True)
        residual = self.residuals.get(key) if self.error_feedback else None
        if residual is not None:
            v = v + residual.to(torch.float32)
        random = None
        if wire.rounding == "stochastic":
            from lowp.optim.randomness import stream_key
            random = stream_key(self.seed, self.calls[key], _group_id(key), 1 + rank)
        pieces = [encode(v[k * S:(k + 1) * S], wire, random, first=k * S) for k in range(R)]
        send = torch.cat(pieces)
        if residual is not None:
            sent = torch.cat([decode(p, wire, S) for p in pieces])
            new = torch.where(torch.isfinite(sent), v - sent, residual.to(torch.float32))
        received = self._exchange(send, group)
        piece = wire_bytes(wire, S)
        total = decode(received[:piece], wire, S)
        for k in range(1, R):
            total = total + decode(received[k * piece:(k + 1) * piece], wire, S)
        self._write(output_tensor, total, R, average)
        if residual is not None:
            self.residuals[key] = new.to(self.residual_dtype)
        self.calls[key] += 1
        self.wire_bytes += (R - 1) * piece
        return None

    # -- checkpointing -----------------------------------------------------------------------
    def _world_size(self) -> int:
        groups = list(self._groups.values())
        return dist.get_world_size(groups[0] if groups else None)

    def _config(self) -> dict[str, Any]:
        return {"wire": asdict(self.wire), "error_feedback": self.error_feedback,
                "residual_dtype": str(self.residual_dtype), "seed": self.seed}

    def _mesh(self, group: dist.ProcessGroup, device_type: str) -> Any:
        from torch.distributed.device_mesh import DeviceMesh

        mesh = self._meshes.get(id(group))
        if mesh is None:
            mesh = self._meshes[id(group)] = DeviceMesh.from_group(group, device_type)
        return mesh

    def state_dict(self) -> dict[str, Any]:
        """This rank's share of the training state, for DCP (see the module docstring): the
        residuals as ``DTensor`` rows of a ``(R, n)`` tensor per group, and the call counts."""
        from torch.distributed.tensor import DTensor, Shard

        R = self._world_size()
        residuals = {}
        for key, r in self.residuals.items():
            mesh = self._mesh(self._groups[key], r.device.type)
            residuals[key] = DTensor.from_local(r.detach().clone().view(1, -1), mesh, [Shard(0)], run_check=False,
                                                shape=torch.Size((R, r.numel())), stride=(r.numel(), 1))
        return {"world_size": torch.arange(R), "format": _FORMAT_VERSION, **self._config(),
                "calls": dict(self.calls), "residuals": residuals}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` (as DCP hands it back, or as returned); ``ValueError``
        naming what differs: ``world_size``, the wire format, ``error_feedback``,
        ``residual_dtype``, ``seed``, or a residual (``residuals[key]``) that is missing or whose
        shape is not its group's."""
        from torch.distributed.tensor import DTensor

        if not isinstance(state, dict) or state.get("format") != _FORMAT_VERSION:
            raise ValueError(f"state: expected a CompressedReduceScatter.state_dict() ({_FORMAT_VERSION!r})")
        saved = state["world_size"]
        saved = int(saved.numel()) if isinstance(saved, torch.Tensor) else int(saved)
        R = self._world_size()
        if saved != R:
            raise ValueError(f"world_size: the checkpoint was saved on {saved} ranks, this group has {R}; the "
                             f"residuals are per rank and a rank-count change is refused (resume on {saved} ranks, "
                             f"or start the residuals afresh with a new CompressedReduceScatter)")
        for name, value in self._config().items():
            if state[name] != value:
                raise ValueError(f"{name}: the checkpoint has {state[name]!r}, this object {value!r}")
        rows: dict[str, torch.Tensor] = {}
        for key, value in state["residuals"].items():
            local = value.to_local() if isinstance(value, DTensor) else value
            n = self._sizes.get(key)
            if n is None or tuple(local.shape) != (1, n):
                expected = "no such group (install before loading)" if n is None else f"(1, {n}) (one row per rank)"
                raise ValueError(f"residuals[{key!r}]: shape {tuple(local.shape)} in the checkpoint, expected "
                                 f"{expected}; a checkpoint of another model or layout?")
            if local.dtype != self.residual_dtype:
                raise ValueError(f"residuals[{key!r}]: dtype {local.dtype}, expected {self.residual_dtype}")
            rows[key] = local.reshape(-1)
        missing = sorted(set(self.residuals) - set(rows))
        if missing:
            raise ValueError(f"residuals[{missing[0]!r}]: missing from the checkpoint")
        for key, row in rows.items():
            self.residuals[key] = row.clone().to(self.residuals[key].device)
        self.calls.update({k: int(v) for k, v in state["calls"].items()})


class GroupReduceScatter(FP32SumReduceScatter):
    """The ``ReduceScatter`` of one FSDP parameter group: :meth:`CompressedReduceScatter.reduce_scatter`
    of ``owner`` under ``key``.

    Args:
        owner: the :class:`CompressedReduceScatter` holding the residuals of every group.
        key: this group's module name (``"root"`` for the model itself), which keys its residual.
    """

    def __init__(self, owner: CompressedReduceScatter, key: str) -> None:
        self.owner, self.key = owner, key

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 op: object = dist.ReduceOp.SUM, async_op: bool = False) -> None:
        """:meth:`CompressedReduceScatter.reduce_scatter` of ``owner`` under ``key``."""
        self.owner.reduce_scatter(self.key, output_tensor, input_tensor, group, op)


def _input_numel(module: FSDPModule) -> tuple[int, dist.ProcessGroup, torch.device]:
    """The reduce-scatter input size FSDP2 sends for ``module``'s (single) parameter group, its group
    and device."""
    (group,) = param_groups(module)
    info = group.mesh_info
    pg = getattr(info, "reduce_scatter_process_group", None) or info.shard_process_group
    R = dist.get_world_size(pg)
    numel = sum(p.padded_sharded_param_size.numel() for p in group.fsdp_params) * R
    return numel, pg, group.device


def set_compressed_reduce_scatter(model: torch.nn.Module,
                                  comm: CompressedReduceScatter | None = None) -> CompressedReduceScatter:
    """Install ``comm`` (default: a new :class:`CompressedReduceScatter`) on every FSDP module of
    ``model`` that owns parameters, one :class:`GroupReduceScatter` each, keyed by the module's name
    (``"root"`` for ``model``), with its residual registered (zeros); returns ``comm``.
    ``RuntimeError`` when this torch has no custom reduce-scatter hook, ``ValueError`` when
    ``model`` has no FSDP module."""
    comm = CompressedReduceScatter() if comm is None else comm
    if not isinstance(comm, CompressedReduceScatter):
        raise TypeError(f"comm: expected a CompressedReduceScatter, got {type(comm).__name__}")

    def make(name: str, module: FSDPModule) -> GroupReduceScatter:
        key = name or ROOT
        numel, pg, device = _input_numel(module)
        comm.register(key, numel, pg, device)
        return comm.for_group(key)

    install(model, make)
    return comm
