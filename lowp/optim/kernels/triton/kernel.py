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
from pathlib import Path
from types import ModuleType

import torch

from lowp.optim.codes import Code
from lowp.optim.kernels.coded_slices import check_coded_args, codes_of
from lowp.optim.kernels.kernel import Kernel, by_signature, slice_keys, step_numbers
from lowp.optim.kernels.triton.source import kernel_source
from lowp.optim.rule import Program
from lowp.optim.slices import ParamSlice, StepContext
from lowp.optim.spec import OptimizerSpec

__all__ = ["TritonKernel", "triton_available", "BLOCK", "NUM_WARPS", "CODED_BLOCK", "CODED_WARPS", "LaunchTables",
           "launch_tables"]

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


class TritonKernel(Kernel):
    """Fused steps through generated Triton kernels; see the module docstring."""

    name = "triton"
    steps_codes = True

    def device_types(self) -> tuple[str, ...]:
        """CUDA memory, and CPU memory under the interpreter."""
        return ("cuda", "cpu") if interpreting() else ("cuda",)

    def __init__(self) -> None:
        if not triton_available():
            raise RuntimeError("backend='triton': triton is not installed")
        super().__init__()

    def run(self, spec: OptimizerSpec, ctx: StepContext, slices: list[ParamSlice]) -> torch.Tensor | None:
        """One launch per dtype signature."""
        return self.run_coded(spec, ctx, slices)

    def run_coded(self, spec: OptimizerSpec, ctx: StepContext, slices: list[ParamSlice]) -> torch.Tensor | None:
        """One launch per dtype signature (the scales' dtype included) over ``slices``, with the
        block scales of the job's coded states (``ctx.coded``; none: a plain step), all admitted
        (:func:`~lowp.optim.kernels.coded_slices.admitted`); the kernel decodes and encodes those
        states in registers. Returns the stalled count."""
        from lowp.optim.kernels.triton.ops import tl_dtype  # imports triton

        codes, block = codes_of(ctx), ctx.group["state_block"]
        groups = by_signature(slices, lambda s: (*_dtypes(s), *(s.scales[name].dtype for name in codes)))
        for members in groups.values():   # every launch's memory checked before the first
            check_coded_args(self.device_types(), members, codes, block)
        program = spec.program(ctx.group)
        kernel = _module(program, ctx.mode.name, tuple(codes.get(name) for name in program.state_names)).step_kernel
        h = step_numbers(spec, program, ctx, slices[0].param.device)
        counts = []
        for members in groups.values():
            counts.append(self.launch(kernel, tl_dtype, ctx, members, h, list(codes), block))
        self.fused_elements += sum(s.numel for s in slices)
        present = [c for c in counts if c is not None]
        return torch.stack(present).sum() if present else None

    @staticmethod
    def launch(kernel, tl_dtype, ctx: StepContext, slices: list[ParamSlice], h: torch.Tensor, coded: list[str],
               block: int) -> torch.Tensor | None:
        """One kernel launch over ``slices`` (of the same dtypes, each a contiguous range of its
        parameter; ``coded``: the names of the states held as codes); returns the stalled count."""
        device = slices[0].param.device
        names = list(slices[0].states)
        grads = [s.grad if s.grad.is_contiguous() else s.grad.contiguous() for s in slices]
        params = [s.param for s in slices]
        buffers = [s.buffer if s.buffer is not None else s.param for s in slices]
        states = [[s.states[name] for s in slices] for name in names]
        scales = [[s.scales[name] for s in slices] for name in names if name in coded]
        block_size, warps = (CODED_BLOCK, CODED_WARPS) if scales else (BLOCK, NUM_WARPS)
        tables = launch_tables(device, block_size, [params, grads, buffers, *states, *scales],
                               [s.numel for s in slices],
                               [s.index.first() for s in slices], [k for s in slices for k in slice_keys(ctx, s)])
        stochastic = ctx.group["state_rounding"] == "stochastic"
        stalled = torch.empty(tables.blocks if ctx.count else 1, dtype=torch.int32, device=device)
        codes = {"SC_T": tl_dtype(scales[0][0].dtype), "CB": block} if scales else {}
        kernel[(tables.blocks,)](
            *tables.pointers, tables.sizes, tables.offsets, tables.block_tensor, tables.block_start,
            h, tables.keys, stalled, P_T=tl_dtype(params[0].dtype), G_T=tl_dtype(grads[0].dtype),
            B_T=tl_dtype(buffers[0].dtype),
            **{f"S{j}_T": tl_dtype(torch.uint8 if name in coded else st[0].dtype)
               for j, (name, st) in enumerate(zip(names, states))},
            **{f"SR{j}": stochastic and (name in coded or st[0].dtype == torch.bfloat16)
               for j, (name, st) in enumerate(zip(names, states))},
            **codes, COUNT=ctx.count, BLOCK=block_size, num_warps=warps, enable_fp_fusion=False)
        return stalled.sum(dtype=torch.int64) if ctx.count else None


@dataclass(frozen=True)
class LaunchTables:
    """The int64 tables of one launch (views into one device buffer).

    Args:
        pointers: one table of data pointers per role (weight, gradient, buffer, each state, the
            scales of each coded state), a pointer per tensor.
        sizes: the element count of each tensor.
        offsets: the global index of each tensor's first element.
        keys: the stream keys of each tensor, concatenated.
        block_tensor: the tensor of each program.
        block_start: the first element (in its tensor) of each program.
        blocks: the number of programs.
    """

    pointers: tuple[torch.Tensor, ...]
    sizes: torch.Tensor
    offsets: torch.Tensor
    keys: torch.Tensor
    block_tensor: torch.Tensor
    block_start: torch.Tensor
    blocks: int


def launch_tables(device: torch.device, block: int, roles: list[list[torch.Tensor]], sizes: list[int],
                  offsets: list[int], keys: list[int]) -> LaunchTables:
    """The tables of one launch of programs of ``block`` elements, sent in one host-to-device
    copy; the block map is built on the device (a host loop over blocks cost more than the step
    itself on a GPU: 250,000 blocks for 256M elements)."""
    n = len(sizes)
    counts = [-(-size // block) for size in sizes]
    packed = [t.data_ptr() for tensors in roles for t in tensors] + sizes + offsets + counts + keys
    table = torch.tensor(packed, dtype=torch.int64, device=device)
    pointers = tuple(table[i * n:(i + 1) * n] for i in range(len(roles)))
    at = len(roles) * n
    sizes_t, offsets_t, counts_t = table[at:at + n], table[at + n:at + 2 * n], table[at + 2 * n:at + 3 * n]
    blocks = sum(counts)
    block_tensor = torch.repeat_interleave(torch.arange(n, device=device), counts_t, output_size=blocks)
    first_block = torch.cumsum(counts_t, 0) - counts_t
    block_start = (torch.arange(blocks, device=device) - first_block[block_tensor]) * block
    return LaunchTables(pointers, sizes_t, offsets_t, table[at + 3 * n:], block_tensor, block_start, blocks)
