"""Accuracy of the safe RMSNorm/LayerNorm (and torch's) against the fp64 formula on hard rows."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from lowp.norms.modules import LayerNorm, RMSNorm
from lowp.ulp import ulp_error

__all__ = ["hard_rows", "reference_norm", "ModuleScore", "module_scores"]


def reference_norm(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float, center: bool
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x64, y64)``: the textbook formula in float64 on the exact upcast inputs, with autograd
    (call ``y64.backward(g)`` and read ``x64.grad``)."""
    x64 = x.detach().double().requires_grad_()
    d = x64 - x64.mean(-1, keepdim=True) if center else x64
    y = d / torch.sqrt((d * d).mean(-1, keepdim=True) + eps) * weight.detach().double()
    if bias is not None:
        y = y + bias.detach().double()
    return x64, y


def hard_rows(dtype: torch.dtype, width: int = 256) -> dict[str, torch.Tensor]:
    """Rows (float32, values to be cast to ``dtype``) that overflow, underflow or cancel in the
    plain formula: random normal, near the maximum, large nearly equal values (a few ulps apart:
    fp16 around 1000, bf16 around 2**60), zeros, random rows scaled by 2**k across the range, and
    tiny values."""
    g = torch.Generator().manual_seed(1)
    info = torch.finfo(dtype)
    low, high = (-20, 14) if dtype == torch.float16 else (-120, 120)
    k = torch.randint(low, high, (64, 1), generator=g).float()
    center = 1000.0 if dtype == torch.float16 else 2.0**60
    return {
        "normal": torch.randn(32, width, generator=g),
        "near-max": info.max * (1 - torch.rand(32, width, generator=g) * 0.01),
        "near-equal": center * (1 + torch.randint(-3, 4, (32, width), generator=g).float() * info.eps),
        "zeros": torch.zeros(4, width),
        "scaled": torch.randn(64, width, generator=g) * torch.exp2(k),
        "tiny": torch.randn(32, width, generator=g) * info.smallest_normal * 8,
    }


@dataclass(frozen=True)
class ModuleScore:
    """Accuracy of lowp's and torch's norm module on one family of :func:`hard_rows`.

    Args:
        case: the family's name (``"normal"``, ``"near-max"`` ...).
        max_ulp: largest forward error of lowp's module, in ulps of the dtype.
        torch_max_ulp: the same for torch's module on the same rows and parameters.
        grad_error: ``max |dx - dx64| / max |dx64|`` per row, over the rows whose exact input
            gradient fits the dtype (0.0 when there is none).
        grad_rows: rows whose gradient was checked (0 when every exact gradient overflows).
        grad_finite: whether lowp's gradient is finite on those rows.
    """

    case: str
    max_ulp: float          # lowp's forward, ulps of the dtype
    torch_max_ulp: float    # torch's module on the same rows
    grad_error: float       # max |dx - dx64| / max |dx64| over rows whose true gradient fits the dtype
    grad_rows: int          # rows checked (0 when every true gradient overflows the dtype)
    grad_finite: bool       # lowp's gradient is finite on those rows


def module_scores(dtype: torch.dtype, center: bool, eps: float = 1e-12, width: int = 256) -> list[ModuleScore]:
    """Forward and backward of ``LayerNorm`` (``center``) or ``RMSNorm`` in ``dtype`` on
    :func:`hard_rows`, random weight (and bias), against :func:`reference_norm`."""
    cls, torch_cls = (LayerNorm, torch.nn.LayerNorm) if center else (RMSNorm, torch.nn.RMSNorm)
    gen = torch.Generator().manual_seed(2)
    scores = []
    for name, rows in hard_rows(dtype, width).items():
        x = rows.to(dtype)
        ours = cls(width, eps=eps).to(dtype)
        bias = ours.bias if isinstance(ours, LayerNorm) else None   # LayerNorm exactly when center
        with torch.no_grad():
            ours.weight.copy_(torch.rand(width, generator=gen) + 0.5)
            if bias is not None:
                bias.copy_(torch.randn(width, generator=gen) * 0.1)
        theirs = torch_cls(width, eps=eps).to(dtype)
        theirs.load_state_dict(ours.state_dict())
        xg = x.clone().requires_grad_()
        y = ours(xg)
        gy = torch.randn(y.shape, generator=gen).to(dtype)
        y.backward(gy)
        x64, ref = reference_norm(x, ours.weight, bias, eps, center)
        ref.backward(gy.double())
        assert x64.grad is not None and xg.grad is not None   # both are leaves of the backward passes
        with torch.no_grad():
            torch_y = theirs(x)
        fits = (x64.grad.abs() <= torch.finfo(dtype).max).all(-1)
        got, want = xg.grad.double()[fits], x64.grad[fits]
        scale = want.abs().amax(-1, keepdim=True).clamp(min=torch.finfo(torch.float64).tiny)
        grad_error = float(((got - want).abs() / scale).max()) if bool(fits.any()) else 0.0
        scores.append(ModuleScore(
            case=name, max_ulp=float(ulp_error(y.detach().double(), ref.detach(), dtype).max()),
            torch_max_ulp=float(ulp_error(torch_y.double(), ref.detach(), dtype).max()),
            grad_error=grad_error, grad_rows=int(fits.sum()), grad_finite=bool(torch.isfinite(got).all())))
    return scores
