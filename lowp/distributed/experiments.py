"""The experiments behind ``lowp reduce-sim`` and ``benchmarks/reduce_sim.py``: the grid of the post
"Why reduction precision matters" and the regimes where low-precision reduction does hurt. Each
returns ``(headers, rows)``.

Every error is reported against the gradient's own sampling noise ``sigma / sqrt(R)`` (the std
of a mean of R per-rank gradients), which is what decides whether training can notice.

Each function checks its largest simulation against the simulator's limits before any work
(ValueError naming ``world_size`` or ``elements``) and calls ``progress()``, when given, after
every row.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch

from lowp.distributed import model
from lowp.distributed.simulator import (GaussianGrads, ReduceConfig, accumulate, check_size, exact_reduce,
                                        measure_error, reduce, wire_reduce)
from lowp.rounding import quantize

__all__ = ["SEED_WORLD_SIZES", "SEED_SIGMAS", "seed_grid", "mean_bias_table", "microbatch_table", "fp16_table",
           "fp8_table", "premultiply_table", "outlier_table", "WIRE_WORLD_SIZES", "WIRE_METHODS", "wire_grads",
           "wire_table"]

SEED_WORLD_SIZES: tuple[int, ...] = tuple(2**i for i in range(1, 11))
SEED_SIGMAS: tuple[float, ...] = tuple(2.0**-i for i in range(8, 3, -1))
Table = tuple[list[str], list[list[Any]]]
Progress = Callable[[], None]


def _tick(progress: "Progress | None") -> None:
    """Report one finished row (or one world size of the seed grid) to the caller's progress bar."""
    if progress is not None:
        progress()


def _check_sizes(world_sizes: Sequence[int], elements: int, per_rank: int = 1) -> None:
    """ValueError naming ``world_size`` or ``elements`` when the largest simulation is beyond the
    simulator's limits (:func:`lowp.distributed.simulator.check_size`), before any work."""
    if not world_sizes:
        raise ValueError("world_sizes: expected at least one world size")
    check_size(max(world_sizes), elements)
    check_size(max(world_sizes), elements * per_rank)


def seed_grid(world_sizes: Sequence[int] = SEED_WORLD_SIZES, sigmas: Sequence[float] = SEED_SIGMAS,
              elements: int = 4096, fmt: str = "bf16", seed: int = 0,
              algorithms: Sequence[str] = ("ring", "tree", "alltoall"), progress: "Progress | None" = None) -> Table:
    """The experiment of "Why reduction precision matters": inputs ``N(0, sigma**2)`` in ``fmt``,
    pre-divided by R and reduced by each algorithm; error std (in units of sigma) measured against
    the exact fp64 mean and predicted by :mod:`lowp.distributed.model`. ``seed_std`` is the seed's
    own metric (std of ring - fl(exact)). All sigmas run in one pass per R."""
    _check_sizes(world_sizes, elements, len(sigmas))
    headers = ["R", "sigma", "seed_std/sigma"]
    for alg in algorithms:
        headers += [f"{alg}/sigma", f"{alg}_model"]
    headers.append("ring/noise")
    gen = torch.Generator().manual_seed(seed)
    rows = []
    for R in world_sizes:
        x = torch.cat([GaussianGrads(s, fmt=fmt).sample(R, elements, gen) for s in sigmas], dim=1)
        exact = exact_reduce(x)
        results = {alg: reduce(x, ReduceConfig(alg, fmt)) for alg in dict.fromkeys(("ring", *algorithms))}
        errors = {alg: (got - exact).view(len(sigmas), elements) for alg, got in results.items()}
        seed_err = (results["ring"] - quantize(exact, fmt, native=False)).view(len(sigmas), elements)
        for i, s in enumerate(sigmas):
            row: list[object] = [R, s, float(seed_err[i].std()) / s]
            for alg in algorithms:
                row += [float(errors[alg][i].std()) / s, model.reduction_error_std(alg, R, s, fmt) / s]
            rows.append(row + [float(errors["ring"][i].std()) / model.sampling_noise(R, s)])
            _tick(progress)
    return headers, rows


def mean_bias_table(world_sizes: Sequence[int] = (64, 256, 1024, 4096), ratios: Sequence[float] = (0.0, 0.1, 1.0, 10.0),
                    elements: int = 2048, fmt: str = "bf16", progress: "Progress | None" = None) -> Table:
    """Components whose mean across ranks is not 0 (``mu = ratio * sigma``): nearest-rounded ring
    sums stagnate once the partial sum exceeds ``2**p`` addends; SR and fp32 accumulation do not."""
    _check_sizes(world_sizes, elements)
    headers = ["R", "mu/sigma", "ring_bias%", "ring_err/noise", "ring_SR_bias%", "ring_SR_err/noise",
               "alltoall_bias%", "alltoall_err/noise"]
    rows = []
    sigma = 2**-6
    for R in world_sizes:
        for ratio in ratios:
            grads = GaussianGrads(sigma, mean=ratio * sigma, fmt=fmt)
            row: list[object] = [R, ratio]
            for cfg in (ReduceConfig("ring", fmt), ReduceConfig("ring", fmt, "stochastic"),
                        ReduceConfig("alltoall", fmt)):
                st = measure_error(R, elements, grads, cfg)
                row += [100 * st.bias / (ratio * sigma) if ratio else math.nan, st.error_to_noise]
            rows.append(row)
            _tick(progress)
    return headers, rows


def microbatch_table(counts: Sequence[int] = (8, 64, 256, 1024), ratios: Sequence[float] = (0.0, 1.0),
                     elements: int = 4096, fmt: str = "bf16", progress: "Progress | None" = None) -> Table:
    """Local accumulation of M micro-batch gradients ``g_m / M`` in a bf16 ``.grad``: the same
    stagnation as a long ring, against fp32 accumulation and the micro-batch noise ``sigma/sqrt(M)``."""
    _check_sizes(counts, elements)
    headers = ["M", "mu/sigma", "bf16_err/noise", "bf16_bias%", "bf16_SR_err/noise", "fp32_err/noise"]
    sigma, rows = 2**-6, []
    gen = torch.Generator().manual_seed(0)
    for M in counts:
        for ratio in ratios:
            g = GaussianGrads(sigma, mean=ratio * sigma, fmt=fmt).sample(M, elements, gen)
            exact = exact_reduce(g)
            noise = sigma / math.sqrt(M)
            err = {name: accumulate(g, acc_fmt, rounding, generator=torch.Generator().manual_seed(1)) - exact
                   for name, acc_fmt, rounding in (("n", fmt, "nearest"), ("sr", fmt, "stochastic"),
                                                   ("f", "fp32", "nearest"))}
            rms = {k: float(v.pow(2).mean().sqrt()) / noise for k, v in err.items()}
            bias = 100 * float(err["n"].mean()) / (ratio * sigma) if ratio else math.nan
            rows.append([M, ratio, rms["n"], bias, rms["sr"], rms["f"]])
            _tick(progress)
    return headers, rows


def fp16_table(world_sizes: Sequence[int] = (8, 64, 1024), sigmas: Sequence[float] = (1e-3, 1e-4, 1e-5, 1e-6),
               elements: int = 4096, progress: "Progress | None" = None) -> Table:
    """fp16 without loss scaling: pre-dividing small gradients by R pushes them below fp16's
    subnormals (6e-8). Dividing after an fp32 sum (all-to-all hook) avoids it."""
    _check_sizes(world_sizes, elements)
    headers = ["R", "sigma", "g/R<subnormal%", "g/R->0%", "ring_err/noise", "ring_zero%", "sum_then_divide_err/noise"]
    rows = []
    for R in world_sizes:
        for s in sigmas:
            grads = GaussianGrads(s, fmt="fp16")
            ring = measure_error(R, elements, grads, ReduceConfig("ring", "fp16"))
            fair = measure_error(R, elements, grads, ReduceConfig("alltoall", "fp16", average="post_divide"))
            rows.append([R, s, 100 * model.underflow_fraction(R, s, "fp16", threshold="subnormal"),
                         100 * model.underflow_fraction(R, s, "fp16"), ring.error_to_noise, 100 * ring.zero_fraction,
                         fair.error_to_noise])
            _tick(progress)
    return headers, rows


def fp8_table(world_sizes: Sequence[int] = (8, 64, 512), formats: Sequence[str] = ("fp8_e4m3fn", "fp8_e5m2"),
              sigma: float = 0.5, elements: int = 4096, progress: "Progress | None" = None) -> Table:
    """fp8 per-hop rounding (p = 4 or 3 bits): the ring's error passes the sampling noise quickly;
    sending fp8 but accumulating in fp32 keeps only the compression error."""
    _check_sizes(world_sizes, elements)
    headers = ["format", "R", "ring_err/noise", "tree_err/noise", "alltoall_fp32_err/noise", "ring_model/noise"]
    rows = []
    for fmt in formats:
        for R in world_sizes:
            grads = GaussianGrads(sigma, fmt=fmt)
            errs = [measure_error(R, elements, grads, ReduceConfig(alg, fmt, average="post_divide" if alg == "alltoall"
                                                                   else "pre_divide")).error_to_noise
                    for alg in ("ring", "tree", "alltoall")]
            rows.append([fmt, R, *errs, model.ring_error_std(R, sigma, fmt) / model.sampling_noise(R, sigma)])
            _tick(progress)
    return headers, rows


def premultiply_table(world_sizes: Sequence[int] = (3, 6, 12, 24, 96, 1000),
                      formats: Sequence[str] = ("bf16", "fp16", "fp8_e4m3fn", "fp8_e5m2"), elements: int = 8192,
                      progress: "Progress | None" = None) -> Table:
    """NCCL-style averaging (premultiply by fl(1/R)) when R is not a power of two: every gradient is
    scaled by ``R fl(1/R)``. Model value, and the measured slope of premultiply results relative to
    dividing after an fp32 sum (all-to-all, so no per-hop rounding; in fp8 the rounding of each
    product ``fl(x fl(1/R))`` adds its own bias on top)."""
    _check_sizes(world_sizes, elements)
    headers = ["R"] + [f"{f}_bias%" for f in formats] + [f"{f}_measured%" for f in formats]
    rows = []
    for R in world_sizes:
        grads = GaussianGrads(0.1, mean=1.0, fmt="fp32")
        x = grads.sample(R, elements, torch.Generator().manual_seed(R))
        exact = exact_reduce(x)
        measured = []
        for fmt in formats:
            slopes = [float((got * exact).sum() / (exact * exact).sum())
                      for got in (reduce(x, ReduceConfig("alltoall", fmt, average=avg))
                                  for avg in ("premultiply", "post_divide"))]
            measured.append(100 * (slopes[0] / slopes[1] - 1))
        rows.append([R] + [100 * model.premultiply_bias(R, f) for f in formats] + measured)
        _tick(progress)
    return headers, rows


def outlier_table(world_sizes: Sequence[int] = (16, 256, 1024), scales: Sequence[float] = (1.0, 100.0, 1e4),
                  elements: int = 4096, fmt: str = "bf16", progress: "Progress | None" = None) -> Table:
    """One rank (the first in every chunk's ring order is rank c+1; rank 0 here) with gradients
    ``scale`` times larger: every later hop rounds at the outlier's ulp. Error vs the other
    ranks' noise ``sigma/sqrt(R)``."""
    _check_sizes(world_sizes, elements)
    headers = ["R", "outlier_scale", "ring_err/noise", "tree_err/noise", "alltoall_err/noise"]
    rows = []
    for R in world_sizes:
        for scale in scales:
            grads = GaussianGrads(2**-6, fmt=fmt, outlier_ranks=(0,), outlier_scale=scale)
            rows.append([R, scale] + [measure_error(R, elements, grads, ReduceConfig(alg, fmt)).error_to_noise
                                      for alg in ("ring", "tree", "alltoall")])
            _tick(progress)
    return headers, rows


WIRE_WORLD_SIZES: tuple[int, ...] = (2, 8, 64, 256, 1024)
#: the rows of :func:`wire_table` per case and R: name -> (wire element or None, error feedback,
#: stochastic); ``None`` rows are the fp32 reduce and the bf16 ring of :func:`reduce`
WIRE_METHODS: dict[str, tuple[str | None, bool, bool]] = {
    "fp32": (None, False, False),
    "bf16_ring": (None, False, False),
    "fp8_e4m3": ("fp8_e4m3", False, False),
    "fp8_e5m2": ("fp8_e5m2", False, False),
    "int8": ("int8", False, False),
    "fp8_e4m3/SR": ("fp8_e4m3", False, True),
    "fp8_e4m3+EF": ("fp8_e4m3", True, False),
    "fp8_e5m2+EF": ("fp8_e5m2", True, False),
    "int8+EF": ("int8", True, False),
}
_WIRE_CASES = ("gaussian", "heavy")


def wire_grads(case: str, world_size: int, elements: int, sigma: float, generator: torch.Generator) -> torch.Tensor:
    """``[R, N]`` fp32 gradients of :func:`wire_table`'s ``case``: ``"gaussian"`` is
    ``N(0, sigma**2)``; ``"heavy"`` is biased and heavy-tailed, ``sigma * (1 + t_3 / sqrt(3))``
    (Student's t with 3 degrees of freedom scaled to unit variance: the same spread ``sigma``
    across ranks, a mean of ``sigma``, and rare values many sigma out that set their blocks' scales)."""
    if case not in _WIRE_CASES:
        raise ValueError(f"case: expected one of {_WIRE_CASES}, got {case!r}")
    z = torch.randn(world_size, elements, generator=generator)
    if case == "gaussian":
        return z * sigma
    chi2 = torch.randn(3, world_size, elements, generator=generator).pow(2).sum(0)
    return sigma * (1 + z / (chi2 / 3).sqrt() / math.sqrt(3))


def wire_table(world_sizes: Sequence[int] = WIRE_WORLD_SIZES, elements: int = 1024, steps: Sequence[int] = (4, 16),
               cases: Sequence[str] = _WIRE_CASES, block: int = 32, scale: str = "e8m0", sigma: float = 2**-6,
               seed: int = 0, progress: "Progress | None" = None) -> Table:
    """8-bit wire formats with fp32 accumulation, with and without error feedback, beside the fp32
    reduce and the bf16 ring (:data:`WIRE_METHODS`), for each case of :func:`wire_grads` and R.

    One fixed gradient ``x`` (``[R, elements]``) is reduced ``max(steps)`` times; every error is
    against the exact fp64 mean of ``x``, in units of the sampling noise ``sigma / sqrt(R)``:

    - ``err/noise``: rms error of one reduction (the first step: feedback has nothing to add yet);
    - ``bias/noise``: mean error of that reduction;
    - ``avgT/noise``: rms error of the average of the first ``T`` results. A deterministic
      reduction gives the same result every step, so its average stays at ``err/noise``;
      stochastic rounding's falls as ``1/sqrt(T)``; error feedback's as ``1/T`` (the T results
      add up to ``T x`` minus the last residual, which stays bounded).

    The 8-bit rows use :func:`lowp.distributed.simulator.wire_reduce` (:mod:`lowp.distributed.wire`'s
    encode/decode; blocks of ``block`` elements with ``scale`` scales, nearest rounding unless SR;
    fp32 sum in rank order, fp32 divide). Deterministic for a given ``seed``.
    """
    from lowp.distributed.wire import WireFormat

    _check_sizes(world_sizes, elements)
    if not steps or any(isinstance(t, bool) or not isinstance(t, int) or t < 1 for t in steps):
        raise ValueError(f"steps: expected positive ints, got {list(steps)!r}")
    for case in cases:
        if case not in _WIRE_CASES:
            raise ValueError(f"case: expected one of {_WIRE_CASES}, got {case!r}")
    WireFormat(block=block, scale=scale)          # ValueError naming block / scale
    horizon = max(steps)
    headers = ["case", "R", "method", "err/noise", "bias/noise"] + [f"avg{t}/noise" for t in steps]
    rows: list[list[Any]] = []
    for case in cases:
        for R in world_sizes:
            gen = torch.Generator().manual_seed(seed * 1_000_003 + R)
            x = wire_grads(case, R, elements, sigma, gen)
            exact = exact_reduce(x)
            noise = sigma / math.sqrt(R)

            def rms(v: torch.Tensor, exact: torch.Tensor = exact, noise: float = noise) -> float:
                return float((v - exact).pow(2).mean().sqrt()) / noise

            for name, (element, feedback, stochastic) in WIRE_METHODS.items():
                if element is None:
                    config = ReduceConfig("alltoall", "fp32", average="post_divide") if name == "fp32" \
                        else ReduceConfig("ring", "bf16")
                    first = reduce(x, config)
                    averages = [rms(first)] * len(steps)     # deterministic: the same result every step
                else:
                    fmt = WireFormat(element, block, scale, "stochastic" if stochastic else "nearest")
                    residual, total, first = None, torch.zeros_like(exact), exact
                    marks: dict[int, float] = {}
                    for t in range(1, (horizon if feedback or stochastic else 1) + 1):
                        got, new = wire_reduce(x, fmt, residual, random=seed * 7919 + t if stochastic else None)
                        residual = new if feedback else None
                        first = got if t == 1 else first
                        total += got
                        marks[t] = rms(total / t)
                    averages = [marks.get(t, marks[1]) for t in steps]   # nearest without feedback: every step alike
                rows.append([case, R, name, rms(first), float((first - exact).mean()) / noise, *averages])
            _tick(progress)
    return headers, rows
