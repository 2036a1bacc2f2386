"""``backend="triton"``: SGD, Adam/AdamW, Lion and RAdam steps through one multi-tensor Triton
launch per batch of parameters with the same dtypes (:mod:`lowp.optim.kernels.triton_step`);
every other case runs the ``compiled`` backend.

Needs CUDA tensors, or CPU tensors with the Triton interpreter (``TRITON_INTERPRET=1`` set before
triton is imported), which is how the tests check it on machines without a GPU.
"""
from __future__ import annotations

import functools
import os

import torch

from lowp.optim.backends import ParamSlice, StepContext
from lowp.optim.kernels.compiled import CompiledBackend, by_signature, fusable, partition, slice_keys, step_numbers
from lowp.optim.kernels.rules import Rule, rule_for

__all__ = ["TritonBackend", "triton_available", "BLOCK"]

#: Elements per Triton program.
BLOCK = 1024
_TRITON_RULES = ("adam", "adamw", "sgd", "lion", "radam")


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when triton imports."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def _dtypes(s: ParamSlice) -> tuple[torch.dtype, ...]:
    """What one launch needs in common: the gradient's and the states' dtypes."""
    return (s.grad.dtype, *(t.dtype for t in s.states.values()))


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class TritonBackend(CompiledBackend):
    """Every elementwise rule in one Triton launch per batch; StableAdamW, Adafactor and
    unsupported dtypes go through :class:`~lowp.optim.kernels.compiled.CompiledBackend`.
    ``fused_elements`` counts the elements updated by a kernel (the Triton one, or a compiled one
    for what Triton leaves), ``reference_elements`` those that took the reference pipeline."""

    name = "triton"

    def __init__(self, chunk_size: int = 1 << 17) -> None:
        if not triton_available():
            raise RuntimeError("backend='triton': triton is not installed")
        super().__init__(chunk_size)

    def run(self, optimizer, ctx, slices):
        rule = rule_for(optimizer)
        stochastic = ctx.group["state_rounding"] == "stochastic"
        ok = (rule is not None and rule.name in _TRITON_RULES
              and (_interpreting() or all(s.param.is_cuda for s in slices)))
        mine, rest = partition(slices, lambda s: ok and fusable(ctx, s, stochastic))
        counts = [super().run(optimizer, ctx, rest)] if rest else []
        if mine:  # the step's numbers once, as on the compiled backend
            h = step_numbers(rule, ctx, mine[0].param.device)
            counts += [self.launch(rule, ctx, members, h) for members in by_signature(mine, _dtypes).values()]
        counts = [c for c in counts if c is not None]
        return torch.stack(counts).sum() if counts else None

    def launch(self, rule: Rule, ctx: StepContext, slices: list[ParamSlice], h: torch.Tensor) -> torch.Tensor | None:
        """One kernel launch over ``slices`` (of the same dtypes, each a contiguous range of its
        parameter); returns the stalled count."""
        from lowp.optim.kernels.triton_step import MODE_IDS, RULE_IDS, step_kernel, tl_dtype

        device = slices[0].param.device
        names = list(slices[0].states)
        cfg = [bool(c) for c in rule.config(ctx.group)] + [False] * 3
        grads = [s.grad if s.grad.is_contiguous() else s.grad.contiguous() for s in slices]
        sizes = [s.numel for s in slices]
        offsets = [s.index.first() for s in slices]
        keys = torch.tensor([k for s in slices for k in slice_keys(ctx, s)], dtype=torch.int64, device=device)
        blocks = [(i, start) for i, n in enumerate(sizes) for start in range(0, n, BLOCK)]

        def table(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        def ptrs(tensors: list[torch.Tensor]) -> torch.Tensor:
            return table([t.data_ptr() for t in tensors])

        params = [s.param for s in slices]
        buffers = [s.buffer if s.buffer is not None else s.param for s in slices]
        # absent states point at the weights (never read or written: NSTATES says how many exist)
        states = [[s.states[names[j]] if j < len(names) else s.param for s in slices] for j in range(3)]
        sr = [ctx.group["state_rounding"] == "stochastic" and st[0].dtype == torch.bfloat16 for st in states]
        stalled = torch.zeros(1, dtype=torch.int64, device=device)
        step_kernel[(len(blocks),)](
            ptrs(params), ptrs(grads), ptrs(buffers), *(ptrs(st) for st in states), table(sizes), table(offsets),
            table([b[0] for b in blocks]), table([b[1] for b in blocks]), h, keys, stalled,
            P_T=tl_dtype(params[0].dtype), G_T=tl_dtype(grads[0].dtype), B_T=tl_dtype(buffers[0].dtype),
            S0_T=tl_dtype(states[0][0].dtype), S1_T=tl_dtype(states[1][0].dtype), S2_T=tl_dtype(states[2][0].dtype),
            NSTATES=len(names), SR0=sr[0], SR1=sr[1], SR2=sr[2], RULE=RULE_IDS[rule.name], C0=cfg[0], C1=cfg[1],
            C2=cfg[2], MODE=MODE_IDS[ctx.mode.name], COUNT=ctx.count, BLOCK=BLOCK)
        self.fused_elements += sum(sizes)
        return stalled[0] if ctx.count else None
