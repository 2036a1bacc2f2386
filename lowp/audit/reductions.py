"""Audit of reductions over vectors of length 10 to 1e6.

Inputs are random format values (fixed seed) from a distribution that suits the op:
``U(0, 1/16)`` for sum/mean/cumsum (all positive, so a low-precision running sum stagnates, and
the total of 1e6 of them, ~31000, still fits fp16), ``U(0, 1)`` for norm (the sum of squares of
1e6 of them overflows an fp16 accumulator although the norm, ~577, fits), ``N(1, 0.1)`` for var
(a mean offset that punishes one-pass formulas), ``N(0, 3)`` for the softmax family and
``exp(4 eps N(0, 1))`` for prod (factors a few ulps from 1 whose product of 1e6 stays in
range). The exact value is computed in float64
(``math.fsum`` for sums). Methods: ``native`` (torch in fp16/bf16; its CPU sum accumulates
in fp32, its prod does not), ``opmath`` (fp32, rounded once) and ``lowformat``: a vector engine
with :data:`LANES` lanes, each accumulating a contiguous block sequentially in the format, the
lane results combined by a pairwise tree, every operation rounded to the format. cumsum in that
model is a blocked scan: a sequential scan per lane, an exclusive scan of the lane totals, and
one rounded addition of each lane's offset.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import numpy as np
import torch

from lowp.audit.lowformat import LowFormatMath
from lowp.audit.metrics import correctly_rounded, error_stats
from lowp.audit.unary import METHODS, check_methods, native_result, opmath_result
from lowp.formats import FloatFormat, get_format
from lowp.rounding import quantize

__all__ = ["REDUCTIONS", "LANES", "audit_reductions", "lane_reduce", "blocked_cumsum", "reduction_input"]

LANES = 1024
DEFAULT_LENGTHS = (10, 1000, 100_000, 1_000_000)


def reduction_input(op: str, n: int, fmt: FloatFormat, seed: int = 0) -> torch.Tensor:
    """The audit's input vector for ``op`` (float64 holding values of ``fmt``)."""
    g = torch.Generator().manual_seed(seed)
    if op in ("sum", "mean", "cumsum"):
        x = torch.rand(n, generator=g, dtype=torch.float64) / 16
    elif op == "norm":
        x = torch.rand(n, generator=g, dtype=torch.float64)
    elif op == "var":
        x = 1 + 0.1 * torch.randn(n, generator=g, dtype=torch.float64)
    elif op == "prod":
        x = torch.exp(4 * fmt.eps * torch.randn(n, generator=g, dtype=torch.float64))
    else:
        x = 3 * torch.randn(n, generator=g, dtype=torch.float64)
    return quantize(x, fmt, native=False)


def lane_reduce(low: LowFormatMath, x: torch.Tensor, combine: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
                identity: float) -> torch.Tensor:
    """Reduce ``x`` (1-D) with :data:`LANES` sequential lanes then a pairwise tree, every step rounded."""
    lanes = x.new_full((LANES * math.ceil(x.numel() / LANES),), identity)
    lanes[: x.numel()] = x
    blocks = lanes.view(LANES, -1)
    acc = blocks[:, 0]
    for j in range(1, blocks.shape[1]):
        acc = combine(acc, blocks[:, j])
    while acc.numel() > 1:
        acc = combine(acc[0::2], acc[1::2])
    return acc[0]


def blocked_cumsum(low: LowFormatMath, x: torch.Tensor) -> torch.Tensor:
    """Inclusive prefix sum as a :data:`LANES`-lane blocked scan, every addition rounded."""
    n = x.numel()
    padded = x.new_zeros(LANES * math.ceil(n / LANES))
    padded[:n] = x
    blocks = padded.view(LANES, -1)
    local = torch.empty_like(blocks)
    local[:, 0] = blocks[:, 0]
    for j in range(1, blocks.shape[1]):
        local[:, j] = low.add(local[:, j - 1], blocks[:, j])
    offsets = torch.zeros(LANES, dtype=x.dtype)
    for lane in range(1, LANES):
        offsets[lane] = low.add(offsets[lane - 1], local[lane - 1, -1])
    return low.add(local, offsets[:, None]).flatten()[:n]


def _low_sum(low: LowFormatMath, x: torch.Tensor) -> torch.Tensor:
    return lane_reduce(low, x, low.add, 0.0)


def _low_var(low: LowFormatMath, x: torch.Tensor) -> torch.Tensor:
    d = low.sub(x, low.mul(_low_sum(low, x), low.const(1.0 / x.numel())))
    return low.mul(_low_sum(low, low.square(d)), low.const(1.0 / (x.numel() - 1)))


def _low_exp_shifted(low: LowFormatMath, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(x - max, sum(exp(x - max)))``, the shared start of logsumexp and the softmaxes."""
    shifted = low.sub(x, x.max())
    return shifted, _low_sum(low, low.exp(shifted))


def _low_softmax(low: LowFormatMath, x: torch.Tensor, log: bool) -> torch.Tensor:
    shifted, total = _low_exp_shifted(low, x)
    return low.sub(shifted, low.log(total)) if log else low.div(low.exp(shifted), total)


LowFn = Callable[[LowFormatMath, torch.Tensor], torch.Tensor]
_LOW: dict[str, LowFn] = {
    "sum": _low_sum,
    "mean": lambda low, x: low.mul(_low_sum(low, x), low.const(1.0 / x.numel())),
    "var": _low_var,
    "norm": lambda low, x: low.sqrt(_low_sum(low, low.square(x))),
    "logsumexp": lambda low, x: low.add(x.max(), low.log(_low_exp_shifted(low, x)[1])),
    "softmax": lambda low, x: _low_softmax(low, x, log=False),
    "log_softmax": lambda low, x: _low_softmax(low, x, log=True),
    "cumsum": blocked_cumsum,
    "prod": lambda low, x: lane_reduce(low, x, low.mul, 1.0),
}

_TORCH: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "sum": torch.sum, "mean": torch.mean, "var": torch.var, "norm": torch.linalg.vector_norm,
    "logsumexp": lambda x: torch.logsumexp(x, 0), "softmax": lambda x: torch.softmax(x, 0),
    "log_softmax": lambda x: torch.log_softmax(x, 0), "cumsum": lambda x: torch.cumsum(x, 0), "prod": torch.prod,
}


def _exact(op: str, x: np.ndarray) -> np.ndarray:
    if op == "sum":
        return np.array(math.fsum(x))
    if op == "mean":
        return np.array(math.fsum(x) / x.size)
    if op == "var":
        return np.array(np.var(x, ddof=1))
    if op == "norm":
        return np.array(math.sqrt(math.fsum(x * x)))
    m = x.max()
    lse = m + math.log(math.fsum(np.exp(x - m)))
    return {"logsumexp": lambda: np.array(lse), "softmax": lambda: np.exp(x - lse), "log_softmax": lambda: x - lse,
            "cumsum": lambda: np.cumsum(x), "prod": lambda: np.array(np.prod(x))}[op]()


REDUCTIONS = tuple(_TORCH)


def audit_reductions(ops: "Iterable[str] | None" = None, formats: Iterable["str | FloatFormat"] = ("fp16", "bf16"),
                     methods: Iterable[str] = METHODS, lengths: Iterable[int] = DEFAULT_LENGTHS,
                     progress: bool = False) -> list[dict[str, object]]:
    """One row per (op, format, method, length)."""
    from tqdm import tqdm

    methods = check_methods(methods)
    names = list(REDUCTIONS if ops is None else ops)
    unknown = [n for n in names if n not in _TORCH]
    if unknown:
        raise ValueError(f"ops: unknown reduction(s) {', '.join(unknown)}; expected some of {', '.join(REDUCTIONS)}")
    lengths = [int(n) for n in lengths]
    if any(n < 2 for n in lengths):
        raise ValueError(f"lengths: expected lengths >= 2, got {lengths}")
    rows: list[dict[str, object]] = []
    jobs = [(op, get_format(f), n) for f in formats for op in names for n in lengths]
    for op, fmt, n in tqdm(jobs, desc="reduction audit", unit="case", disable=not progress):
        x = reduction_input(op, n, fmt)
        exact = torch.from_numpy(np.asarray(_exact(op, x.numpy()), dtype=np.float64)).reshape(-1)
        correct = correctly_rounded(exact, fmt)
        for method in methods:
            got = _compute(op, method, x, fmt)
            if got is None:
                continue
            stats = error_stats(got.reshape(-1), exact, fmt, correct)
            stats.pop("worst_index")
            rows.append({"kind": "reduction", "op": op, "format": fmt.name, "method": method, "length": n, **stats})
    return rows


def _compute(op: str, method: str, x: torch.Tensor, fmt: FloatFormat) -> torch.Tensor | None:
    if method == "native":
        return native_result(_TORCH[op], (x,), fmt)
    if method == "opmath":
        return opmath_result(_TORCH[op], (x,), fmt)
    if method == "lowformat":
        low = LowFormatMath(fmt)
        return _LOW[op](low, x.to(low.dtype)).double()
    raise ValueError(f"methods: unknown {method!r}; expected some of {METHODS}")
