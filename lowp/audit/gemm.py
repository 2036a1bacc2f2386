"""GEMM accumulation emulation: exact products, a running sum of chosen precision.

A matrix product ``C = A B`` on a tensor core multiplies low-precision operands exactly and adds
the products into an accumulator whose precision the hardware fixes. :func:`emulated_matmul` models
that accumulator, vectorized over the outputs (the loop runs over ``K`` in groups).

The model (:class:`Accumulator`, ``m = mantissa_bits``):

* Products ``a_ik b_kj`` are exact: they are formed in fp64 from operands that already hold
  low-precision values (fp8 x fp8 products have at most 8 significand bits, bf16 x bf16 at most 16,
  fp32 x fp32 at most 48, all exact in fp64's 53). Operands with more than 26 significand bits are
  refused.
* ``K`` is consumed in groups of ``group`` products. For one group, the addends are the current
  accumulator value ``s`` and the ``group`` products.
* ``align="largest"`` (the tensor-core behaviour measured by Fasi et al. 2021): let ``E`` be the
  largest exponent ``floor(log2 |v|)`` among the nonzero addends; each addend is rounded (by
  ``rounding``) to a multiple of ``2**(E - m)``, i.e. aligned to the largest addend and cut to the
  accumulator's ``m`` fraction bits; with ``"toward_zero"`` the bits shifted out are dropped and an
  addend below ``2**(E - m)`` is flushed to zero. The aligned addends are then summed exactly.
  ``align="exact"`` (``group=1`` only): the accumulator and one product are summed exactly.
* The group's sum is normalized to ``m`` fraction bits (``m + 1`` significand bits) with
  ``rounding``: ``"toward_zero"`` (truncation, as Fasi et al. found for the tensor cores'
  normalization) or ``"nearest_even"``. The exponent range is unbounded (fp64's).
* ``promote_every=N``: every ``N`` products (a multiple of ``group``), the limited-precision partial
  sum is added into an fp32 accumulator, rounded to nearest-even, and the partial sum restarts at 0
  (DeepSeek-V3's fix: partial results copied to fp32 registers on CUDA cores every ``N_C = 128``
  elements). Without promotion the result is the limited accumulator itself.

``Accumulator(mantissa_bits=23, rounding="nearest_even", align="exact", group=1)`` is a sequential
chain of fp32 fused multiply-adds (:data:`ACCUMULATORS` ``"fp32"``, fp32's exponent range aside);
``group=1`` with ``align="largest"`` and ``rounding="toward_zero"`` is a chain of truncated additions.

Sources:
* DeepSeek-AI, "DeepSeek-V3 Technical Report", arXiv:2412.19437, section 3.3.2 "Increasing
  Accumulation Precision": the accumulation of FP8 GEMMs on H800 tensor cores keeps about 14
  bits, and for two random matrices at ``K = 4096`` the maximum relative error was close to 2%;
  the fix copies partial results to fp32 every ``N_C = 128`` elements.
* M. Fasi, N. J. Higham, M. Mikaitis, S. Pranesh, "Numerical behavior of NVIDIA tensor cores",
  PeerJ Computer Science 7:e330 (2021): products exact, the addends of one tensor-core step aligned
  to the largest exponent with the bits shifted out truncated, and the result normalized with
  round-toward-zero.

The grouping and the exact number of bits of the H800 are not published; the preset
``"h800_fp8"`` (``mantissa_bits=14``, ``group=32`` (one FP8 WGMMA's K), ``align="largest"``,
``"toward_zero"``) is a model, not a measurement of the hardware; its error is of DeepSeek-V3's
reported magnitude (docs/audit.md, "GEMM accumulation").
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from lowp.formats import FloatFormat, get_format
from lowp.rounding import check_float_tensor, quantize

__all__ = ["Accumulator", "ACCUMULATORS", "get_accumulator", "emulated_matmul", "round_mantissa",
           "gemm_inputs", "gemm_errors", "gemm_error_table", "GEMM_CONFIGS", "DEFAULT_GEMM_KS"]

_ROUNDINGS = ("nearest_even", "toward_zero")
_ALIGNS = ("largest", "exact")
DEFAULT_GEMM_KS = (512, 1024, 2048, 4096, 8192)


@dataclass(frozen=True)
class Accumulator:
    """The precision and behaviour of a GEMM accumulator (the model is in the module docstring).

    Args:
        mantissa_bits: fraction bits kept by the accumulator (fp32: 23); ``m + 1`` significand bits.
        rounding: ``"toward_zero"`` or ``"nearest_even"``, for the alignment and for normalizing
            each group's sum.
        align: ``"largest"`` (addends aligned to the group's largest exponent, lower bits rounded
            away) or ``"exact"`` (``group=1`` only).
        group: products added per step (1 = one product at a time).
        name: a label for tables.
    """

    mantissa_bits: int = 23
    rounding: str = "nearest_even"
    align: str = "exact"
    group: int = 1
    name: str = ""

    def __post_init__(self) -> None:
        m = self.mantissa_bits
        if isinstance(m, bool) or not isinstance(m, int) or not 1 <= m <= 40:
            raise ValueError(f"mantissa_bits: expected an int in [1, 40], got {m!r}")
        if self.rounding not in _ROUNDINGS:
            raise ValueError(f"rounding: expected one of {', '.join(_ROUNDINGS)}, got {self.rounding!r}")
        if self.align not in _ALIGNS:
            raise ValueError(f"align: expected one of {', '.join(_ALIGNS)}, got {self.align!r}")
        g = self.group
        if isinstance(g, bool) or not isinstance(g, int) or g < 1:
            raise ValueError(f"group: expected a positive int, got {g!r}")
        if self.align == "largest" and m + 2 + math.ceil(math.log2(g + 1)) > 53:
            raise ValueError(f"group: {g} aligned addends of {m + 1} bits do not sum exactly in fp64")
        if self.align == "exact" and g != 1:
            raise ValueError(f"group: align=\"exact\" models one product per step; expected group=1, got {g}")

    def label(self) -> str:
        """``name`` or a description such as ``"m14 toward_zero largest g32"``."""
        return self.name or f"m{self.mantissa_bits} {self.rounding} {self.align} g{self.group}"


ACCUMULATORS: dict[str, Accumulator] = {
    "fp32": Accumulator(23, "nearest_even", "exact", 1, name="fp32"),
    "h800_fp8": Accumulator(14, "toward_zero", "largest", 32, name="h800_fp8"),
}


def get_accumulator(spec: "str | Accumulator") -> Accumulator:
    """An :class:`Accumulator` by preset name (``"fp32"``, ``"h800_fp8"``) or passed through."""
    if isinstance(spec, Accumulator):
        return spec
    if isinstance(spec, str) and spec in ACCUMULATORS:
        return ACCUMULATORS[spec]
    raise ValueError(f"accumulator: expected an Accumulator or one of {', '.join(ACCUMULATORS)}, got {spec!r}")


def _exponent(x: torch.Tensor) -> torch.Tensor:
    """``floor(log2 |x|)`` for nonzero finite fp64 ``x`` (exact, from frexp); arbitrary for 0."""
    return torch.frexp(x)[1] - 1


def _round_to_quantum(x: torch.Tensor, qexp: torch.Tensor, rounding: str) -> torch.Tensor:
    """``x`` rounded to a multiple of ``2**qexp`` (exact scaling by powers of two in fp64)."""
    scaled = torch.ldexp(x, -qexp)
    r = torch.trunc(scaled) if rounding == "toward_zero" else torch.round(scaled)  # round: half to even
    return torch.ldexp(r, qexp)


def round_mantissa(x: torch.Tensor, mantissa_bits: int, rounding: str = "nearest_even") -> torch.Tensor:
    """fp64 ``x`` rounded to ``mantissa_bits`` fraction bits (unbounded exponent), ``rounding`` one
    of ``"nearest_even"``, ``"toward_zero"``; zeros stay zero."""
    return _round_to_quantum(x, _exponent(x) - mantissa_bits, rounding)


def _significand_bits(t: torch.Tensor) -> int:
    """The most significand bits of any value of fp64 ``t`` (0 for an all-zero tensor)."""
    nonzero = t[t != 0]
    if nonzero.numel() == 0:
        return 0
    frac = torch.frexp(nonzero)[0].abs()      # in [0.5, 1)
    bits = 0
    while bits < 53 and bool((frac != torch.floor(frac)).any()):
        frac = frac * 2
        bits += 1
    return bits


def _two_sum(x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Knuth's TwoSum: ``x + y = hi + lo`` exactly, ``hi = fl(x + y)`` (fp64, no overflow)."""
    hi = x + y
    bv = hi - x
    av = hi - bv
    return hi, (x - av) + (y - bv)


def _round_sum(x: torch.Tensor, y: torch.Tensor, m: int, rounding: str) -> torch.Tensor:
    """The exact ``x + y`` rounded once to ``m <= 50`` fraction bits.

    ``hi + lo`` (TwoSum) is first rounded to odd at fp64's 53 bits (``hi`` if exact, else whichever
    of ``hi`` and its neighbour toward ``lo`` has an odd last bit); a round-to-odd result never
    lands on an ``m``-bit grid point or midpoint unless the exact value does, so rounding it to
    ``m`` bits gives the rounding of the exact sum (Boldo and Melquiond, "Emulation of FMA and
    correctly rounded sums: proved algorithms using rounding to odd", IEEE TC 57(4), 2008)."""
    hi, lo = _two_sum(x, y)
    mant = torch.frexp(hi)[0].abs()                       # in [0.5, 1); times 2**53: the significand
    odd = (torch.ldexp(mant, torch.tensor(53)).to(torch.int64) & 1).bool()
    toward = torch.nextafter(hi, torch.where(lo > 0, math.inf, -math.inf).to(hi.dtype))
    ro = torch.where((lo == 0) | odd, hi, toward)
    return round_mantissa(ro, m, rounding)


def emulated_matmul(a: torch.Tensor, b: torch.Tensor, accumulator: "str | Accumulator" = "fp32",
                    promote_every: int | None = None) -> torch.Tensor:
    """``a @ b`` (``(M, K) x (K, N)``) with exact products and the accumulator model of the module
    docstring; returns an fp64 tensor (holding fp32 values when ``promote_every`` is set).

    Args:
        a: ``(M, K)`` float tensor, finite, whose values have at most 26 significand bits (fp32, bf16,
            fp16 or fp8 values, in any float dtype), so that every product is exact in fp64.
        b: ``(K, N)``, the same kind.
        accumulator: an :class:`Accumulator` or a preset name of :data:`ACCUMULATORS`.
        promote_every: ``None`` or a positive multiple of ``accumulator.group``: every that many
            products the partial sum is added into an fp32 accumulator (nearest-even) and restarts
            at 0.
    """
    acc = get_accumulator(accumulator)
    check_float_tensor(a, "a")
    check_float_tensor(b, "b")
    if a.dim() != 2 or b.dim() != 2 or a.shape[1] != b.shape[0]:
        raise ValueError(f"b: expected matrices (M, K) and (K, N), got shapes {tuple(a.shape)} and {tuple(b.shape)}")
    a64, b64 = a.double(), b.double()
    for name, t in (("a", a64), ("b", b64)):
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"{name}: holds NaN or inf")
        if _significand_bits(t) > 26:
            raise ValueError(f"{name}: values with more than 26 significand bits; products would not be exact "
                             f"in fp64 (round the operands to fp32 or narrower first)")
    if promote_every is not None and (isinstance(promote_every, bool) or not isinstance(promote_every, int)
                                      or promote_every < 1 or promote_every % acc.group):
        raise ValueError(f"promote_every: expected None or a positive multiple of the accumulator's group "
                         f"({acc.group}), got {promote_every!r}")
    rows, k_total = a64.shape
    m = acc.mantissa_bits
    s = torch.zeros(rows, b64.shape[1], dtype=torch.float64)
    total = torch.zeros_like(s) if promote_every is not None else None
    since = 0
    for k0 in range(0, k_total, acc.group):
        k1 = min(k0 + acc.group, k_total)
        if acc.align == "exact":   # group == 1: one exact product, one rounding of the exact sum
            s = _round_sum(s, a64[:, k0, None] * b64[None, k0, :], m, acc.rounding)
        else:
            addends = torch.cat([s[:, None, :], a64[:, k0:k1, None] * b64[None, k0:k1, :]], 1)  # exact
            top = torch.where(addends != 0, _exponent(addends), _NO_EXPONENT).amax(1, keepdim=True)
            qexp = torch.where(top == _NO_EXPONENT, 0, top - m).expand_as(addends)
            aligned = _round_to_quantum(addends, qexp, acc.rounding)
            s = round_mantissa(aligned.sum(1), m, acc.rounding)   # the sum of aligned addends is exact
        since += k1 - k0
        if total is not None and (since == promote_every or k1 == k_total):
            total = _round_sum(total, s, 23, "nearest_even")
            s = torch.zeros_like(s)
            since = 0
    return total if total is not None else s


_NO_EXPONENT = -(2 ** 20)


def gemm_inputs(k: int, rows: int = 16, cols: int = 16, fmt: "str | FloatFormat" = "fp8_e4m3fn", seed: int = 0,
                dist: str = "normal") -> tuple[torch.Tensor, torch.Tensor]:
    """Random ``(rows, k)`` and ``(k, cols)`` matrices of ``fmt`` values (float32 tensors):
    N(0, 1) (``dist="normal"``) or U(0, 1) (``"uniform"``) rounded to nearest in ``fmt``."""
    if dist not in ("normal", "uniform"):
        raise ValueError(f"dist: expected 'normal' or 'uniform', got {dist!r}")
    g = torch.Generator().manual_seed(seed)
    draw = torch.randn if dist == "normal" else torch.rand
    a, b = draw(rows, k, generator=g), draw(k, cols, generator=g)
    f = get_format(fmt)
    return quantize(a, f, "nearest_even", native=False), quantize(b, f, "nearest_even", native=False)


#: the configurations of :func:`gemm_error_table`: column label -> (accumulator, promote_every)
GEMM_CONFIGS: dict[str, tuple[str, int | None]] = {
    "14-bit": ("h800_fp8", None),
    "14-bit, fp32 every 128": ("h800_fp8", 128),
    "fp32": ("fp32", None),
}


def gemm_errors(k: int, dist: str, accumulator: "str | Accumulator", promote_every: int | None = None,
                rows: int = 16, cols: int = 16, seed: int = 0) -> dict[str, float]:
    """Errors of :func:`emulated_matmul` on :func:`gemm_inputs` (e4m3 values) against the exact product.

    Returns ``max_rel`` (the largest ``|C - C_exact| / |C_exact|`` over the outputs; 0/0 counts as 0,
    x/0 as inf), ``median_rel`` and ``normwise`` (``||C - C_exact||_F / ||C_exact||_F``). The exact
    product is summed in fp64 from exact products, within ``K 2**-53`` of the true sum relative to
    ``sum |a_k b_k|``, far below every error reported here."""
    a, b = gemm_inputs(k, rows, cols, seed=seed, dist=dist)
    exact = a.double() @ b.double()
    err = (emulated_matmul(a, b, accumulator, promote_every) - exact).abs()
    rel = torch.where(err == 0, 0.0, err / exact.abs())
    return {"max_rel": float(rel.max()), "median_rel": float(rel.median()),
            "normwise": float(err.norm() / exact.norm()) if float(exact.norm()) else 0.0}


def gemm_error_table(ks=DEFAULT_GEMM_KS, rows: int = 16, cols: int = 16,
                     seed: int = 0) -> tuple[list[str], list[list[object]]]:
    """Headers and rows of the GEMM accumulation table: for each ``K``, the worst relative error over
    ``rows x cols`` outputs for U(0, 1) e4m3 inputs and the normwise relative error for N(0, 1) e4m3
    inputs, for each configuration of :data:`GEMM_CONFIGS`."""
    heads = ["K"] + [f"U(0,1) max rel, {c}" for c in GEMM_CONFIGS] + [f"N(0,1) normwise, {c}" for c in GEMM_CONFIGS]
    body: list[list[object]] = []
    for k in ks:
        row: list[object] = [k]
        for dist, key in (("uniform", "max_rel"), ("normal", "normwise")):
            for acc, promote in GEMM_CONFIGS.values():
                row.append(f"{gemm_errors(k, dist, acc, promote, rows, cols, seed)[key]:.2e}")
        body.append(row)
    return heads, body
