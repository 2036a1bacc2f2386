"""The five L2-norm methods, each written once against the ``Ops`` interface of :mod:`.compute`.

Every function takes ``a = |x|`` (rows along the last dimension, values already in the compute
format), ``eps`` (a compute-format scalar tensor) and returns ``sqrt(sum a**2 + eps)`` per row as
float64 (the value the compute format produced, or for ``robust`` the exact double-word result,
to be rounded once to the output format by the caller).
"""
from __future__ import annotations

import math
from collections.abc import Callable

import torch

from lowp.formats import FloatFormat
from lowp.norms.compute import ZERO_EXPONENT, Ops, fast_two_sum, logb, two_square, two_sum

__all__ = ["naive", "max_scaled", "two_segment", "blue", "robust", "METHODS", "seed_thresholds",
           "blue_constants", "check_robust_format"]


def _masked_sum(ops: Ops, terms: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Sequential sum (in the compute format) of the terms where ``mask`` holds."""
    return ops.sum(torch.where(mask, terms, torch.zeros_like(terms)), dim=-1)


def _f64(t: torch.Tensor) -> torch.Tensor:
    return t.to(torch.float64)


def naive(ops: Ops, a: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``sqrt(a_1**2 + ... + a_n**2 + eps)`` summed left to right, every operation in the format."""
    return _f64(ops.sqrt(ops.add(ops.sum(ops.mul(a, a), dim=-1), eps)))


def max_scaled(ops: Ops, a: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """Scaling by the largest magnitude (LAPACK style): ``xhat * sqrt(sum (a/xhat)**2 + (eps/xhat)/xhat)``,
    ``xhat = max a``; a zero row gives ``sqrt(eps)``."""
    xhat = a.amax(dim=-1)
    safe = torch.where(xhat == 0, torch.ones_like(xhat), xhat)
    y = ops.div(a, safe.unsqueeze(-1))
    s = ops.add(ops.sum(ops.mul(y, y), dim=-1), ops.div(ops.div(eps, safe), safe))
    out = ops.mul(safe, ops.sqrt(s))
    return _f64(torch.where(xhat == 0, ops.sqrt(eps + torch.zeros_like(xhat)), out))


def seed_thresholds(ops: Ops) -> tuple[torch.Tensor, torch.Tensor]:
    """The two-segment method's thresholds in the compute format: ``beta_H = sqrt(max)`` (fp16: 256) and
    ``beta_L = sqrt(min_subnormal)`` (fp16: 2**-12 = 2.44e-4), each computed with the format's sqrt."""
    fmt: FloatFormat = ops.format
    return ops.sqrt(ops.cast(fmt.max)), ops.sqrt(ops.cast(fmt.min_subnormal))


def two_segment(ops: Ops, a: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """The two-segment method, as commonly written (both segments).

    * normal case (``max a <= beta_H`` and every non-zero ``a >= beta_L``): :func:`naive`;
    * overflow segment (``xhat = max a > beta_H``): large part ``K = sqrt(sum_{a>beta_H} (a/xhat)**2)``,
      rest ``Q = sum_{a<=beta_H} a**2 + eps`` (no square root), result ``K*xhat + Q/(2*K*xhat)``
      (first-order Taylor expansion of ``sqrt(K**2 xhat**2 + Q)``);
    * underflow segment (otherwise, some ``0 < a < beta_L``): ``xt = max`` of the small ones,
      ``K = sqrt(sum_small (a/xt)**2)``, ``Q = sqrt(sum_rest a**2 + eps)``, ``gamma = K*xt/Q``;
      ``Q*sqrt(1 + gamma**2)`` if ``gamma > beta_L`` else ``Q + (Q*gamma)*gamma/2``.

    The seed does not define a vector with both kinds; the overflow segment wins. Zeros count in
    neither small nor large part (the seed's ``x_min`` is read over non-zero components).
    """
    beta_h, beta_l = seed_thresholds(ops)
    zero = torch.zeros_like(a)
    half = ops.cast(0.5)
    sq = ops.mul(a, a)
    xhat = a.amax(dim=-1, keepdim=True)
    big = a > beta_h
    small = (a < beta_l) & (a > 0)
    # overflow segment
    ratio_big = ops.div(a, torch.where(xhat == 0, torch.ones_like(xhat), xhat))
    k_big = ops.sqrt(_masked_sum(ops, ops.mul(ratio_big, ratio_big), big))
    q_over = ops.add(_masked_sum(ops, sq, ~big), eps)
    t = ops.mul(k_big, xhat.squeeze(-1))
    over = ops.add(t, ops.div(q_over, ops.add(t, t)))
    # underflow segment
    xt = torch.where(small, a, zero).amax(dim=-1, keepdim=True)
    ratio = ops.div(a, torch.where(xt == 0, torch.ones_like(xt), xt))
    k_small = ops.sqrt(_masked_sum(ops, ops.mul(ratio, ratio), small))
    q = ops.sqrt(ops.add(_masked_sum(ops, sq, ~small), eps))
    gamma = ops.div(ops.mul(k_small, xt.squeeze(-1)), q)
    exact_form = ops.mul(q, ops.sqrt(ops.add(ops.cast(1.0), ops.mul(gamma, gamma))))
    taylor = ops.add(q, ops.mul(ops.mul(ops.mul(q, gamma), gamma), half))
    under = torch.where(gamma > beta_l, exact_form, taylor)
    normal = naive(ops, a, eps).to(over.dtype)
    out = torch.where(big.any(-1), over, torch.where(small.any(-1), under, normal))
    return _f64(out)


def blue_constants(fmt: FloatFormat) -> dict[str, float]:
    """Blue's thresholds and scales for ``fmt`` as LAPACK 3.10's ``la_constants`` derives them
    (Anderson 2017, ACM TOMS 44(1) Algorithm 978) from Fortran's model numbers
    ``minexponent = emin + 1``, ``maxexponent = emax + 1``, ``digits = p``:
    ``tsml = 2**ceil((minexp-1)/2)``, ``tbig = 2**floor((maxexp-digits+1)/2)``,
    ``ssml = 2**-floor((minexp-digits)/2)``, ``sbig = 2**-ceil((maxexp+digits-1)/2)``.
    fp16: tsml = 2**-7, tbig = 8, ssml = 2**12, sbig = 2**-13."""
    minexp, maxexp, digits = fmt.emin + 1, fmt.emax + 1, fmt.precision
    return {"tsml": 2.0 ** math.ceil((minexp - 1) / 2), "tbig": 2.0 ** math.floor((maxexp - digits + 1) / 2),
            "ssml": 2.0 ** -math.floor((minexp - digits) / 2), "sbig": 2.0 ** -math.ceil((maxexp + digits - 1) / 2)}


def blue(ops: Ops, a: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """Blue (1978) with three accumulators as in reference BLAS ``nrm2`` since LAPACK 3.10:
    ``a > tbig`` adds ``(a*sbig)**2`` to ``abig``; ``a < tsml`` adds ``(a*ssml)**2`` to ``asml``
    (while no big value has been seen); the rest adds ``a**2`` to ``amed``; then the
    accumulators are combined as in ``dnrm2.f90``. ``eps`` joins the accumulator that
    ``sqrt|eps|`` would select (nrm2 has no eps)."""
    c = {k: ops.cast(v) for k, v in blue_constants(ops.format).items()}
    big, sml = a > c["tbig"], a < c["tsml"]
    med = ~big & ~sml
    # reference nrm2 stops feeding asml once a big value has appeared ("notbig")
    notbig = torch.cumsum(big.to(torch.int32), dim=-1) == 0
    def sq(v: torch.Tensor) -> torch.Tensor:
        return ops.mul(v, v)
    abig = _masked_sum(ops, sq(ops.mul(a, c["sbig"])), big)
    asml = _masked_sum(ops, sq(ops.mul(a, c["ssml"])), sml & notbig)
    amed = _masked_sum(ops, sq(a), med)
    abs_eps = eps.abs()
    eps_big, eps_sml = abs_eps > ops.mul(c["tbig"], c["tbig"]), abs_eps < ops.mul(c["tsml"], c["tsml"])
    abig = torch.where(eps_big, ops.add(abig, ops.mul(ops.mul(eps, c["sbig"]), c["sbig"])), abig)
    asml = torch.where(eps_sml, ops.add(asml, ops.mul(ops.mul(eps, c["ssml"]), c["ssml"])), asml)
    amed = torch.where(~eps_big & ~eps_sml, ops.add(amed, eps), amed)
    one = ops.cast(1.0)
    med_present = (amed > 0) | torch.isnan(amed)
    # abig > 0: fold amed into abig
    big_sum = torch.where(med_present, ops.add(abig, ops.mul(ops.mul(amed, c["sbig"]), c["sbig"])), abig)
    big_res = ops.div(ops.sqrt(big_sum), c["sbig"])
    # asml > 0 and amed present: combine the two square roots
    ymed, ysml = ops.sqrt(amed), ops.div(ops.sqrt(asml), c["ssml"])
    ymax, ymin = torch.maximum(ymed, ysml), torch.minimum(ymed, ysml)
    ratio = ops.div(ymin, ymax)
    mixed = ops.sqrt(ops.mul(sq(ymax), ops.add(one, sq(ratio))))
    sml_res = torch.where(med_present, mixed, ysml)
    out = torch.where(abig > 0, big_res, torch.where(asml > 0, sml_res, ops.sqrt(amed)))
    return _f64(out)


def _align(ops: Ops, hi: torch.Tensor, lo: torch.Tensor, k: torch.Tensor, to: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rescale the double word ``(hi + lo) * 4**k`` to exponent ``to >= k`` (exact unless negligible)."""
    shift = 2 * (k - to)
    return ops.scale2(hi, shift), ops.scale2(lo, shift)


def _renormalize(ops: Ops, hi: torch.Tensor, lo: torch.Tensor, k: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Move powers of four from ``hi`` into ``k`` so that ``hi`` lies in [1, 4) (zero stays zero)."""
    d = torch.where(hi == 0, torch.zeros_like(k), torch.div(logb(hi), 2, rounding_mode="floor"))
    return ops.scale2(hi, -2 * d), ops.scale2(lo, -2 * d), k + d


def _dw_add(ops: Ops, x: tuple[torch.Tensor, ...], y: tuple[torch.Tensor, ...], *, cancel: bool = False
            ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Sum of two extended-exponent double words ``(hi, lo, k)`` meaning ``(hi + lo) * 4**k``:
    align both to the larger ``k`` (power-of-two scaling), TwoSum the high parts, add the low
    parts to the error, renormalize (FastTwoSum when both are non-negative, TwoSum when
    ``cancel``), then bring ``hi`` back into [1, 4)."""
    k = torch.maximum(x[2], y[2])
    xh, xl = _align(ops, x[0], x[1], x[2], k)
    yh, yl = _align(ops, y[0], y[1], y[2], k)
    s, e = two_sum(ops, xh, yh)
    e = ops.add(e, ops.add(xl, yl))
    hi, lo = (two_sum if cancel else fast_two_sum)(ops, s, e)
    return _renormalize(ops, hi, lo, k)


def _unit_scale(ops: Ops, v: torch.Tensor, e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(v * 2**-e, e)`` with zeros left at 0 (their ``e`` is :data:`ZERO_EXPONENT`)."""
    return ops.scale2(v, torch.where(v == 0, torch.zeros_like(e), -e)), e


def sum_of_squares(ops: Ops, a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``sum a**2`` per row as an extended-exponent double word ``(hi, lo, k)``.

    Each ``a_i = y_i * 2**e_i`` with ``y_i`` in [1, 2) (exact scaling), so ``y_i**2 = p + err``
    exactly by TwoProduct and the term is ``(p, err, e_i)``. Terms are added pairwise (halves of
    the row, ``log2 n`` levels) with :func:`_dw_add`, so no partial sum can overflow or
    underflow (the exponent lives in ``k``) and none stagnates (the double word carries about
    ``2p`` bits).
    """
    y, k = _unit_scale(ops, a, logb(a))
    hi, lo = two_square(ops, y)  # a**2 = (hi + lo) * 4**k exactly
    n = a.shape[-1]
    width = 1 << max(n - 1, 0).bit_length()
    if width != n:
        pad = width - n
        hi = torch.nn.functional.pad(hi, (0, pad))
        lo = torch.nn.functional.pad(lo, (0, pad))
        k = torch.nn.functional.pad(k, (0, pad), value=ZERO_EXPONENT)
    while hi.shape[-1] > 1:
        m = hi.shape[-1] // 2
        hi, lo, k = _dw_add(ops, (hi[..., :m], lo[..., :m], k[..., :m]), (hi[..., m:], lo[..., m:], k[..., m:]))
    return hi[..., 0], lo[..., 0], k[..., 0]


def _dw_sqrt(ops: Ops, hi: torch.Tensor, lo: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``sqrt(hi + lo)`` as a double word: ``r = sqrt(hi)`` then one Newton step
    ``r + ((hi - r**2) + lo) / (2r)`` with ``r**2`` exact by TwoProduct (``hi - p`` is exact by
    Sterbenz's lemma), about ``2p`` correct bits."""
    r = ops.sqrt(hi)
    p, perr = two_square(ops, r)
    resid = ops.add(ops.sub(ops.sub(hi, p), perr), lo)
    safe_r = torch.where(r > 0, r, torch.ones_like(r))
    corr = torch.where(r > 0, ops.div(resid, ops.add(safe_r, safe_r)), torch.zeros_like(r))
    return fast_two_sum(ops, r, corr)


def check_robust_format(fmt: FloatFormat) -> None:
    """``robust`` needs, in the compute format, exact squares of significands in [1, 2) (their last
    bit, ``2**-2(p-1)``, must be representable) and room for a partial sum below 16."""
    smallest = fmt.min_subnormal if fmt.subnormals else fmt.min_normal
    if 2.0 ** (-2 * (fmt.precision - 1)) < smallest or fmt.max < 16:
        raise ValueError(f"compute: {fmt.name} is too narrow for method='robust' (needs exact squares of "
                         f"[1, 2) significands and a maximum of at least 16)")


def robust(ops: Ops, a: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """lowp's method: exact power-of-two scaling per element, exact squares, pairwise
    double-word accumulation with an integer exponent, eps added with TwoSum, double-word
    square root; returns ``(r_hi + r_lo) * 2**k`` exactly (float64) for one final rounding."""
    check_robust_format(ops.format)
    hi, lo, k = sum_of_squares(ops, a)
    eps_row = eps.expand(hi.shape)
    ek = torch.div(logb(eps_row), 2, rounding_mode="floor")
    eps_hi, _ = _unit_scale(ops, eps_row, 2 * ek)
    eps_dw = (eps_hi, torch.zeros_like(hi), ek)
    hi, lo, k = _dw_add(ops, (hi, lo, k), eps_dw, cancel=True)
    negative = hi < 0
    hi = torch.where(negative, torch.zeros_like(hi), hi)
    lo = torch.where(negative, torch.zeros_like(lo), lo)
    rh, rl = _dw_sqrt(ops, hi, lo)
    value = torch.ldexp(_f64(rh) + _f64(rl), torch.where(hi == 0, torch.zeros_like(k), k).to(torch.float64))
    return torch.where(negative, torch.full_like(value, math.nan), value)


Method = Callable[[Ops, torch.Tensor, torch.Tensor], torch.Tensor]
METHODS: dict[str, Method] = {"naive": naive, "max_scaled": max_scaled, "two_segment": two_segment,
                              "blue": blue, "robust": robust}
