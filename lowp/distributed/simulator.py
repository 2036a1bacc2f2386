"""Simulated collective reductions with every hop rounded to a low-precision format.

R simulated ranks hold one row each of an ``[R, N]`` tensor. A reduction combines the rows
the way a collective library does and rounds each intermediate result to the accumulator
format, so the result carries exactly the rounding errors of the real collective:

``ring``
    NCCL-style ring reduce-scatter followed by an (exact) all-gather. The N elements are cut
    into R contiguous chunks; chunk ``c`` starts at rank ``c + 1`` and travels once around the
    ring, ``acc <- fl(acc + x[rank])`` at each of the R - 1 hops, ending at its owner ``c``.
    Element ``j`` therefore sees the ranks in the order ``(c(j) + 1 + k) mod R``.
``tree``
    Pairwise (recursive halving) summation: log2(R) levels, each sum rounded. This is the
    error structure of NCCL's (double) binary trees and of recursive-halving reduce-scatter.
``alltoall``
    Reduce-scatter by all-to-all in the wire format, each owner adds the R shards in fp32,
    averages in fp32 and rounds once to the wire format for the all-gather. Same wire bytes
    as a ring, no per-hop rounding (what :func:`lowp.distributed.hooks.alltoall_fp32_hook` does).
``exact``
    fp64 sum with no rounding: the reference.

:func:`wire_reduce` simulates the 8-bit wire of :mod:`lowp.distributed.compressed_fsdp` (and the
reduce-scatter half of :mod:`lowp.distributed.compressed`): every rank encodes its row with
:func:`lowp.distributed.wire.encode` (after adding its error-feedback residual), the owner
decodes the R rows and adds them in fp32 in rank order, then divides by R in fp32; it returns the
new residuals too, so a loop over steps shows what error feedback does.

Averaging (``average``): ``"sum"``; ``"pre_divide"`` (each rank computes ``fl(x / R)`` in the
wire format, then the sum; what torch's DDP default hook and the post "Why reduction precision
matters" do); ``"post_divide"`` (sum, then ``fl(S / R)``; for ``alltoall`` the division is in fp32, which is bias-free);
``"premultiply"`` (NCCL's ``ncclAvg`` on floating types: each rank multiplies by the scalar
``fl(1/R)`` held in the reduction type, then the sum; see NCCL's ``FuncPreMulSum`` in
``src/device/reduce_kernel.h``). When R is not a power of two, ``fl(1/R) != 1/R`` and every
result is scaled by ``R * fl(1/R)``.

Rounding: with round-to-nearest, bf16/fp16/fp32 values live in their own torch dtype and the
hop is torch's own ``a + b`` (on CPU computed in fp32 and rounded once; fp32 natively). Inputs
given in float64 are rounded with the emulation, because torch's float64 -> bf16/fp16 cast goes
through fp32 and double-rounds (``1 + 2**-8 + 2**-40`` becomes 1.0 instead of ``1 + 2**-7``). Other
formats (fp8, custom) are held in fp32 (at most 11 significand bits) or fp64 and each result is
rounded with :func:`lowp.rounding.quantize`. Both equal the correctly rounded operation because
the wider precision has at least ``2p + 2`` bits (Figueroa, "When is double rounding
innocuous?", SIGNUM 1995). Stochastic rounding to bf16
works in fp32 (the sum of two bf16 values is exact there unless their exponents differ by more
than 16; then the rounding probability is off by less than 2**-16), to other formats in fp64.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lowp.formats import FloatFormat, get_format
from lowp.rounding import _native_cast_matches, canonical_mode, quantize

if TYPE_CHECKING:
    from lowp.distributed.wire import WireFormat

__all__ = ["ALGORITHMS", "AVERAGING", "Rounder", "ReduceConfig", "reduce", "accumulate", "exact_reduce",
           "GaussianGrads", "ErrorStats", "measure_error", "MAX_WORLD_SIZE", "MAX_SIMULATED_VALUES", "check_size",
           "check_number", "wire_reduce"]

ALGORITHMS: tuple[str, ...] = ("ring", "tree", "alltoall", "exact")
AVERAGING: tuple[str, ...] = ("sum", "pre_divide", "post_divide", "premultiply")
ROUNDINGS: tuple[str, ...] = ("nearest", "stochastic")
DEFAULT_CHUNK_BUDGET = 1 << 22   # elements (R x columns) processed at once
#: Largest simulated world size: beyond any data-parallel degree in use, and the ring's R hops
#: are a Python loop, so larger R only means a longer wait.
MAX_WORLD_SIZE = 1 << 16
#: Largest number of per-rank values (world size x elements) one measurement simulates: about
#: ten minutes on one CPU core; more is refused rather than left running for hours.
MAX_SIMULATED_VALUES = 1 << 30


def check_number(name: str, value: object, low: float = -math.inf, high: float = math.inf, *,
                 low_open: bool = False) -> float:
    """``value`` as a float if it is a finite real number in ``[low, high]`` (``(low, high]`` with
    ``low_open``); otherwise a ValueError (TypeError for non-numbers) naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name}: expected a finite number, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v) or v < low or v > high or (low_open and v == low):
        raise ValueError(f"{name}: expected a finite number in {'(' if low_open else '['}{low:g}, {high:g}], "
                         f"got {value!r}")
    return v


def check_size(world_size: object, elements: object) -> None:
    """ValueError naming ``world_size`` or ``elements`` unless both are positive ints,
    ``world_size <= MAX_WORLD_SIZE`` and their product ``<= MAX_SIMULATED_VALUES``."""
    for name, value in (("world_size", world_size), ("elements", elements)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
    if world_size > MAX_WORLD_SIZE:  # type: ignore[operator]
        raise ValueError(f"world_size: expected at most {MAX_WORLD_SIZE} (lowp.distributed.simulator.MAX_WORLD_SIZE), "
                         f"got {world_size}")
    if world_size * elements > MAX_SIMULATED_VALUES:  # type: ignore[operator]
        raise ValueError(f"elements: world_size x elements = {world_size * elements:,} exceeds "  # type: ignore[operator]
                         f"MAX_SIMULATED_VALUES = {MAX_SIMULATED_VALUES:,}; use fewer elements")
# dtypes whose CPU add/div/mul are computed in fp32 (or natively) and rounded once: exact emulation
NATIVE_ARITHMETIC = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


class Rounder:
    """``fl(x)``: round a container tensor to ``fmt`` by nearest-even or stochastic rounding.

    ``container`` is the dtype every simulated value lives in (see the module docstring).
    bf16 stochastic rounding uses the bit trick (add 16 random bits below the bf16 mantissa of the
    fp32 value, then truncate), which is exact stochastic rounding of the fp32 value; other formats
    go through :func:`lowp.rounding.quantize`.

    Args:
        fmt: the format rounded to (name, dtype or :class:`~lowp.formats.FloatFormat`); an unknown
            name raises ``ValueError``.
        rounding: ``"nearest"`` (nearest even; default) or ``"stochastic"``; anything else raises
            ``ValueError``.
        generator: random source of stochastic rounding, so runs are reproducible (default
            ``None``: torch's global generator). Unused with ``"nearest"``.
    """

    def __init__(self, fmt: "str | torch.dtype | FloatFormat", rounding: str = "nearest",
                 generator: torch.Generator | None = None) -> None:
        if rounding not in ROUNDINGS:
            raise ValueError(f"rounding: expected one of {ROUNDINGS}, got {rounding!r}")
        self.fmt = get_format(fmt)
        self.rounding = rounding
        self.generator = generator
        stochastic = rounding == "stochastic"
        self._bf16_sr = stochastic and self.fmt == get_format("bf16")
        self._native = not stochastic and self.fmt.torch_dtype is not None and _native_cast_matches(self.fmt)
        if self._native and self.fmt.torch_dtype in NATIVE_ARITHMETIC:
            self.container = self.fmt.torch_dtype
        else:
            wide = (stochastic and not self._bf16_sr) or self.fmt.precision > 11
            self.container = torch.float64 if wide else torch.float32
        self._mode = canonical_mode(rounding if stochastic else "nearest_even")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``fl(x)`` in the container dtype; ``x`` is a container or float64 tensor."""
        if self._native and (x.dtype != torch.float64 or self.fmt.precision > 24):
            return x.to(self.fmt.torch_dtype).to(self.container)
        if self._native:   # torch casts float64 -> bf16/fp16 through fp32: a double rounding
            return quantize(x, self.fmt, native=False).to(self.container)
        if self._bf16_sr:   # float64 inputs are first rounded to fp32 (off by < 2**-16 ulp in probability)
            x = x.to(torch.float32)
            noise = torch.randint(0, 1 << 16, x.shape, generator=self.generator, dtype=torch.int32)
            bits = (x.contiguous().view(torch.int32) + noise) & ~0xFFFF
            return torch.where(torch.isfinite(x), bits.view(torch.float32), x)
        return quantize(x, self.fmt, self._mode, generator=self.generator, native=False).to(self.container)

    def scalar(self, value: float) -> float:
        """``fl(value)`` of a Python float (nearest-even, whatever the rounding mode)."""
        return float(quantize(torch.tensor([value], dtype=torch.float64), self.fmt)[0])


@dataclass(frozen=True)
class ReduceConfig:
    """How a simulated collective reduces: algorithm, wire/accumulator format, rounding, averaging.

    Every field is checked at construction (``ValueError`` naming it).

    Args:
        algorithm: ``"ring"`` (default), ``"tree"``, ``"alltoall"`` or ``"exact"`` (see the
            module docstring).
        fmt: wire and accumulator format (name or :class:`~lowp.formats.FloatFormat`; default
            ``"bf16"``).
        rounding: ``"nearest"`` (default) or ``"stochastic"``, for every rounding of the reduction.
        average: ``"sum"``, ``"pre_divide"`` (default), ``"post_divide"`` or ``"premultiply"``.
        seed: seed of the stochastic-rounding generator when :func:`reduce` is given none
            (default 0).
    """

    algorithm: str = "ring"
    fmt: "str | FloatFormat" = "bf16"
    rounding: str = "nearest"
    average: str = "pre_divide"
    seed: int = 0

    def __post_init__(self) -> None:
        if self.algorithm not in ALGORITHMS:
            raise ValueError(f"algorithm: expected one of {ALGORITHMS}, got {self.algorithm!r}")
        if self.average not in AVERAGING:
            raise ValueError(f"average: expected one of {AVERAGING}, got {self.average!r}")
        if self.rounding not in ROUNDINGS:
            raise ValueError(f"rounding: expected one of {ROUNDINGS}, got {self.rounding!r}")
        get_format(self.fmt)

    @property
    def format(self) -> FloatFormat:
        """``fmt`` as a :class:`~lowp.formats.FloatFormat`."""
        return get_format(self.fmt)


def _ring_sum(x: torch.Tensor, prepare: Callable[[torch.Tensor], torch.Tensor], rnd: Rounder, offset: int,
              total: int) -> torch.Tensor:
    """NCCL ring order: element ``j`` of chunk ``c = (offset + j) * R // total`` adds the ranks
    ``c + 1, c + 2, ..., c`` (mod R). Rows are fetched and prepared hop by hop from the rows
    stacked twice (so the rank index needs no modulo), never as a permuted copy."""
    R, n = x.shape
    twice = torch.cat([x, x])
    j = torch.arange(offset, offset + n, dtype=torch.int64)
    flat = ((j * R) // total + 1) * n + torch.arange(n, dtype=torch.int64)
    acc = prepare(twice.take(flat))
    for _ in range(1, R):
        flat += n
        acc = rnd(acc + prepare(twice.take(flat)))
    return acc


def _sequential_sum(rows: torch.Tensor, rnd: Rounder) -> torch.Tensor:
    """``fl(...fl(fl(r0 + r1) + r2)... + r_{n-1})`` down dimension 0."""
    acc = rows[0].clone()
    for k in range(1, rows.shape[0]):
        acc = rnd(acc + rows[k])
    return acc


def _pairwise_sum(rows: torch.Tensor, rnd: Rounder) -> torch.Tensor:
    """Recursive halving: pairs (0,1), (2,3), ... are added and rounded, level by level."""
    while rows.shape[0] > 1:
        half = rows.shape[0] // 2
        paired = rnd(rows[0:2 * half:2] + rows[1:2 * half:2])
        rows = torch.cat([paired, rows[2 * half:]]) if rows.shape[0] % 2 else paired
    return rows[0]


def _check_grads(x: torch.Tensor, name: str = "x") -> None:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point torch.Tensor")
    if x.dim() != 2 or x.shape[0] < 1:
        raise ValueError(f"{name}: expected shape [ranks, elements] with at least one rank, got {tuple(x.shape)}")


def reduce(x: torch.Tensor, config: ReduceConfig = ReduceConfig(), *, offset: int = 0, total: int | None = None,
           generator: torch.Generator | None = None) -> torch.Tensor:
    """Simulate one all-reduce of the rows of ``x`` (``[R, N]``, each row one rank's data).

    Each rank first rounds its row to the wire format (a no-op when it already is in it).
    ``offset``/``total`` place these columns inside a larger tensor so NCCL's chunk order is
    kept when a big tensor is processed in pieces. Returns the reduced values as float64.
    """
    _check_grads(x)
    R, n = x.shape
    total = n if total is None else total
    if isinstance(offset, bool) or not isinstance(offset, int) or offset < 0:
        raise ValueError(f"offset: expected an int >= 0, got {offset!r}")
    if isinstance(total, bool) or not isinstance(total, int) or total < offset + n:
        raise ValueError(f"total: expected an int >= offset + x.shape[1] = {offset + n}, got {total!r}")
    if config.algorithm == "exact":
        return exact_reduce(x, config.average)
    if generator is None and config.rounding == "stochastic":
        generator = torch.Generator().manual_seed(config.seed)
    rnd = Rounder(config.fmt, config.rounding, generator)
    if x.dtype != rnd.container:
        x = rnd(x)      # the compression to the wire format, once and correctly rounded
    scale = rnd.scalar(1.0 / R) if config.average == "premultiply" else None

    def prepare(rows: torch.Tensor) -> torch.Tensor:
        """A rank's contribution: its values in the wire format, pre-divided or premultiplied."""
        y = rnd(rows)
        if config.average == "pre_divide":
            return rnd(y / R)
        return rnd(y * scale) if scale is not None else y

    if config.algorithm == "alltoall":
        s = prepare(x).to(torch.float32).sum(dim=0)
        if config.average == "post_divide":
            s = s / R
        return rnd(s).to(torch.float64)
    if config.algorithm == "ring":
        s = _ring_sum(x, prepare, rnd, offset, total)
    else:
        s = _pairwise_sum(prepare(x), rnd)
    if config.average == "post_divide":
        s = rnd(s / R)
    return s.to(torch.float64)


def exact_reduce(x: torch.Tensor, average: str = "pre_divide") -> torch.Tensor:
    """The reference: fp64 sum of the rows, divided by R unless ``average == "sum"``.

    Exact for inputs of at most 24 significand bits whose exponents span less than 29 binades
    (then every partial sum fits in 53 bits); otherwise within ``R * 2**-53`` relative.
    """
    _check_grads(x)
    if average not in AVERAGING:
        raise ValueError(f"average: expected one of {AVERAGING}, got {average!r}")
    s = x.to(torch.float64).sum(dim=0)
    return s if average == "sum" else s / x.shape[0]


def accumulate(micro: torch.Tensor, fmt: "str | FloatFormat" = "bf16", rounding: str = "nearest",
               average: bool = True, generator: torch.Generator | None = None) -> torch.Tensor:
    """Local gradient accumulation over M micro-batches (rows of ``micro``) in ``fmt``.

    ``grad <- fl(grad + fl(g_m / M))`` (or ``fl(g_m)`` with ``average=False``) in order
    m = 0..M-1, as a ``.grad`` tensor held in ``fmt`` accumulates across backward passes.
    """
    _check_grads(micro, "micro")
    rnd = Rounder(fmt, rounding, generator)
    y = rnd(micro)
    if average:
        y = rnd(y / micro.shape[0])
    return _sequential_sum(y, rnd).to(torch.float64)


@dataclass(frozen=True)
class GaussianGrads:
    """Synthetic per-rank gradients: ``x[r, j] = scale_r * (mean + sigma * z)``, rounded to ``fmt``.

    The post "Why reduction precision matters" draws ``torch.normal(0, sigma)`` directly in bf16:
    ``fmt="bf16"``.

    Args:
        sigma: standard deviation of each value, a finite number >= 0 (``ValueError``
            otherwise; ``TypeError`` for non-numbers); 0 gives constant gradients.
        mean: mean of each value, any finite number (default 0.0).
        fmt: format the samples are rounded to (default ``"bf16"``; checked when sampling).
        outlier_ranks: ranks (taken modulo the world size) whose values are scaled by
            ``outlier_scale``, e.g. a rank hit by a loss spike (default: none).
        outlier_scale: scale of the outlier ranks, any finite number (default 1.0: no outlier).
    """

    sigma: float
    mean: float = 0.0
    fmt: "str | FloatFormat" = "bf16"
    outlier_ranks: Sequence[int] = field(default_factory=tuple)
    outlier_scale: float = 1.0

    def __post_init__(self) -> None:
        check_number("sigma", self.sigma, 0.0)
        check_number("mean", self.mean)
        check_number("outlier_scale", self.outlier_scale)

    def sample(self, world_size: int, count: int, generator: torch.Generator) -> torch.Tensor:
        """``[world_size, count]`` values of ``fmt`` (float32 container; float64 for wider formats)."""
        fmt = get_format(self.fmt)
        dtype = torch.float64 if fmt.precision > 24 else torch.float32
        x = torch.randn(world_size, count, generator=generator, dtype=dtype).mul_(self.sigma).add_(self.mean)
        for r in self.outlier_ranks:
            x[r % world_size] *= self.outlier_scale
        return quantize(x, fmt)


@dataclass(frozen=True)
class ErrorStats:
    """Error of a simulated reduction against the exact fp64 result, over N elements.

    Built by :func:`measure_error`; errors are in the units of the gradients.

    Args:
        world_size: R, the simulated ranks.
        elements: N, the reduced elements.
        std: standard deviation of ``result - exact``.
        bias: mean of ``result - exact`` (negative: the reduction shrinks the mean).
        rms: root mean square of ``result - exact``.
        seed_std: the metric of the post "Why reduction precision matters": the std of
            ``result - fl(exact)`` (the reference rounded once to the wire format).
        exact_mean: mean of the exact results.
        noise: sampling noise of the averaged gradient, ``sigma / sqrt(R)`` (for sums,
            ``sigma * sqrt(R)``).
        zero_fraction: fraction of results that came out exactly 0 while the exact value was
            not (underflow).
    """

    world_size: int
    elements: int
    std: float
    bias: float
    rms: float
    seed_std: float
    exact_mean: float
    noise: float
    zero_fraction: float

    @property
    def error_to_noise(self) -> float:
        """``rms / noise`` (``inf`` when there is no sampling noise)."""
        return self.rms / self.noise if self.noise > 0 else math.inf

    @property
    def relative_bias(self) -> float:
        """Bias as a fraction of the exact mean (nan when the mean is 0)."""
        return self.bias / self.exact_mean if self.exact_mean != 0 else math.nan


def measure_error(world_size: int, elements: int, grads: GaussianGrads, config: ReduceConfig = ReduceConfig(), *,
                  seed: int = 0, chunk_budget: int = DEFAULT_CHUNK_BUDGET,
                  sampler: Callable[[int, int, torch.Generator], torch.Tensor] | None = None) -> ErrorStats:
    """Simulate ``config`` on ``world_size`` ranks x ``elements`` fresh gradients, in column chunks
    of at most ``chunk_budget`` values so R = 4096 x millions of elements fits in memory."""
    check_size(world_size, elements)
    if isinstance(chunk_budget, bool) or not isinstance(chunk_budget, int) or chunk_budget < 1:
        raise ValueError(f"chunk_budget: expected a positive int, got {chunk_budget!r}")
    data_gen = torch.Generator().manual_seed(seed)
    round_gen = torch.Generator().manual_seed(seed + 1)
    sample = sampler or grads.sample
    ref_fmt = get_format(config.fmt)
    width = max(1, chunk_budget // world_size)
    sums = torch.zeros(6, dtype=torch.float64)   # err, err^2, seed_err, seed_err^2, exact, zeros
    for offset in range(0, elements, width):
        count = min(width, elements - offset)
        x = sample(world_size, count, data_gen)
        got = reduce(x, config, offset=offset, total=elements, generator=round_gen)
        exact = exact_reduce(x, config.average)
        err = got - exact
        seed_err = got - quantize(exact, ref_fmt, native=False)
        zeros = ((got == 0) & (exact != 0)).to(torch.float64)
        sums += torch.stack([err.sum(), (err * err).sum(), seed_err.sum(), (seed_err * seed_err).sum(),
                             exact.sum(), zeros.sum()])
    n = float(elements)
    e1, e2, s1, s2, ex, zero_count = (float(v) for v in sums)
    noise = grads.sigma / math.sqrt(world_size) if config.average != "sum" else grads.sigma * math.sqrt(world_size)
    return ErrorStats(world_size=world_size, elements=elements, std=math.sqrt(max(e2 / n - (e1 / n) ** 2, 0.0)),
                      bias=e1 / n, rms=math.sqrt(e2 / n), seed_std=math.sqrt(max(s2 / n - (s1 / n) ** 2, 0.0)),
                      exact_mean=ex / n, noise=noise, zero_fraction=zero_count / n)


def wire_reduce(x: torch.Tensor, fmt: "WireFormat", residual: torch.Tensor | None = None, *,
                random: int | None = None, average: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """One reduction of the rows of ``x`` (``[R, N]``, fp32) through the wire format ``fmt``.

    Rank ``r`` sends ``encode(v_r)`` with ``v_r = x_r + residual_r`` (``residual``: ``[R, N]``
    fp32, or ``None`` for zeros); the result is ``fl32(sum_r decode(...)_r)`` added in rank order,
    divided by R in fp32 when ``average``, as float64. Returns ``(result, v - decoded)``: the
    second is every rank's new residual under error feedback. Each row is encoded on its own
    (blocks start at its first element; when ``N`` is a multiple of the block, all rows go
    through one :func:`~lowp.distributed.wire.encode` call, which is the same thing). ``random``:
    the int key of stochastic rounding (row ``r``, element ``j`` draws the counter-based bits of
    index ``r * N + j``); required when ``fmt.rounding == "stochastic"``.
    """
    from lowp.distributed.wire import WireFormat, decode, encode

    _check_grads(x)
    if not isinstance(fmt, WireFormat):
        raise TypeError(f"fmt: expected a lowp.distributed.wire.WireFormat, got {type(fmt).__name__}")
    R, n = x.shape
    v = x.to(torch.float32)
    if residual is not None:
        if not isinstance(residual, torch.Tensor) or tuple(residual.shape) != (R, n):
            got = tuple(residual.shape) if isinstance(residual, torch.Tensor) else type(residual).__name__
            raise ValueError(f"residual: expected a tensor of shape {(R, n)}, got {got}")
        v = v + residual.to(torch.float32)
    if not fmt.blocked or n % fmt.block == 0:
        flat = v.reshape(-1)
        sent = decode(encode(flat, fmt, random), fmt, flat.numel()).view(R, n)
    else:
        sent = torch.stack([decode(encode(v[r], fmt, random, first=r * n), fmt, n) for r in range(R)])
    total = sent[0].clone()
    for r in range(1, R):
        total = total + sent[r]
    if average:
        total = total / R
    return total.to(torch.float64), v - sent
