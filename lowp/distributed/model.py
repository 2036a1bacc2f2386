"""Error model of low-precision reductions: why a bf16 ring's error does not grow with R.

Every rounding ``fl(T) = T + delta`` of round-to-nearest has, for a ``T`` whose low bits are
spread out, an error ``delta`` uniform on ``[-ulp(T)/2, ulp(T)/2]``: ``Var(delta) = ulp(T)**2/12``.
Errors of different hops are nearly independent, and each is passed on unchanged to the final
sum, so a reduction's error variance is the sum over its roundings of ``E[ulp(S)**2] / 12``
for the partial sums ``S`` it rounds.

Ring, R ranks, each holding ``x_r ~ N(mu, sigma**2)`` pre-divided by R: after hop k (k terms)
``S_k ~ N(k mu / R, k sigma**2 / R**2)``, hence::

    Var(ring) = sum_{k=2..R} E[ulp(S_k)**2] / 12
              ~ c(F) * 2**(-2m) * sigma**2 / R**2 * sum_{k=2..R} k / 12
              -> c(F) * 2**(-2m) * sigma**2 / 24          (R large; mu = 0)

a constant independent of R: the R hops grow in number like R but each partial sum is
``1/R`` times smaller. That is the observation of the post "Why reduction precision matters". The
tree rounds R/2**l sums of ``2**l`` terms at level l:
``Var(tree) ~ c 2**(-2m) sigma**2 log2(R) / (12 R)``, which shrinks; all-to-all with fp32
accumulation only rounds the final mean: ``c 2**(-2m) sigma**2 / (12 R)``.
The sampling noise of the averaged gradient is ``sigma / sqrt(R)``, so the ring's
error-to-noise ratio grows like ``sqrt(R) * 2**-m`` (0.04 at R = 1024 in bf16) and the tree's
and all-to-all's stay flat.

Pre-dividing by an R that is not a power of two rounds each ``x_r / R`` once more, adding
``R E[ulp(x / R)**2] / 12``.

Because ulp is a power of two, ``E[ulp(S)**2]`` for Gaussian S is a sum over binades,
``sum_e P(2**e <= |S| < 2**(e+1)) 4**(e - m)`` (binades below ``emin`` share ``ulp = 2**(emin-m)``),
computed here exactly with the normal CDF; ``c = E[ulp(S)**2] / (2**(-2m) E[S**2])`` is close
to ``(1/2 - 1/8) / ln 2 = 0.541`` (mantissas log-uniform). The model leaves out one effect:
when both addends have similar size the exact sum has only a few extra bits ``d`` and the
rounding error is uniform on ``2**d`` points, variance ``ulp**2 (1/12 + 1/(6 * 4**d))``; this
makes very short rings (R <= 4) about 10 % worse than the model.

Non-zero mean: once ``|S_k| > 2**p |y|`` (p the precision, ``y = x / R`` the addend) nearest
rounding returns ``S_k`` unchanged: the sum *stagnates* and the result is biased toward zero.
With pre-division and ``R > 2**p`` identical addends a ring sums to about ``2**p / R`` of the truth.
"""
from __future__ import annotations

import math

import torch

from lowp.formats import FloatFormat, get_format
from lowp.pow2 import ulp_exponent

__all__ = ["expected_ulp_sq", "ulp_constant", "ring_error_std", "tree_error_std", "alltoall_error_std",
           "reduction_error_std", "sampling_noise", "stagnation_terms", "premultiply_bias", "underflow_fraction"]


def _normal_mass(lo: torch.Tensor, hi: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """P(lo <= |S| < hi) for S ~ N(mean, std**2), lo/hi >= 0 (float64 tensors)."""
    cdf = torch.special.ndtr
    return (cdf((hi - mean) / std) - cdf((lo - mean) / std)) + (cdf((-lo - mean) / std) - cdf((-hi - mean) / std))


def _expected_ulp_sq(stds: torch.Tensor, means: torch.Tensor, fmt: FloatFormat) -> torch.Tensor:
    """``E[ulp(S_k)**2]`` for a batch of ``S_k ~ N(means[k], stds[k]**2)`` (float64 tensors).

    ``P(|S| < 2**e)`` at every binade edge gives the mass of each binade; binades below ``emin``
    share the subnormal ulp ``2**(emin - m)``; a zero std is a point mass at the mean.
    """
    e = torch.arange(fmt.emin, fmt.emax + 2, dtype=torch.float64)
    edge = torch.exp2(e)[None, :]
    s, m = stds.clamp_min(1e-300)[:, None], means[:, None]
    below = torch.special.ndtr((edge - m) / s) - torch.special.ndtr((-edge - m) / s)   # P(|S| < 2**e)
    ulp_sq = torch.exp2(2 * (e - fmt.mantissa_bits))
    spread = (below[:, 1:] - below[:, :-1]) @ ulp_sq[:-1] + below[:, 0] * ulp_sq[0]
    point = torch.exp2(2 * ulp_exponent(means, fmt).to(torch.float64))
    return torch.where(stds > 0, spread, point)


def expected_ulp_sq(std: float, fmt: "str | FloatFormat", mean: float = 0.0) -> float:
    """``E[ulp(S)**2]`` for ``S ~ N(mean, std**2)``, ulp of ``fmt`` (a power of two per binade)."""
    if std < 0:
        raise ValueError(f"std: expected >= 0, got {std}")
    return float(_expected_ulp_sq(torch.tensor([float(std)], dtype=torch.float64),
                                  torch.tensor([float(mean)], dtype=torch.float64), get_format(fmt))[0])


def _sum_ulp_sq(counts: torch.Tensor, a: float, sigma: float, mean: float, fmt: "str | FloatFormat",
                weights: torch.Tensor | None = None) -> float:
    """``sum_k w_k E[ulp(S_k)**2]`` for partial sums of ``counts[k]`` terms ``a x``, ``x ~ N(mean, sigma**2)``."""
    counts = counts.to(torch.float64)
    values = _expected_ulp_sq(counts.sqrt() * a * sigma, counts * a * mean, get_format(fmt))
    return float(values.sum() if weights is None else (values * weights).sum())


def ulp_constant(fmt: "str | FloatFormat" = "bf16", std: float = 1.0) -> float:
    """``c = E[ulp(S)**2] / (2**(-2m) std**2)`` for ``S ~ N(0, std**2)`` in the normal range (~0.54)."""
    fmt = get_format(fmt)
    return expected_ulp_sq(std, fmt) / (math.ldexp(1.0, -2 * fmt.mantissa_bits) * std**2)


def _check(world_size: int, sigma: float) -> None:
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    if sigma < 0:
        raise ValueError(f"sigma: expected >= 0, got {sigma}")


def _scale(world_size: int, average: str) -> float:
    if average not in ("sum", "pre_divide"):
        raise ValueError(f"average: the model covers 'sum' and 'pre_divide', got {average!r}")
    return 1.0 if average == "sum" else 1.0 / world_size


def _division_var(world_size: int, sigma: float, fmt: "str | FloatFormat", mean: float, average: str) -> float:
    """Variance added by the R roundings ``fl(x_r / R)`` of pre-division (0 when R is a power of
    two: dividing by it is exact unless the quotient underflows)."""
    if average != "pre_divide" or world_size & (world_size - 1) == 0:
        return 0.0
    return world_size * expected_ulp_sq(sigma / world_size, fmt, mean / world_size) / 12


def ring_error_std(world_size: int, sigma: float, fmt: "str | FloatFormat" = "bf16", mean: float = 0.0,
                   average: str = "pre_divide") -> float:
    """Predicted std of (ring result - exact): ``sqrt(sum_{k=2..R} E[ulp(S_k)**2] / 12)``,
    ``S_k ~ N(k a mean, k a**2 sigma**2)`` with ``a = 1/R`` (pre-divide) or 1 (sum)."""
    _check(world_size, sigma)
    a = _scale(world_size, average)
    var = _sum_ulp_sq(torch.arange(2, world_size + 1), a, sigma, mean, fmt) / 12
    return math.sqrt(var + _division_var(world_size, sigma, fmt, mean, average))


def tree_error_std(world_size: int, sigma: float, fmt: "str | FloatFormat" = "bf16", mean: float = 0.0,
                   average: str = "pre_divide") -> float:
    """Predicted std for pairwise summation: level l rounds ``floor(n_l / 2)`` sums of ``2**l`` terms."""
    _check(world_size, sigma)
    a = _scale(world_size, average)
    pairs, terms, rows = [], [], world_size
    while rows > 1:
        pairs.append(rows // 2)
        terms.append(2 ** len(pairs))
        rows = rows // 2 + rows % 2
    var = _sum_ulp_sq(torch.tensor(terms), a, sigma, mean, fmt, torch.tensor(pairs, dtype=torch.float64)) / 12
    return math.sqrt(var + _division_var(world_size, sigma, fmt, mean, average))


def alltoall_error_std(world_size: int, sigma: float, fmt: "str | FloatFormat" = "bf16", mean: float = 0.0,
                       average: str = "pre_divide") -> float:
    """Predicted std for all-to-all + fp32 accumulation: one rounding of the result to ``fmt``."""
    _check(world_size, sigma)
    a = _scale(world_size, average)
    final = expected_ulp_sq(math.sqrt(world_size) * a * sigma, fmt, world_size * a * mean) / 12
    return math.sqrt(final + _division_var(world_size, sigma, fmt, mean, average))


_MODELS = {"ring": ring_error_std, "tree": tree_error_std, "alltoall": alltoall_error_std}


def reduction_error_std(algorithm: str, world_size: int, sigma: float, fmt: "str | FloatFormat" = "bf16",
                        mean: float = 0.0, average: str = "pre_divide") -> float:
    """Dispatch to :func:`ring_error_std`, :func:`tree_error_std` or :func:`alltoall_error_std`."""
    if algorithm not in _MODELS:
        raise ValueError(f"algorithm: expected one of {tuple(_MODELS)}, got {algorithm!r}")
    return _MODELS[algorithm](world_size, sigma, fmt, mean, average)


def sampling_noise(world_size: int, sigma: float) -> float:
    """Std of the mean of R independent per-rank gradients: ``sigma / sqrt(R)``."""
    _check(world_size, sigma)
    return sigma / math.sqrt(world_size)


def stagnation_terms(fmt: "str | FloatFormat" = "bf16") -> int:
    """About how many equal addends a nearest-rounded running sum absorbs before it stops
    growing: ``2**p`` (p = significand bits; bf16 256, fp16 2048, e4m3 16). The exact stop lies in
    ``[2**(p-1), 2**(p+1)]`` depending on the addend's mantissa."""
    return 2 ** get_format(fmt).precision


def premultiply_bias(world_size: int, fmt: "str | FloatFormat" = "bf16") -> float:
    """Relative bias ``R * fl(1/R) - 1`` of NCCL-style averaging (premultiply by the rounded 1/R)."""
    from lowp.rounding import quantize

    _check(world_size, 0.0)
    inv = float(quantize(torch.tensor([1.0 / world_size], dtype=torch.float64), fmt)[0])
    return world_size * inv - 1.0


def underflow_fraction(world_size: int, sigma: float, fmt: "str | FloatFormat" = "fp16", mean: float = 0.0,
                       threshold: str = "zero") -> float:
    """P(|x / R| falls below the format's range) for ``x ~ N(mean, sigma**2)`` pre-divided by R.

    ``threshold="zero"``: below half the smallest subnormal (the value flushes to 0);
    ``"subnormal"``: below the smallest normal (precision is lost)."""
    _check(world_size, sigma)
    fmt = get_format(fmt)
    limits = {"zero": fmt.min_subnormal / 2, "subnormal": fmt.min_normal}
    if threshold not in limits:
        raise ValueError(f"threshold: expected 'zero' or 'subnormal', got {threshold!r}")
    bound = torch.tensor([limits[threshold] * world_size], dtype=torch.float64)
    if sigma == 0:
        return float(abs(mean) < float(bound[0]))
    return float(_normal_mass(torch.zeros(1, dtype=torch.float64), bound, mean, sigma)[0])
