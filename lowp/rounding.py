"""Rounding to a number format: ``quantize(x, format, mode)`` as a pure torch function.

The result holds exactly the values of ``format`` but stays in ``x``'s own dtype (the
*container*). Rounding is done once, from the container value, so there is no double
rounding as long as the format fits in the container: fewer mantissa bits and an
exponent range inside it. fp32 holds every format here up to 23 mantissa bits and 8
exponent bits (bf16, fp16, tf32, fp8, DLFloat16, fp6, fp4); fp64 holds fp32. A format
that does not fit raises an error naming the container it needs.

Methods (both exact; docs/formats.md has the details and the measurements):

* bit path (:func:`_round_bits`), for magnitudes in the format's normal range: the container's
  magnitude bits as an integer, where the format's quantum is ``2**s`` units with the same
  ``s = container_mantissa_bits - mantissa_bits`` for every element; each mode is a few integer
  operations (about 2-7 ns/element on one CPU core, against ~70 for the value-space method).
* value-space method (:func:`_round`), for nonzero magnitudes below the format's ``min_normal``:
  with ``e = floor(log2|x|)`` and the quantum exponent ``q = max(e, emin) - mantissa_bits``
  (:func:`lowp.pow2.ulp_exponent`),
  ``n = |x| * 2**-q`` is exact and has at most ``mantissa_bits + 1`` integer bits; ``floor(n)``
  and ``frac = n - floor(n)`` are exact, so every mode is a decision on ``frac``.

Modes:
    ``nearest_even`` (IEEE default), ``nearest_away``, ``toward_zero``, ``up`` (toward +inf),
    ``down`` (toward -inf), ``odd`` (round to odd: truncate, set the last bit if inexact;
    used to make a later rounding free of double-rounding errors), ``stochastic``
    (round up with probability ``frac``; with ``rand_bits = k`` the decision uses k random
    bits as hardware does, rounding up with probability ``floor(frac * 2**k) / 2**k``).
"""
from __future__ import annotations

from functools import lru_cache
from typing import Literal, NamedTuple

import torch

from lowp.formats import FloatFormat, get_format
from lowp.pow2 import scale_pow2, ulp_exponent

RoundingMode = Literal["nearest_even", "nearest_away", "toward_zero", "up", "down", "odd", "stochastic"]

ROUNDING_MODES: tuple[str, ...] = ("nearest_even", "nearest_away", "toward_zero", "up", "down", "odd", "stochastic")
_MODE_ALIASES = {"nearest": "nearest_even", "rne": "nearest_even", "rna": "nearest_away", "rtz": "toward_zero",
                 "truncate": "toward_zero", "ru": "up", "rd": "down", "sr": "stochastic"}

__all__ = ["quantize", "quantize_ste", "ROUNDING_MODES", "RoundingMode", "container_for", "fits_in", "canonical_mode",
           "check_float_tensor"]


def check_float_tensor(x: object, name: str = "x") -> torch.Tensor:
    """``x`` if it is a dense floating-point tensor that holds values; otherwise an error naming
    ``name``: ``TypeError`` for a non-tensor or a non-floating dtype (integer, bool, complex),
    ``ValueError`` for a sparse or nested layout or a meta tensor (which has a shape but no values).

    Args:
        x: the argument to check.
        name: the argument's name, for the message (``"x"``, ``"input"``).
    """
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name}: expected a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name}: expected a floating-point tensor, got dtype {x.dtype}")
    if x.is_nested:
        raise ValueError(f"{name}: expected a dense (strided) tensor, got a nested tensor; pass its components "
                         f"one at a time")
    if x.layout != torch.strided:
        raise ValueError(f"{name}: expected a dense (strided) tensor, got layout {x.layout}; pass {name}.to_dense()")
    if x.is_meta:
        raise ValueError(f"{name}: a meta tensor has no values; pass a tensor on a device that holds data "
                         f"(cpu, cuda, ...)")
    return x


def canonical_mode(mode: str) -> str:
    """The canonical name of a rounding mode (``"rne"`` -> ``"nearest_even"``)."""
    name = _MODE_ALIASES.get(mode, mode)
    if name not in ROUNDING_MODES:
        raise ValueError(f"mode: unknown rounding mode {mode!r}; expected one of {', '.join(ROUNDING_MODES)}")
    return name


def fits_in(fmt: FloatFormat, container: FloatFormat) -> bool:
    """True when every value of ``fmt`` (and every rounding boundary) is exact in ``container``."""
    return (fmt.mantissa_bits <= container.mantissa_bits and fmt.emax <= container.emax
            and fmt.emin - fmt.mantissa_bits >= container.emin - container.mantissa_bits)


def container_for(fmt: "str | torch.dtype | FloatFormat") -> torch.dtype:
    """The narrowest of float32/float64 that can hold ``fmt`` without double rounding."""
    fmt = get_format(fmt)
    return torch.float32 if fits_in(fmt, get_format("fp32")) else torch.float64


def quantize(x: torch.Tensor, format: "str | torch.dtype | FloatFormat", mode: str = "nearest_even", *,
             generator: torch.Generator | None = None, rand_bits: int | None = None,
             native: bool = True) -> torch.Tensor:
    """Round ``x`` to ``format``; return values of that format in ``x``'s dtype.

    Args:
        x: a dense floating tensor with values (fp16/bf16 inputs are rounded through fp32,
            exactly): an integer, bool or complex dtype raises ``TypeError``, a sparse or nested
            layout or a meta tensor ``ValueError`` (:func:`check_float_tensor`).
        format: a :class:`~lowp.formats.FloatFormat`, a name such as ``"fp8_e4m3fn"`` or a dtype.
        mode: one of :data:`ROUNDING_MODES` (aliases: ``nearest``, ``rne``, ``rtz``, ``sr`` ...).
        generator: random source for ``stochastic`` (seed it for reproducible results).
        rand_bits: random bits per stochastic decision (default: the container's precision,
            24 for fp32 and 53 for fp64, which is exact and unbiased).
        native: allow torch's own cast when it gives the same answer (the format has a torch
            dtype, round-to-nearest-even, the same overflow policy, and an fp32 or narrower
            input). ``native=False`` always runs the emulation.

    Special values follow the format: NaN stays NaN (also for formats without a NaN code,
    whose data can hold none); ±inf stays ±inf in IEEE formats and becomes NaN or ±max by the
    overflow policy elsewhere; -0 becomes +0 in fnuz formats; without subnormals, magnitudes
    below the smallest normal round (by the mode) to 0 or to the smallest normal.
    A float16/bfloat16 ``x`` is rounded in float32 and the result cast back, which is exact only
    when the format fits in x's dtype; otherwise a ValueError asks for a float32 ``x``.
    """
    fmt = get_format(format)
    mode = canonical_mode(mode)
    check_float_tensor(x, "x")
    if rand_bits is not None:
        if mode != "stochastic":
            raise ValueError("rand_bits: only meaningful with mode='stochastic'")
        if isinstance(rand_bits, bool) or not isinstance(rand_bits, int):
            raise TypeError(f"rand_bits: expected an int or None, got {type(rand_bits).__name__}")
    if x.dtype in (torch.float32, torch.float64):
        container = x
    elif x.dtype in (torch.float16, torch.bfloat16):
        if not fits_in(fmt, get_format(x.dtype)):
            raise ValueError(f"format: {fmt.name} values are not all representable in x's dtype {x.dtype}, "
                             f"so the result cannot keep it; pass x.float()")
        container = x.float()
    else:
        raise TypeError(f"x: dtype {x.dtype} cannot be used as a container; use float32 or float64")
    cfmt = get_format(container.dtype)
    if not fits_in(fmt, cfmt):
        need = "float64" if fits_in(fmt, get_format("fp64")) else "no torch dtype"
        raise ValueError(f"format: {fmt.name} does not fit in a {container.dtype} container without double "
                         f"rounding; pass x as {need}")
    if rand_bits is not None and not 1 <= rand_bits <= cfmt.precision:
        raise ValueError(f"rand_bits: expected an int in [1, {cfmt.precision}] for a {container.dtype} container, "
                         f"got {rand_bits}")
    if native and mode == "nearest_even" and _native_cast_matches(fmt) and container.dtype == torch.float32:
        out = container.to(fmt.torch_dtype).to(container.dtype)
    else:
        out = _round_bits(container, fmt, mode, generator, rand_bits)
    return out if out.dtype == x.dtype else out.to(x.dtype)


_CHUNK = 1 << 18  # elements per step of the bit path: its temporaries stay in cache


class _Bits(NamedTuple):
    """Constants of the bit path for one (format, container) pair: container magnitudes as
    integers, with the format's quantum ``2**shift`` units in its normal range."""
    int_dtype: torch.dtype
    width: int          # 32 or 64
    shift: int          # container mantissa bits - format mantissa bits
    max_bits: int       # the format's max, as container bits
    inf_bits: int
    policy_bits: int    # what an overflow becomes: inf, NaN or max
    min_normal_bits: int  # below this magnitude (nonzero) the value-space method takes over

    @property
    def magnitude_mask(self) -> int:
        return (1 << (self.width - 1)) - 1


@lru_cache(maxsize=None)
def _bits_for(fmt: FloatFormat, dtype: torch.dtype) -> _Bits:
    int_dtype = {torch.float32: torch.int32, torch.float64: torch.int64}[dtype]

    def bits_of(value: float) -> int:
        return int(torch.tensor(value, dtype=dtype).view(int_dtype).item())

    policy = {"inf": float("inf"), "nan": float("nan"), "saturate": fmt.max}[fmt.overflow or "saturate"]
    container = get_format(dtype)
    # the constant shift needs both the format and the container in their normal ranges
    both_normal = max(fmt.min_normal, container.min_normal)
    return _Bits(int_dtype, torch.finfo(dtype).bits, container.mantissa_bits - fmt.mantissa_bits,
                 bits_of(fmt.max), bits_of(float("inf")), bits_of(abs(policy)), bits_of(both_normal))


def _round_bits(x: torch.Tensor, fmt: FloatFormat, mode: str, generator: torch.Generator | None,
                rand_bits: int | None) -> torch.Tensor:
    """Rounding on the container's bits, in cache-sized chunks, ~20x faster than :func:`_round`.

    In the format's normal range its quantum is ``2**shift`` units of the container's magnitude
    bits for every element, so each mode is a few integer operations with a constant shift (a
    carry out of the mantissa moves into the exponent, which is the right answer). Nonzero
    magnitudes below the format's ``min_normal`` have a quantum that no longer matches the
    container's binades; they go through the value-space method :func:`_round`. Masks are
    applied arithmetically (``r + m * (v - r)``) because torch's CPU ``where`` is ~30x slower.
    """
    c = _bits_for(fmt, x.dtype)
    flat = x.reshape(-1)
    out = torch.empty_like(flat)
    out_bits = out.view(c.int_dtype)
    step = _CHUNK if x.device.type == "cpu" else max(flat.numel(), 1)  # accelerators: one pass
    mag_buf = torch.empty(min(flat.numel(), step), dtype=c.int_dtype, device=x.device)
    sign_buf = torch.empty_like(mag_buf)
    # with the container's own emin the bit path is exact down to 0 (same subnormal grid)
    exact_to_zero = fmt.subnormals and fmt.emin == get_format(x.dtype).emin
    small: list[torch.Tensor] = []  # indices left to the value-space method
    for start in range(0, flat.numel(), step):
        chunk = flat[start:start + step]
        bits = chunk.view(c.int_dtype)
        mag = torch.bitwise_and(bits, c.magnitude_mask, out=mag_buf[:bits.numel()])
        sign = torch.bitwise_xor(bits, mag, out=sign_buf[:bits.numel()])
        r = _round_magnitudes(mag, bits, c, mode, generator, rand_bits)
        if int(mag.max()) > c.max_bits:
            r = _apply_range_bits(r, mag, bits, c, fmt, mode)
        if not fmt.has_negative_zero:
            sign *= (r != 0).to(c.int_dtype)
        torch.bitwise_or(r, sign, out=out_bits[start:start + step])
        if exact_to_zero:
            continue
        lowest = int(mag.min())
        if lowest >= c.min_normal_bits:
            continue
        if lowest == 0:  # zeros are exact on this path: look for small magnitudes among the others
            below = mag.sub_(1).bitwise_and_(c.magnitude_mask)  # 0 -> the largest value
            is_small = below < c.min_normal_bits - 1
        else:
            is_small = mag < c.min_normal_bits
        small.append(is_small.nonzero().squeeze(1) + start)
    if small:  # one value-space call for all chunks: its fixed cost is paid once
        index = torch.cat(small)
        out.index_copy_(0, index, _round(flat.index_select(0, index), fmt, mode, generator, rand_bits))
    return out.reshape(x.shape)


def _round_magnitudes(mag: torch.Tensor, bits: torch.Tensor, c: _Bits, mode: str,
                      generator: torch.Generator | None, rand_bits: int | None) -> torch.Tensor:
    """Round integer magnitudes to multiples of ``2**shift`` (modes decided on the low bits)."""
    shift, unit = c.shift, 1 << c.shift
    low_mask, keep = unit - 1, c.magnitude_mask & ~(unit - 1)
    if shift == 0:
        return mag.clone()
    if mode == "nearest_even":  # add half - 1, plus 1 more when the kept part is odd, then truncate
        return (mag >> shift).bitwise_and_(1).add_(mag).add_(unit // 2 - 1).bitwise_and_(keep)
    if mode == "nearest_away":
        return (mag + unit // 2).bitwise_and_(keep)
    if mode == "toward_zero":
        return mag & keep
    if mode == "stochastic":  # add `shift` uniform random low bits, then truncate: P(up) = low / unit
        return _random_low_bits(mag, c, generator, rand_bits).add_(mag).bitwise_and_(keep)
    inexact = (mag & low_mask).add_(low_mask) >> shift  # 1 when any low bit is set
    if mode == "odd":
        return (mag & keep).bitwise_or_(inexact << shift)
    negative = -(bits >> (c.width - 1))                 # 1 for negative values
    away = negative if mode == "down" else 1 - negative
    return (mag & keep).add_(inexact.mul_(away) << shift)


def _random_low_bits(mag: torch.Tensor, c: _Bits, generator: torch.Generator | None,
                     rand_bits: int | None) -> torch.Tensor:
    """``shift`` random low bits per element, of which only the top ``k = min(shift, rand_bits)``
    may be nonzero (so rounding up has probability ``floor(frac * 2**k) / 2**k``). Random 64-bit
    words are cut into 16-, 32- or 64-bit pieces, as few bits per element as k allows."""
    n = mag.numel()
    k = c.shift if rand_bits is None else min(c.shift, rand_bits)
    piece_bits = 16 if k <= 16 else 32 if k <= 32 else 64
    pieces = torch.randint(-2**63, 2**63 - 1, (-(-n * piece_bits // 64),), dtype=torch.int64,
                           generator=generator, device=mag.device)
    piece_dtype = {16: torch.int16, 32: torch.int32, 64: torch.int64}[piece_bits]
    words = pieces.view(piece_dtype)[:n].to(c.int_dtype)  # sign-extended: only the low piece_bits count
    top_k = (words >> (piece_bits - k)).bitwise_and_((1 << k) - 1)
    return top_k << (c.shift - k)


def _apply_range_bits(r: torch.Tensor, mag: torch.Tensor, bits: torch.Tensor, c: _Bits, fmt: FloatFormat,
                      mode: str) -> torch.Tensor:
    """Overflow policy and inf/NaN inputs on integer magnitudes (same rules as :func:`_apply_range`)."""
    over = (r > c.max_bits).to(c.int_dtype)
    if mode in ("toward_zero", "odd"):
        target: "torch.Tensor | int" = c.max_bits
    elif mode in ("up", "down"):
        negative = -(bits >> (c.width - 1))
        to_max = negative if mode == "up" else 1 - negative
        target = to_max * (c.max_bits - c.policy_bits) + c.policy_bits
    else:
        target = c.policy_bits
    r = r + over * (target - r)
    special_value = mag  # NaN stays NaN; inf stays inf, or follows the policy without an inf code
    if not fmt.has_inf:
        special_value = mag + (mag == c.inf_bits).to(c.int_dtype) * (c.policy_bits - c.inf_bits)
    special = (mag >= c.inf_bits).to(c.int_dtype)
    return r + special * (special_value - r)


def _round(x: torch.Tensor, fmt: FloatFormat, mode: str, generator: torch.Generator | None,
           rand_bits: int | None) -> torch.Tensor:
    """Rounding in value space (the method of the module docstring); any magnitude, any format."""
    cfmt = get_format(x.dtype)
    mag = x.abs()
    negative = torch.signbit(x)
    q = ulp_exponent(mag, fmt)
    if not fmt.subnormals:                         # below min_normal the neighbours are 0 and min_normal
        q = torch.where(mag < fmt.min_normal, fmt.emin, q)
    n = scale_pow2(mag, -q)                            # exact: at most mantissa_bits + 1 integer bits
    whole = torch.floor(n)
    frac = n - whole                               # exact
    if mode == "stochastic":
        k = cfmt.precision if rand_bits is None else rand_bits
        u = torch.floor(torch.rand(x.shape, generator=generator, device=x.device, dtype=x.dtype) * 2.0**k)
        up = u + torch.floor(frac * 2.0**k) >= 2.0**k
    else:
        odd = torch.remainder(whole, 2) == 1
        inexact = frac != 0
        if mode == "nearest_even":
            up = (frac > 0.5) | ((frac == 0.5) & odd)
        elif mode == "nearest_away":
            up = frac >= 0.5
        elif mode == "toward_zero":
            up = torch.zeros_like(inexact)
        elif mode == "odd":
            up = inexact & ~odd
        else:  # directed: away from zero in magnitude when the sign points that way
            away = ~negative if mode == "up" else negative
            up = inexact & away
    rounded = scale_pow2(whole + up.to(x.dtype), q)
    rounded = _apply_range(rounded, mag, negative, fmt, mode)
    out = torch.where(negative, -rounded, rounded)
    if not fmt.has_negative_zero:
        out = torch.where(out == 0, torch.zeros_like(out), out)
    return out


def _apply_range(rounded: torch.Tensor, mag: torch.Tensor, negative: torch.Tensor, fmt: FloatFormat,
                 mode: str) -> torch.Tensor:
    """Overflow policy and special inputs (on magnitudes)."""
    big = torch.tensor(fmt.max, dtype=rounded.dtype, device=rounded.device)
    policy_value = {"inf": float("inf"), "nan": float("nan"), "saturate": fmt.max}[fmt.overflow or "saturate"]
    if mode in ("toward_zero", "odd"):
        toward = torch.ones_like(negative)
    elif mode == "up":
        toward = negative
    elif mode == "down":
        toward = ~negative
    else:
        toward = torch.zeros_like(negative)
    overflow_value = torch.where(toward, big, torch.full_like(rounded, policy_value))
    inf_value = torch.full_like(rounded, float("inf") if fmt.has_inf else policy_value)
    out = torch.where(rounded > big, overflow_value, rounded)
    out = torch.where(torch.isinf(mag), inf_value, out)
    return torch.where(torch.isnan(mag), mag, out)


@lru_cache(maxsize=None)
def _native_cast_matches(fmt: FloatFormat) -> bool:
    """Whether ``x.to(fmt.torch_dtype)`` implements exactly this format and overflow policy.

    torch's policy for a dtype has changed between releases (float8_e4m3fn overflow gave NaN in
    some and saturates in 2.13), so it is probed, not assumed.
    """
    dtype = fmt.torch_dtype
    if dtype is None:
        return False
    probe = torch.tensor([fmt.max * 4.0, float("inf")], dtype=torch.float32)
    try:
        got = probe.to(dtype).float()
    except (RuntimeError, TypeError):
        return False
    want = _round(probe, fmt, "nearest_even", None, None)
    return bool(torch.equal(torch.isnan(got), torch.isnan(want))
                and torch.equal(torch.nan_to_num(got), torch.nan_to_num(want)))


class _QuantizeSTE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, fmt, mode, generator, rand_bits):  # type: ignore[override]
        return quantize(x, fmt, mode, generator=generator, rand_bits=rand_bits)

    @staticmethod
    def backward(ctx, grad):  # type: ignore[override]
        return grad, None, None, None, None


def quantize_ste(x: torch.Tensor, format: "str | torch.dtype | FloatFormat", mode: str = "nearest_even", *,
                 generator: torch.Generator | None = None, rand_bits: int | None = None) -> torch.Tensor:
    """:func:`quantize` in the forward pass, identity in the backward pass (straight-through
    estimator), for quantization-aware training and fake-quantized activations."""
    return _QuantizeSTE.apply(x, get_format(format), mode, generator, rand_bits)
