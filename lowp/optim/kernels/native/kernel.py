"""The native CPU kernel (``backend="native"``): every optimizer spec with a rule, in every
write-back mode, through C++ generated from the spec (:mod:`~lowp.optim.kernels.native.source`) and
compiled once per variant (:mod:`~lowp.optim.kernels.native.build`); one call per step and dtype
signature over all parameters (multi-tensor), on torch's OpenMP threads (``torch.get_num_threads()``).

Results are bit-identical to the ``foreach`` reference in every mode (stochastic rounding draws
the counter-based bits of :mod:`lowp.optim.randomness` on every backend); a variant compiles in
about a second instead of Inductor's 10-40 s. A spec with a per-tensor reduction (StableAdamW)
takes two calls: the sums, then the step with the per-tensor numbers the spec makes from them.

Block-scaled states are decoded and encoded inside the step (``native/coded_step.h``,
:meth:`NativeKernel.run_coded`) for the slices :func:`~lowp.optim.kernels.coded_slices.admitted`
lets through: in groups of 256 elements (whole blocks of every size), each block's new values
kept in L1 until its scale is known.
"""
from __future__ import annotations

import ctypes
import operator
from array import array
from functools import partial
from typing import Any, Callable, cast

import torch

from lowp.optim.ordered_sum import PIECE_SIZE, Runs, layouts
from lowp.optim.kernels.checks import (PLAIN_TYPES, all_kernel_memory, check_kernel_args, kernel_grad, kernel_memory,
                                       plain, storage_fits)
from lowp.optim.kernels.coded_slices import check_coded_args, codes_of, without
from lowp.optim.kernels.native.source import DTYPE_CODES, CodedLayout, Variant, variant_source
from lowp.optim.kernels.kernel import Kernel, by_signature
from lowp.optim.kernels.native.build import (coded_step_function, finite_function, native_available,
                                             piece_sums_function, step_function, sums_function)
from lowp.optim.kernels.native.codec import grid_numbers, scale_code
from lowp.optim.slices import ParamSlice, StepContext, TensorSum
from lowp.optim.spec import OptimizerSpec
from lowp.optim.stalled import Stalled

__all__ = ["NativeKernel", "Launch", "PiecesCall", "slice_dtypes", "variant_for", "by_coded_signature"]

_FLOAT_CODES = {dtype: code for dtype, code in DTYPE_CODES.items() if dtype.is_floating_point}
_DATA_PTR, _NUMEL = torch.Tensor.data_ptr, torch.Tensor.numel
_DTYPE = operator.attrgetter("dtype")


def slice_dtypes(s: ParamSlice) -> tuple[torch.dtype | None, ...]:
    """(weight, gradient, buffer or ``None``, states...) dtypes: what selects a variant per slice."""
    return (s.param.dtype, s.grad.dtype, s.buffer.dtype if s.buffer is not None else None,
            *(t.dtype for t in s.states.values()))


def variant_for(spec: OptimizerSpec, ctx: StepContext, dtypes: tuple[torch.dtype | None, ...],
                coded: CodedLayout | None = None) -> Variant:
    """The compiled variant for one step context and the dtypes of a slice (:func:`slice_dtypes`;
    a coded state's as fp32, the dtype the rule sees it in, with its ``coded`` layout)."""
    weight, grad, buffer, *states = dtypes
    assert weight is not None and grad is not None
    return Variant(spec.program(ctx.group), spec.reduction(ctx.group), ctx.mode.name, weight, grad, buffer,
                   tuple(s for s in states if s is not None), ctx.group["state_rounding"] == "stochastic", ctx.count,
                   coded)


def _native_flags(grads: list[torch.Tensor]) -> list[bool]:
    """Per gradient (contiguous CPU kernel memory of a float dtype of ``_FLOAT_CODES``): whether it
    holds no NaN or infinity, by one call of ``finite.cpp``. The tables are ``array`` buffers,
    filled in C loops (ctypes arrays took 0.16 us per element, a third of the call on small tensors)."""
    n = len(grads)
    if not n:
        return []
    ptrs = array("Q", map(_DATA_PTR, grads))
    numel = array("q", map(_NUMEL, grads))
    codes = array("i", map(_FLOAT_CODES.__getitem__, map(_DTYPE, grads)))
    found = array("B", bytes(n))
    finite_function()(n, ptrs.buffer_info()[0], numel.buffer_info()[0], codes.buffer_info()[0],
                      found.buffer_info()[0], torch.get_num_threads())
    return list(map(bool, found))


class NativeKernel(Kernel):
    """Fused steps through the generated C++ kernel; see the module docstring."""

    name = "native"
    steps_codes = True
    keeps_plans = True
    min_numel = 1
    fp16_stochastic = True
    devices = ("cpu",)

    def __init__(self) -> None:
        if not native_available():
            raise RuntimeError("backend='native': needs an x86-64 CPU with AVX2, FMA and F16C and a C++ "
                               "compiler (g++, c++ or clang++) on PATH")
        super().__init__()

    def supports(self, spec: OptimizerSpec) -> bool:
        """Every spec with a rule, per-tensor reductions included."""
        return spec.rule is not None

    def finite_flags(self, grads: list[torch.Tensor]) -> list[bool | None]:
        """One native call over every fp32/bf16/fp16 CPU gradient in kernel memory
        (:func:`~lowp.optim.kernels.checks.kernel_memory`): an integer test of the exponent field,
        read once at memory speed (torch's ``aminmax`` took 13-30% of a fused step, measured).
        Empty gradients are finite (an empty shard's may have no address: the others still take the
        one call); the others are left to the generic check (``None``); a gradient whose storage is
        smaller than its shape is a ``ValueError``."""
        if all_kernel_memory(grads, _FLOAT_CODES):   # every one: one native call, no per-tensor checks
            return list(_native_flags(grads))
        live = [g for g in grads if type(g) not in PLAIN_TYPES or g.numel()]
        if len(live) < len(grads) and all_kernel_memory(live, _FLOAT_CODES):
            found = iter(_native_flags(live))
            return [next(found) if g.numel() else True for g in grads]
        flags: list[bool | None] = [None] * len(grads)
        native = []
        for i, g in enumerate(grads):
            if type(g) not in PLAIN_TYPES:
                continue
            if g.numel() == 0:
                flags[i] = True
            elif g.is_cpu and kernel_memory(g, tuple(_FLOAT_CODES)):
                native.append(i)
            elif plain(g) and not storage_fits(g):  # torch's own kernels would read past it too
                raise ValueError(f"grad: its storage holds {g.untyped_storage().nbytes()} bytes, fewer than its "
                                 f"shape {tuple(g.shape)} addresses (was the storage freed or resized?)")
        for i, ok in zip(native, _native_flags([grads[i] for i in native])):
            flags[i] = ok
        return flags

    def run(self, spec: OptimizerSpec, ctx: StepContext, slices: list[ParamSlice]) -> Stalled:
        """One kernel call per dtype signature (:meth:`launches`); returns the stalled count."""
        return self.prepare(spec, ctx, slices)()

    def run_coded(self, spec: OptimizerSpec, ctx: StepContext, slices: list[ParamSlice]) -> Stalled:
        """The step over ``slices`` of a job with coded states (``ctx.coded``, all
        :func:`~lowp.optim.kernels.coded_slices.admitted`): one kernel call per dtype signature,
        the scale dtype included (:meth:`launches`); returns the stalled count."""
        return self.prepare(spec, ctx, slices)()

    def load(self, spec: OptimizerSpec, ctx: StepContext, dtypes: tuple[torch.dtype | None, ...]) -> None:
        """The library of the variant of ``dtypes`` at ``ctx`` built and loaded (its step and, with
        a per-tensor reduction, its sums come from it). The caller passes dtypes the kernel admits
        (:func:`~lowp.optim.kernels.kernel.fusable_dtypes`); others have no variant (``KeyError``)."""
        step_function(variant_source(spec.name, variant_for(spec, ctx, dtypes)))

    def pieces_launches(self, spec: OptimizerSpec, ctx: StepContext, slices: list[ParamSlice]
                        ) -> list[tuple[PiecesCall, list[ParamSlice]]]:
        """The variant's own pre-pass over admitted shards (:class:`PiecesCall`), one per dtype
        signature, each with its members (checked, :func:`check_kernel_args`)."""
        return [(PiecesCall(spec, variant, members), members)
                for variant, members in _checked_variants(spec, ctx, slices)]

    def launches(self, spec: OptimizerSpec, ctx: StepContext, slices: list[ParamSlice]
                 ) -> list[tuple[Launch, list[ParamSlice]]]:
        """The checked kernel calls over admitted ``slices`` of one job, each with its members: one
        per dtype signature (with coded states, ``ctx.coded``, the scales' dtype too:
        :meth:`coded_launch`). A step runs them once; a cached plan
        (:mod:`lowp.optim.cached_step`) keeps them for the next steps."""
        if ctx.coded:
            return [(NativeKernel.coded_launch(spec, ctx, members), members)
                    for members in by_coded_signature(ctx, slices).values()]
        return [(Launch(spec, variant, members), members) for variant, members in _checked_variants(spec, ctx, slices)]

    @staticmethod
    def launch(spec: OptimizerSpec, variant: Variant, members: list[ParamSlice], numbers: dict[str, float],
               seed: int, step: int, factor: float) -> int:
        """One checked kernel call (two with a reduction) over ``members`` (slices of one
        ``variant``, each a contiguous range of its parameter) at ``step`` with the optimizer's
        ``seed`` (the random streams of each slice's parameter); returns the stalled count."""
        check_kernel_args(members, list(variant.program.state_names), variant.dtypes)
        return Launch(spec, variant, members).call([s.grad for s in members], numbers, factor, seed, step)

    @staticmethod
    def coded_launch(spec: OptimizerSpec, ctx: StepContext, slices: list[ParamSlice]) -> Launch:
        """The kernel call over ``slices`` with coded states (their scales of one dtype), checked:
        the plain states' arguments as :meth:`launch` does, the codes and scales by
        :func:`~lowp.optim.kernels.coded_slices.check_coded_args`."""
        codes, block = codes_of(ctx), ctx.group["state_block"]
        names = list(spec.states(ctx.group))
        weight, grad, buffer, *states = slice_dtypes(slices[0])
        dtypes = tuple(torch.float32 if name in codes else dtype for name, dtype in zip(names, states)
                       if dtype is not None)
        assert len(dtypes) == len(names), "every state of an admitted slice is a tensor"
        check_kernel_args([without(s, codes) for s in slices], [name for name in names if name not in codes],
                          (weight, grad, buffer, *(d for name, d in zip(names, dtypes) if name not in codes)))
        check_coded_args(NativeKernel.devices, slices, codes, block)
        scale_dtype = slices[0].scales[next(iter(codes))].dtype
        layout = CodedLayout(tuple(codes[name].kind if name in codes else -1 for name in names),
                             scale_code(scale_dtype), block)
        variant = variant_for(spec, ctx, (weight, grad, buffer, *dtypes), layout)
        n = len(slices)
        scale_table = (ctypes.c_void_p * (len(names) * n))()
        for j, s in enumerate(slices):
            for k, name in enumerate(names):
                scale_table[k * n + j] = s.scales[name].data_ptr() if name in codes else None
        grids = (ctypes.c_double * (4 * len(names)))(*(x for name in names
                                                        for x in (grid_numbers(codes[name]) if name in codes
                                                                  else (0.0, 0.0, 0.0, 0.0))))
        return Launch(spec, variant, slices, (scale_table, grids))


class PiecesCall:
    """``lowp_piece_sums`` over the runs of ``members`` (checked shards of one variant, each with
    its :class:`~lowp.optim.slices.TensorSum`), prepared once: each shard's runs
    (:func:`~lowp.optim.ordered_sum.layouts`: at most five, each a range of the shard cut into
    terms, blocks or units), their pointer table (each run's pointers offsets into its shard's
    tensors) but the gradients', lengths and piece sizes. Each piece's sum starts from zero and
    adds in :func:`~lowp.optim.ordered_sum.ordered_sum`'s order, so a unit piece is the unit's
    sum, a block piece the block's, a term piece the term, exactly: the runs
    :func:`~lowp.optim.ordered_sum.pieces` makes from the same terms. A cached plan
    (:mod:`lowp.optim.cached_step`) keeps it while nothing of its members changed.

    Args:
        spec: the optimizer's spec (its reduction's numbers).
        variant: the compiled variant of every member.
        members: the shards, checked (:func:`check_kernel_args`).
    """

    def __init__(self, spec: OptimizerSpec, variant: Variant, members: list[ParamSlice]) -> None:
        if any(s.tensor_sum is None for s in members):
            raise RuntimeError("kernel pieces: a shard without its TensorSum")
        kind, index, count, start, length, runs = layouts(
            [s.index.first() for s in members], [s.numel for s in members],
            [cast(TensorSum, s.tensor_sum).numel for s in members])
        inside = torch.tensor([s.numel for s in members]).repeat_interleave(runs)
        self.size = torch.tensor(PIECE_SIZE)[kind]
        if bool(((start < 0) | (start + length > inside) | (-(-length // self.size) != count)).any()):
            raise RuntimeError("kernel pieces: a run outside its shard or of another piece count")
        self.spec, self.variant, self.n = spec, variant, len(members)
        self.function = piece_sums_function(variant_source(spec.name, variant))
        self.length, self.runs = length, start.numel()
        self.member = torch.repeat_interleave(torch.arange(self.n), runs)   # each run's shard
        roles: list[list[torch.Tensor | None]] = [[s.param for s in members], [None] * self.n,
                                                  [s.buffer for s in members]]
        roles += [[s.states[name] for s in members] for name in variant.program.state_names]
        self.table = torch.zeros((len(roles), self.runs), dtype=torch.int64)   # [role][run]; the gradients' at a call
        for role, tensors in enumerate(roles):
            if tensors[0] is not None:   # a role's dtype is the signature's: every member has it or none
                first = torch.tensor([cast(torch.Tensor, t).data_ptr() for t in tensors])
                self.table[role] = start * tensors[0].element_size() + first[self.member]
        self.grad_offset = start * cast(torch.dtype, variant.dtypes[1]).itemsize   # a gradient's dtype is never None
        self.heads = torch.stack([kind, index, count], 1).split(runs.tolist())
        self.pieces = torch.zeros(self.n, dtype=torch.int64).index_add_(0, self.member, count).tolist()   # each shard's

    def call(self, grads: list[torch.Tensor], numbers: dict[str, float], factor: float) -> list[Runs]:
        """Each member's runs with the members' ``grads`` (a strided or misaligned one copied,
        :func:`~lowp.optim.kernels.checks.kernel_grad`), the spec's ``numbers`` and the gradient
        ``factor``; nothing is written. The table holds the gradients' pointers for the call only."""
        if len(grads) != self.n:
            raise RuntimeError(f"kernel pieces: {len(grads)} gradients for {self.n} shards")
        grads = list(map(kernel_grad, grads))   # alive until the call returns
        h = torch.tensor([factor, *self.spec.pick(self.variant.numbers, numbers)], dtype=torch.float64)
        sums = torch.zeros(sum(self.pieces), dtype=torch.float64)
        try:
            self.table[1] = torch.tensor([g.data_ptr() for g in grads])[self.member] + self.grad_offset
            self.function(self.runs, self.table.data_ptr(), self.length.data_ptr(), self.size.data_ptr(),
                          h.data_ptr(), sums.data_ptr(), torch.get_num_threads())
        finally:
            self.table[1] = 0
        return [Runs(head, values) for head, values in zip(self.heads, sums.split(self.pieces))]


def _checked_variants(spec: OptimizerSpec, ctx: StepContext, slices: list[ParamSlice]
                      ) -> list[tuple[Variant, list[ParamSlice]]]:
    """``slices`` grouped by dtype signature, each group with its variant at ``ctx`` and its
    members checked against it (:func:`check_kernel_args`)."""
    out = []
    for dtypes, members in by_signature(slices, slice_dtypes).items():
        variant = variant_for(spec, ctx, dtypes)
        check_kernel_args(members, list(variant.program.state_names), variant.dtypes)
        out.append((variant, members))
    return out


def by_coded_signature(ctx: StepContext, slices: list[ParamSlice]) -> dict[tuple, list[ParamSlice]]:
    """The slices of a job with coded states grouped by what selects a coded variant: their dtypes
    and their block scales' dtype."""
    scale_of = next(iter(codes_of(ctx)))
    return by_signature(slices, lambda s: (*slice_dtypes(s), s.scales[scale_of].dtype))


#: ``check`` of ``lowp_step`` (``enum Check`` of ``native/step.h``) per ``nonfinite`` policy.


class Launch:
    """One kernel call over ``members`` (checked slices of one variant, each a contiguous range of
    its parameter), prepared once: its entry point, pointer table, sizes, offsets and parameter
    ids (and a coded variant's scales and grids, ``coded``). A step reuses it while nothing of
    the slices changed but their gradients, which each :meth:`call` takes.

    The arguments of ``lowp_step`` (``native/step.h``), with ``n`` members of ``S`` states:

    - ``n``;
    - ``ptrs[role * n + j]``: member j's weight (role 0), gradient (1; a contiguous, aligned copy
      if it is strided or misaligned), mode buffer or null (2), state k (3 + k; a coded state:
      its codes);
    - ``numel[j]``, and ``offset[j]``: the global index of member j's element 0 in its parameter;
    - ``h``: the gradient's factor, then the variant's numbers (:meth:`OptimizerSpec.pick`);
    - ``tensor_numbers[j * T + k]``: per-tensor number k of member j, made by the spec from the
      sums of a first call (``lowp_sums``) when it has a per-tensor reduction (else zeros), or,
      for a shard of a parameter (:attr:`ParamSlice.tensor_sum
      <lowp.optim.slices.ParamSlice.tensor_sum>`), from its whole tensor's exchanged sum;
    - the optimizer's ``seed``, the ``step`` and ``param_ids[j]``, from which the kernel makes the
      stream keys (:func:`lowp.optim.randomness.stream_keys`, bit for bit);
    - ``check`` (:data:`~lowp.optim.kernels.kernel.CHECKS`) and ``finite[j]``, set to whether
      member j's gradient was finite;
    - a coded variant's scales and grids (``native/coded_step.h``);
    - the thread count, ``torch.get_num_threads()``.

    Args:
        spec: the optimizer's spec (its numbers, and a per-tensor reduction's numbers).
        variant: the compiled variant of every member.
        members: the slices, checked (:func:`check_kernel_args`, :func:`check_coded_args`).
        coded: a coded variant's (scale table, grids); default none.
    """

    def __init__(self, spec: OptimizerSpec, variant: Variant, members: list[ParamSlice],
                 coded: tuple[Any, ...] = ()) -> None:
        if (variant.coded is None) == bool(coded) or (coded and spec.tensor_numbers is not None):
            raise RuntimeError("kernel call: a variant with coded states takes their arguments, and no per-tensor "
                               "reduction (whose pre-pass reads the states); others take neither")
        self.spec, self.variant, self.coded = spec, variant, coded
        names = variant.program.state_names
        n = self.n = len(members)
        self.source = variant_source(spec.name, variant)
        self.entry = coded_step_function(self.source) if coded else step_function(self.source)
        roles = 3 + len(names)
        self.table = (ctypes.c_void_p * (roles * n))()
        for j, s in enumerate(members):
            for role, t in enumerate([s.param, None, s.buffer, *(s.states[k] for k in names)]):
                self.table[role * n + j] = t.data_ptr() if t is not None else None
        self.numel = (ctypes.c_int64 * n)(*(s.numel for s in members))
        self.whole = [s.tensor_sum for s in members]   # a shard's whole-tensor sum, exchanged before the call
        self.offsets = (ctypes.c_int64 * n)(*(s.index.first() for s in members))
        self.param_ids = (ctypes.c_int64 * n)(*(s.param_id for s in members))
        self.finite = (ctypes.c_uint8 * n)()
        self.numbers = (ctypes.c_double * (1 + len(variant.numbers)))()
        self.tensor_numbers = (ctypes.c_double * max(1, n * len(variant.program.tensor_numbers)))()
        self.sums = (ctypes.c_double * n)()   # a per-tensor reduction's sums (lowp_sums), written by each call

    def stage(self, grads: list[torch.Tensor], numbers: dict[str, float], factor: float, seed: int, step: int,
              check: int = 0) -> Callable[[], int]:
        """The step with the members' ``grads`` (checked), the spec's ``numbers`` and the gradient
        ``factor``, after the non-finite ``check`` (:data:`~lowp.optim.kernels.kernel.CHECKS`;
        the flags land in :attr:`finite`), split in two: the copy of a strided or misaligned
        gradient (:func:`~lowp.optim.kernels.checks.kernel_grad`) is made now, and the returned
        call runs the kernel and returns the stalled count (a host int), allocating no tensor.
        The table holds the gradients' pointers for the call only: a kept launch holds no
        gradient between steps."""
        if len(grads) != self.n:
            raise RuntimeError(f"kernel call: {len(grads)} gradients for {self.n} tensors")
        return partial(self._run, list(map(kernel_grad, grads)), numbers, factor, seed, step, check)

    def call(self, grads: list[torch.Tensor], numbers: dict[str, float], factor: float, seed: int, step: int,
             check: int = 0) -> int:
        """:meth:`stage` and run the step at once; returns the stalled count."""
        return self.stage(grads, numbers, factor, seed, step, check)()

    def _run(self, grads: list[torch.Tensor], numbers: dict[str, float], factor: float, seed: int, step: int,
             check: int) -> int:
        spec, n = self.spec, self.n
        self.table[n:2 * n] = [g.data_ptr() for g in grads]
        values = spec.pick(self.variant.numbers, numbers)
        self.numbers[:] = [factor, *values]
        try:
            if spec.tensor_numbers is not None:
                per_tensor = self.variant.program.tensor_numbers
                sums = self.sums
                if any(whole is None for whole in self.whole):
                    sums_function(self.source)(n, self.table, self.numel, self.numbers, sums, torch.get_num_threads())
                for j, whole in enumerate(self.whole):
                    if whole is None:
                        made = spec.tensor_numbers(numbers, sums[j], self.numel[j])
                    elif whole.total is None:
                        raise RuntimeError("kernel call: a shard's whole-tensor sum was not exchanged before its step")
                    else:
                        made = spec.tensor_numbers(numbers, whole.total, whole.numel)
                    for k, name in enumerate(per_tensor):
                        self.tensor_numbers[j * len(per_tensor) + k] = made[name]
            return self.entry(n, self.table, self.numel, self.offsets, self.numbers, self.tensor_numbers, seed, step,
                              self.param_ids, check, self.finite, *self.coded, torch.get_num_threads())
        finally:
            self.table[n:2 * n] = [None] * n
