"""The Triton kernel (``backend="triton"``): every spec with an elementwise rule, in every
write-back mode, through one multi-tensor launch per batch of parameters with the same dtypes.
The kernel of each rule variant is generated from the spec (:mod:`~lowp.optim.kernels.triton.source`),
written to a private temporary folder (Triton compiles from source files) and imported once.

Needs CUDA tensors, or CPU tensors with the Triton interpreter (``TRITON_INTERPRET=1`` set before
triton is imported), which is how the tests check it on machines without a GPU.

The kernels are compiled with ``enable_fp_fusion=False``: Triton would otherwise contract a
product and a sum into one fused multiply-add wherever it can, which rounds once where the
definition (ATen's CPU kernels, :mod:`lowp.optim.rule`) rounds twice; the rule's own ``fma``
operations are explicit ``tl.fma`` calls and stay fused. So a step on the GPU is bit-identical to
the ``foreach`` reference on the CPU.
"""
from __future__ import annotations

import atexit
import functools
import hashlib
import importlib.util
import os
import shutil
import tempfile
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

import numpy as np
import torch

from lowp.optim.codes import Code
from lowp.optim.kernels.checks import PLAIN_TYPES, kernel_grad
from lowp.optim.kernels.coded_slices import check_coded_args, codes_of
from lowp.optim.kernels.kernel import Kernel, by_signature, stream_count
from lowp.optim.kernels.triton.source import kernel_source
from lowp.optim.randomness import stream_key_table
from lowp.optim.rule import Program
from lowp.optim.slices import ParamSlice, StepContext
from lowp.optim.spec import OptimizerSpec
from lowp.optim.stalled import Stalled

__all__ = ["TritonKernel", "TritonLaunch", "triton_available", "BLOCK", "NUM_WARPS", "CODED_BLOCK", "CODED_WARPS",
           "LaunchTables", "launch_tables"]

#: Elements per Triton program and its warps, without and with block-scaled states: on an H100 an
#: AdamW step over 256M elements with bf16 states took 2.5 ms at (512, 4), 3.1 ms at (1024, 8) and
#: 2.6 ms at (256, 2); with int8/uint8 states 5.8, 6.5 and 3.8 ms (torch 2.11, Triton 3.6).
BLOCK, NUM_WARPS = 512, 4
CODED_BLOCK, CODED_WARPS = 256, 2


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when triton imports."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def interpreting() -> bool:
    """True when Triton runs its interpreter on CPU tensors (``TRITON_INTERPRET=1``)."""
    return os.environ.get("TRITON_INTERPRET") == "1"


@functools.lru_cache(maxsize=None)
def _folder() -> Path:
    path = Path(tempfile.mkdtemp(prefix="lowp-triton-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.lru_cache(maxsize=None)
def _module(program: Program, mode: str, codes: tuple[Code | None, ...] = ()) -> ModuleType:
    """The generated kernel module of ``program`` in write-back ``mode`` (with the block-scaled
    ``codes`` per state), imported from this process's private folder."""
    source = kernel_source(program, mode, codes)
    name = f"lowp_triton_step_{hashlib.sha256(source.encode()).hexdigest()[:16]}"
    path = _folder() / f"{name}.py"
    path.write_text(source)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _dtypes(s: ParamSlice) -> tuple[torch.dtype, ...]:
    """What one launch needs in common: the gradient's and the states' dtypes."""
    return (s.grad.dtype, *(t.dtype for t in s.states.values()))


def _plain_grad(g: torch.Tensor, devices: tuple[str, ...]) -> bool:
    """A gradient the check kernel reads: plain, strided, contiguous, of a kernel float dtype, in
    memory of one of ``devices``."""
    return type(g) in PLAIN_TYPES and g.layout is torch.strided and g.is_contiguous() \
        and g.dtype in (torch.float32, torch.bfloat16, torch.float16) and g.device.type in devices


class TritonKernel(Kernel):
    """Fused steps through generated Triton kernels; see the module docstring."""

    name = "triton"
    steps_codes = True
    keeps_plans = True

    def device_types(self) -> tuple[str, ...]:
        """CUDA memory, and CPU memory under the interpreter."""
        return ("cuda", "cpu") if interpreting() else ("cuda",)

    def __init__(self) -> None:
        if not triton_available():
            raise RuntimeError("backend='triton': triton is not installed")
        super().__init__()

    def run(self, spec: OptimizerSpec, ctx: StepContext, slices: list[ParamSlice]) -> Stalled:
        """One launch per dtype signature."""
        return self.run_coded(spec, ctx, slices)

    def run_coded(self, spec: OptimizerSpec, ctx: StepContext, slices: list[ParamSlice]) -> Stalled:
        """One launch per dtype signature (the scales' dtype included) over ``slices``, with the
        block scales of the job's coded states (``ctx.coded``; none: a plain step), all admitted
        (:func:`~lowp.optim.kernels.coded_slices.admitted`); the kernel decodes and encodes those
        states in registers. Returns the stalled count."""
        return self.prepare(spec, ctx, slices)()

    def launches(self, spec: OptimizerSpec, ctx: StepContext, slices: list[ParamSlice]
                 ) -> list[tuple[TritonLaunch, list[ParamSlice]]]:
        """The checked launches over admitted ``slices`` of one job, each with its members: one
        per dtype signature (the scales' dtype included). A step runs them once; a cached plan
        (:mod:`lowp.optim.cached_step`) keeps them for the next steps."""
        codes, block = codes_of(ctx), ctx.group["state_block"]
        groups = by_signature(slices, lambda s: (*_dtypes(s), *(s.scales[name].dtype for name in codes)))
        for members in groups.values():   # every launch's memory checked before the first
            check_coded_args(self.device_types(), members, codes, block)
        program = spec.program(ctx.group)
        kernel = _module(program, ctx.mode.name, tuple(codes.get(name) for name in program.state_names)).step_kernel
        stochastic = ctx.group["state_rounding"] == "stochastic"
        return [(TritonLaunch(kernel, spec, program, members, list(codes), block, stochastic, ctx.count), members)
                for members in groups.values()]

    def finite_flags(self, grads: list[torch.Tensor]) -> list[bool | None]:
        """Per gradient: finite, by the check kernel (:mod:`~lowp.optim.kernels.triton.finite`:
        one launch per device and dtype, one read of the flags per device) for plain contiguous
        gradients in this kernel's memory; ``None`` (the generic check) for the others."""
        from lowp.optim.kernels.triton.finite import finite_kernel
        from lowp.optim.kernels.triton.ops import tl_dtype

        devices = self.device_types()
        taken = by_signature([i for i, g in enumerate(grads) if _plain_grad(g, devices)],
                             lambda i: (grads[i].device, grads[i].dtype))
        flags: list[bool | None] = [None] * len(grads)
        read: dict[torch.device, list[tuple[list[int], torch.Tensor]]] = {}
        for (device, dtype), members in taken.items():
            tables = launch_tables(device, BLOCK, [[grads[i] for i in members]], [grads[i].numel() for i in members],
                                   [0] * len(members))
            found = torch.zeros(1 + len(members), dtype=torch.int32, device=device)
            if tables.blocks:
                finite_kernel[(tables.blocks,)](tables.pointers[0], tables.sizes, tables.block_tensor,
                                                tables.block_start, found, G_T=tl_dtype(dtype), BLOCK=BLOCK,
                                                num_warps=NUM_WARPS)
            read.setdefault(device, []).append((members, found[1:]))
        for launched in read.values():
            values = iter(torch.cat([found for _, found in launched]).tolist())   # one read per device
            for members, _ in launched:
                for i in members:
                    flags[i] = next(values) == 0
        return flags


class TritonLaunch:
    """One kernel launch over ``members`` (checked slices of one dtype signature, each a
    contiguous range of its parameter), prepared once: its tables of the weights', buffers',
    states' and block scales' pointers, sizes, offsets and block map on the device
    (:func:`launch_tables`), the parameter ids and the kernel's type arguments. A step reuses it
    while nothing of the slices changed but their gradients, which each :meth:`call` takes.

    What changes from step to step (the gradients' pointers, the stream keys, made on the host
    from the seed, the step and the parameter ids by
    :func:`~lowp.optim.randomness.stream_key_table`, the non-finite flags, zeroed, and the
    numbers ``H``) goes to the device in one copy per call.

    Args:
        kernel: the generated step kernel (:func:`~lowp.optim.kernels.triton.source.kernel_source`).
        spec: the optimizer's spec (which picks the variant's numbers).
        program: the traced rule of the variant.
        members: the slices, checked (:func:`~lowp.optim.kernels.coded_slices.check_coded_args`).
        coded: the names of the states held as block-scaled codes.
        block: the code block (``state_block``).
        stochastic: whether 16-bit and coded states round stochastically.
        count: whether the launch counts stalled weights.
    """

    def __init__(self, kernel: Any, spec: OptimizerSpec, program: Program, members: list[ParamSlice],
                 coded: list[str], block: int, stochastic: bool, count: bool) -> None:
        from lowp.optim.kernels.triton.ops import tl_dtype  # imports triton

        self.kernel, self.spec, self.numbers, self.count = kernel, spec, program.numbers, count
        self.device = members[0].param.device
        names = list(members[0].states)
        n = self.n = len(members)
        params = [s.param for s in members]
        buffers = [s.buffer if s.buffer is not None else s.param for s in members]
        states = [[s.states[name] for s in members] for name in names]
        scales = [[s.scales[name] for s in members] for name in names if name in coded]
        self.block_size, warps = (CODED_BLOCK, CODED_WARPS) if scales else (BLOCK, NUM_WARPS)
        # the gradients' pointers are the call's (its one copy to the device)
        self.tables = launch_tables(self.device, self.block_size, [params, buffers, *states, *scales],
                                    [s.numel for s in members], [s.index.first() for s in members])
        self.param_ids = np.array([s.param_id for s in members], dtype=np.uint64)
        self.streams = stream_count(len(names))
        grad_dtype = members[0].grad.dtype
        self.grad_type = tl_dtype(grad_dtype)
        self.types: dict[str, Any] = dict(
            P_T=tl_dtype(params[0].dtype), G_T=self.grad_type, B_T=tl_dtype(buffers[0].dtype),
            **{f"S{j}_T": tl_dtype(torch.uint8 if name in coded else st[0].dtype)
               for j, (name, st) in enumerate(zip(names, states))},
            **{f"SR{j}": stochastic and (name in coded or st[0].dtype == torch.bfloat16)
               for j, (name, st) in enumerate(zip(names, states))},
            **({"SC_T": tl_dtype(scales[0][0].dtype), "CB": block} if scales else {}),
            COUNT=count, BLOCK=self.block_size, num_warps=warps, enable_fp_fusion=False)
        keys_at = 8 * n
        flags_at = keys_at + 8 * n * self.streams
        numbers_at = flags_at + 8 * (1 + (n + 1) // 2)   # n + 1 int32 flags, padded to 8 bytes
        self._layout = (keys_at, flags_at, numbers_at, numbers_at + 4 * (1 + len(self.numbers)))
        self.finite = [True] * n
        # on a GPU the check's flags come back through pinned memory, read once an event says
        # they arrived, while the step kernel already runs
        on_gpu = self.device.type == "cuda"
        self._found = torch.empty(n + 1, dtype=torch.int32, pin_memory=True) if on_gpu else None
        self._arrived = torch.cuda.Event() if on_gpu else None

    def stage(self, grads: list[torch.Tensor], numbers: dict[str, float], factor: float, seed: int, step: int,
              check: int = 0) -> Callable[[], torch.Tensor | None]:
        """The step with the members' ``grads`` (checked; a strided one is copied contiguous), the
        spec's ``numbers`` and the gradient ``factor``, after the non-finite ``check``
        (:data:`~lowp.optim.kernels.kernel.CHECKS`: the check kernel first, its flags read back
        into :attr:`finite`), split in two: the device memory it needs (the gradient copies, the
        call's arguments sent in one copy, the per-block stalled counts) is allocated now, and
        the returned call launches the kernels and returns the stalled counts (the per-block
        device tensor, :mod:`lowp.optim.stalled`) when counting. No gradient is held after the
        call."""
        n = self.n
        if len(grads) != n:
            raise RuntimeError(f"kernel call: {len(grads)} gradients for {n} tensors")
        grads = list(map(kernel_grad, grads))   # alive until the launch is queued
        keys_at, flags_at, numbers_at, end = self._layout
        host = np.zeros(end, dtype=np.uint8)
        host[:keys_at].view(np.int64)[:] = [g.data_ptr() for g in grads]
        host[keys_at:flags_at].view(np.uint64)[:] = stream_key_table(seed, step, self.param_ids,
                                                                     self.streams).reshape(-1)
        host[numbers_at:end].view(np.float32)[:] = [factor, *self.spec.pick(self.numbers, numbers)]
        sent = torch.from_numpy(host).to(self.device)
        stalled = torch.empty(self.tables.blocks if self.count else 1, dtype=torch.int32, device=self.device)
        return partial(self._run, grads, sent, stalled, check)

    def call(self, grads: list[torch.Tensor], numbers: dict[str, float], factor: float, seed: int, step: int,
             check: int = 0) -> torch.Tensor | None:
        """:meth:`stage` and launch at once; returns the stalled counts when counting."""
        return self.stage(grads, numbers, factor, seed, step, check)()

    def _run(self, grads: list[torch.Tensor], sent: torch.Tensor, stalled: torch.Tensor, check: int
             ) -> torch.Tensor | None:
        """The launches of a staged call (``grads`` kept alive until they are queued)."""
        from lowp.optim.kernels.triton.finite import finite_kernel

        n, tables = self.n, self.tables
        keys_at, flags_at, numbers_at, end = self._layout
        pointers, keys = sent[:keys_at].view(torch.int64), sent[keys_at:flags_at].view(torch.int64)
        flags, h = sent[flags_at:flags_at + 4 * (n + 1)].view(torch.int32), sent[numbers_at:end].view(torch.float32)
        blocks = tables.blocks
        found = flags
        if check:
            finite_kernel[(blocks,)](pointers, tables.sizes, tables.block_tensor, tables.block_start, flags,
                                     G_T=self.grad_type, BLOCK=self.block_size, num_warps=self.types["num_warps"])
            if self._found is not None and self._arrived is not None:
                found = self._found
                found.copy_(flags, non_blocking=True)
                self._arrived.record()
        weights, *rest = tables.pointers
        self.kernel[(blocks,)](weights, pointers, *rest, tables.sizes, tables.offsets, tables.block_tensor,
                               tables.block_start, h, keys, stalled, flags, CHECK=check, **self.types)
        if check:
            if self._arrived is not None:
                self._arrived.synchronize()
            self.finite = [bad == 0 for bad in found[1:n + 1].tolist()]
        return stalled if self.count else None


@dataclass(frozen=True)
class LaunchTables:
    """The int64 tables of one launch (views into one device buffer).

    Args:
        pointers: one table of data pointers per role (a step's: weight, buffer, each state, the
            scales of each coded state; the check's: gradient), a pointer per tensor.
        sizes: the element count of each tensor.
        offsets: the global index of each tensor's first element.
        block_tensor: the tensor of each program.
        block_start: the first element (in its tensor) of each program.
        blocks: the number of programs.
    """

    pointers: tuple[torch.Tensor, ...]
    sizes: torch.Tensor
    offsets: torch.Tensor
    block_tensor: torch.Tensor
    block_start: torch.Tensor
    blocks: int


def launch_tables(device: torch.device, block: int, roles: list[list[torch.Tensor]], sizes: list[int],
                  offsets: list[int]) -> LaunchTables:
    """The tables of one launch of programs of ``block`` elements, sent in one host-to-device
    copy; the block map is built on the device (a host loop over blocks cost more than the step
    itself on a GPU: 250,000 blocks for 256M elements)."""
    n = len(sizes)
    counts = [-(-size // block) for size in sizes]
    packed = [t.data_ptr() for tensors in roles for t in tensors] + sizes + offsets + counts
    table = torch.tensor(packed, dtype=torch.int64, device=device)
    pointers = tuple(table[i * n:(i + 1) * n] for i in range(len(roles)))
    at = len(roles) * n
    sizes_t, offsets_t, counts_t = table[at:at + n], table[at + n:at + 2 * n], table[at + 2 * n:at + 3 * n]
    blocks = sum(counts)
    block_tensor = torch.repeat_interleave(torch.arange(n, device=device), counts_t, output_size=blocks)
    first_block = torch.cumsum(counts_t, 0) - counts_t
    block_start = (torch.arange(blocks, device=device) - first_block[block_tensor]) * block
    return LaunchTables(pointers, sizes_t, offsets_t, block_tensor, block_start, blocks)
