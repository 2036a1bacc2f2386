"""``backend="triton"``: Adam/AdamW steps through one multi-tensor Triton launch per batch
(:mod:`lowp.optim.kernels.triton_adam`); every other case runs the ``compiled`` backend.

Needs CUDA tensors, or CPU tensors with the Triton interpreter (``TRITON_INTERPRET=1`` set before
triton is imported), which is how the tests check it on machines without a GPU.
"""
from __future__ import annotations

import functools
import os

import torch

from lowp.optim.backends import ParamSlice, StepContext
from lowp.optim.kernels.compiled import CompiledBackend, fusable, partition, step_keys, step_numbers
from lowp.optim.kernels.rules import RULES, rule_for

__all__ = ["TritonBackend", "triton_available", "BLOCK"]

#: Elements per Triton program.
BLOCK = 1024


@functools.lru_cache(maxsize=None)
def triton_available() -> bool:
    """True when triton imports."""
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


class TritonBackend(CompiledBackend):
    """Adam/AdamW (amsgrad off) in one Triton launch per batch; other optimizers, amsgrad and
    unsupported dtypes go through :class:`~lowp.optim.kernels.compiled.CompiledBackend`."""

    name = "triton"

    def __init__(self, chunk_size: int = 1 << 17) -> None:
        if not triton_available():
            raise RuntimeError("backend='triton': triton is not installed")
        super().__init__(chunk_size)

    def run(self, optimizer, ctx, slices):
        rule = rule_for(optimizer)
        stochastic = ctx.group["state_rounding"] == "stochastic"
        ok = (rule is not None and rule.name in ("adam", "adamw") and not ctx.group["amsgrad"]
              and (_interpreting() or all(s.param.is_cuda for s in slices)))
        mine, rest = partition(slices, lambda s: ok and fusable(ctx, s, stochastic))
        counts = [super().run(optimizer, ctx, rest)] if rest else []
        signatures: dict[tuple, list[ParamSlice]] = {}
        for s in mine:
            signatures.setdefault((s.grad.dtype, *(t.dtype for t in s.states.values())), []).append(s)
        counts += [self.launch(rule.name, ctx, group) for group in signatures.values()]
        counts = [c for c in counts if c is not None]
        return torch.stack(counts).sum() if counts else None

    def launch(self, rule_name: str, ctx: StepContext, slices: list[ParamSlice]) -> torch.Tensor | None:
        """One kernel launch over ``slices`` (same dtypes); returns the stalled count."""
        from lowp.optim.kernels.triton_adam import MODE_IDS, adam_kernel, tl_dtype

        device = slices[0].param.device
        rule = RULES[rule_name]
        _, decoupled, has_wd = rule.config(ctx.group)
        h = step_numbers(rule, ctx, device)
        keys = step_keys(ctx, 3, device)
        grads = [s.grad if s.grad.is_contiguous() else s.grad.contiguous() for s in slices]
        sizes = [s.numel for s in slices]
        offsets = [sum(sizes[:i]) for i in range(len(sizes))]
        blocks = [(i, start) for i, n in enumerate(sizes) for start in range(0, n, BLOCK)]

        def table(values: list[int]) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        def ptrs(tensors: list[torch.Tensor]) -> torch.Tensor:
            return table([t.data_ptr() for t in tensors])

        params = [s.param for s in slices]
        m = [s.states["exp_avg"] for s in slices]
        v = [s.states["exp_avg_sq"] for s in slices]
        buffers = [s.buffer if s.buffer is not None else s.param for s in slices]
        stalled = torch.zeros(1, dtype=torch.int64, device=device)
        sr = ctx.group["state_rounding"] == "stochastic"
        adam_kernel[(len(blocks),)](
            ptrs(params), ptrs(grads), ptrs(m), ptrs(v), ptrs(buffers), table(sizes), table(offsets),
            table([b[0] for b in blocks]), table([b[1] for b in blocks]), h, keys, stalled,
            P_T=tl_dtype(params[0].dtype), G_T=tl_dtype(grads[0].dtype), M_T=tl_dtype(m[0].dtype),
            V_T=tl_dtype(v[0].dtype), B_T=tl_dtype(buffers[0].dtype), MODE=MODE_IDS[ctx.mode.name],
            DECOUPLED=decoupled, HAS_WD=has_wd, SR_M=sr and m[0].dtype == torch.bfloat16,
            SR_V=sr and v[0].dtype == torch.bfloat16, COUNT=ctx.count, BLOCK=BLOCK)
        return stalled[0] if ctx.count else None
