"""Block formats: a description (:class:`BlockFormat`), the presets, and quantization to them.

A block format stores a tensor as elements of a narrow float format plus one scale per block of
``block_rows x block_size`` consecutive elements (1D blocks along the last dimension when
``block_rows == 1``; 2D tiles over the last two dimensions otherwise), optionally times one fp32
per-tensor scale ``t``. A block decodes as ``x_i ~ e_i * S * t``.

Quantization, for each block (formulas of the scale roundings in :mod:`lowp.blocks.scales`):

1. ``amax = max_i |x_i|``; a block holding NaN or ±inf gets a NaN scale and zero elements, so
   the whole block decodes to NaN (``nonfinite="nan"``, the OCP MX rule for a NaN scale), or
   the call raises (``nonfinite="raise"``).
2. ``S`` from ``amax`` by the format's scale rounding, clamped up to the scale format's smallest
   positive value; a scale above its largest value raises ``ValueError`` naming ``x``.
3. ``e_i = round(x_i / (S t))`` in the element format, to nearest-even or stochastically, with
   the element format's overflow policy (``saturate``: clamp to ±max as the OCP MX spec asks;
   ``nan`` / ``inf`` where the element format has those codes). Power-of-two scales divide exactly
   in fp32; other scales divide in fp64, where the quotient's rounding error cannot move it across
   a rounding boundary of the element format (see :mod:`lowp.blocks.scales`). An element format
   with at most :data:`MIDPOINT_VALUES` nonnegative values (fp4 e2m1: NVFP4), rounded to nearest
   with saturation, divides nothing: ``e_i`` counts the midpoints ``m_k`` between neighbouring
   values that ``|x_i|`` reaches, ``|x_i| >= m_k S t`` where the tie goes up to the even code and
   ``|x_i| > m_k S t`` where it stays, each compare made exactly in fp32 against ``m_k S t``
   (exact in fp64) rounded up, respectively down, to fp32 (:func:`_round_by_midpoints`).

Stochastic rounding with ``random_bits = r`` adds an ``r``-bit uniform random integer at the top of
the discarded bits and truncates, so it rounds up with probability ``floor(f * 2**r) / 2**r``
where ``f`` in [0, 1) is the discarded fraction (:func:`lowp.rounding.quantize`); the default
(``None``) uses every discarded bit, which is exact and unbiased.

OCP Microscaling Formats (MX) v1.0 specification, Open Compute Project, 2023, sections 5 and 6.3.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch

from lowp.blocks.hadamard import _check_size, inverse_random_hadamard, random_hadamard
from lowp.blocks.scales import SCALE_ROUNDINGS, ScaleFormat, block_scales, get_scale_format
from lowp.codec import all_values, encode
from lowp.formats import FloatFormat, get_format
from lowp.rounding import check_float_tensor, fits_in, quantize

__all__ = ["BlockFormat", "BlockQuantized", "BLOCK_PRESETS", "register_block_format", "get_block_format",
           "quantize_blocks", "dequantize_blocks", "fake_quantize"]

_INPUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

#: element formats with at most this many nonnegative values round by counting midpoints
#: (:func:`_round_by_midpoints`) when rounded to nearest with saturation under a non-power-of-two scale
MIDPOINT_VALUES = 16


@dataclass(frozen=True)
class BlockFormat:
    """An immutable description of a block (microscaling) format; every field is checked at construction.

    Args:
        name: the name :func:`get_block_format` finds it by once registered.
        element: element format (a :class:`~lowp.formats.FloatFormat` or a name such as ``"fp4_e2m1"``);
            it must fit in fp32 (at most 23 mantissa bits and fp32's exponent range).
        block_size: elements per block along the last dimension (OCP MX: 32, NVFP4: 16).
        block_rows: rows per block over the second-to-last dimension; 1 for 1D blocks, e.g. 16 for
            NVFP4's 16x16 weight tiles.
        scale_format: ``"e8m0"``, ``"e4m3"``, ``"bf16"``, ``"fp32"`` or a :class:`ScaleFormat`.
        scale_rounding: ``"floor"`` (OCP MX), ``"ceil"``, ``"rceil"`` or ``"even"``.
        tensor_scale: whether a second-level fp32 per-tensor scale divides the block maxima (NVFP4);
            only with a non-power-of-two scale format.
        overflow: what an element beyond the element format's max becomes: ``"saturate"`` (±max, the
            OCP MX rule), ``"nan"`` or ``"inf"`` where the element format has such codes.
        hadamard: 0 for none, or the size ``n`` (a power of two) of a random Hadamard transform applied
            along the last dimension before quantizing (and inverted after dequantizing).
        aliases: other names for the registry.
    """

    name: str
    element: FloatFormat
    block_size: int = 32
    block_rows: int = 1
    scale_format: ScaleFormat = dataclasses.field(default_factory=lambda: get_scale_format("e8m0"))
    scale_rounding: str = "floor"
    tensor_scale: bool = False
    overflow: str = "saturate"
    hadamard: int = 0
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.element, FloatFormat):
            try:
                object.__setattr__(self, "element", get_format(self.element))
            except (ValueError, TypeError) as exc:
                raise ValueError(f"element: {exc}") from None
        if not fits_in(self.element, get_format("fp32")):
            raise ValueError(f"element: {self.element.name} does not fit in fp32; block elements must")
        for field in ("block_size", "block_rows"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{field}: expected a positive int, got {value!r}")
        object.__setattr__(self, "scale_format", get_scale_format(self.scale_format))
        if self.scale_rounding not in SCALE_ROUNDINGS:
            raise ValueError(f"scale_rounding: expected one of {', '.join(SCALE_ROUNDINGS)}, "
                             f"got {self.scale_rounding!r}")
        if not isinstance(self.tensor_scale, bool):
            raise ValueError(f"tensor_scale: expected a bool, got {self.tensor_scale!r}")
        if self.tensor_scale and self.scale_format.power_of_two:
            raise ValueError("tensor_scale: a per-tensor scale needs a non-power-of-two scale format "
                             "(e4m3, bf16, fp32); e8m0 scales already span 2**-127..2**127")
        sf = self.scale_format.float_format
        if sf is not None and (self.element.precision + 1) + sf.precision + 24 * self.tensor_scale > 50:
            extra = " with a per-tensor scale" if self.tensor_scale else ""
            raise ValueError(f"scale_format: {self.scale_format.name} scales{extra} have too many significand bits "
                             f"for exact {self.element.name} rounding in fp64 "
                             f"(element precision + 1 + scale precision + 24 for a tensor scale must be <= 50)")
        if self.overflow not in ("saturate", "nan", "inf"):
            raise ValueError(f"overflow: expected 'saturate', 'nan' or 'inf', got {self.overflow!r}")
        try:
            self.element.with_overflow(self.overflow)  # type: ignore[arg-type]
        except ValueError as exc:
            raise ValueError(f"overflow: {exc}") from None
        if self.hadamard:
            try:
                _check_size(self.hadamard)
            except ValueError as exc:
                raise ValueError(f"hadamard: {exc}") from None

    @property
    def elements_per_block(self) -> int:
        """``block_rows * block_size``."""
        return self.block_rows * self.block_size

    @property
    def element_format(self) -> FloatFormat:
        """The element format with this block format's overflow policy."""
        return self.element.with_overflow(self.overflow)  # type: ignore[arg-type]

    @property
    def bits_per_element(self) -> float:
        """Storage per element, the block scale included (the one per-tensor scale is not)."""
        return self.element.bits + self.scale_format.bits / self.elements_per_block

    def replace(self, **changes: object) -> "BlockFormat":
        """A copy with some fields changed, e.g. ``fmt.replace(scale_rounding="rceil")``."""
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def summary(self) -> dict[str, object]:
        """The table row of ``lowp formats``."""
        block = f"{self.block_rows}x{self.block_size}" if self.block_rows > 1 else str(self.block_size)
        return {"preset": self.name, "element": self.element.name, "block": block,
                "scale_format": self.scale_format.name + (" x fp32 tensor" if self.tensor_scale else ""),
                "scale_rounding": self.scale_rounding, "overflow": self.overflow,
                "bits_per_element": round(self.bits_per_element, 4)}

    def __str__(self) -> str:
        return self.name


_PRESET_LIST = [
    BlockFormat("mxfp8_e4m3", get_format("fp8_e4m3fn"), aliases=("mxfp8",)),
    BlockFormat("mxfp8_e5m2", get_format("fp8_e5m2")),
    BlockFormat("mxfp6_e2m3", get_format("fp6_e2m3"), aliases=("mxfp6",)),
    BlockFormat("mxfp6_e3m2", get_format("fp6_e3m2")),
    BlockFormat("mxfp4", get_format("fp4_e2m1"), aliases=("mxfp4_e2m1",)),
    BlockFormat("nvfp4", get_format("fp4_e2m1"), block_size=16, scale_format=get_scale_format("e4m3"),
                scale_rounding="even", tensor_scale=True),
    BlockFormat("nvfp4_2d", get_format("fp4_e2m1"), block_size=16, block_rows=16,
                scale_format=get_scale_format("e4m3"), scale_rounding="even", tensor_scale=True),
]
BLOCK_PRESETS: dict[str, BlockFormat] = {f.name: f for f in _PRESET_LIST}
_LOOKUP: dict[str, BlockFormat] = {}


def register_block_format(fmt: BlockFormat) -> BlockFormat:
    """Make ``fmt`` findable by :func:`get_block_format` under its name and aliases."""
    if not isinstance(fmt, BlockFormat):
        raise TypeError(f"fmt: expected a BlockFormat, got {type(fmt).__name__}")
    for key in (fmt.name, *fmt.aliases):
        _LOOKUP[key.lower()] = fmt
    return fmt


for _fmt in _PRESET_LIST:
    register_block_format(_fmt)


def get_block_format(spec: "str | BlockFormat") -> BlockFormat:
    """A block format by name (``"mxfp8_e4m3"``, ``"nvfp4"``, ...) or a :class:`BlockFormat` passed through."""
    if isinstance(spec, BlockFormat):
        return spec
    if isinstance(spec, str):
        key = spec.lower().strip()
        if key in _LOOKUP:
            return _LOOKUP[key]
        raise ValueError(f"fmt: unknown block format {spec!r}; known: {', '.join(sorted(_LOOKUP))}")
    raise TypeError(f"fmt: expected a block format name or a BlockFormat, got {type(spec).__name__}")


class BlockQuantized(NamedTuple):
    """What :func:`quantize_blocks` returns.

    Args:
        elements: element values, float32, shaped like ``x`` (0 in a NaN block).
        scales: block scales, float32 (every e8m0 and e4m3 value is exact in it), shaped
            ``x.shape[:-1] + (C/b,)`` for 1D blocks and ``x.shape[:-2] + (R/r, C/b)`` for 2D tiles;
            NaN for a block that held NaN or inf.
        tensor_scale: the per-tensor scale, or None for a format without one.
        fmt: the :class:`BlockFormat`.
        hadamard_seed: the seed of the Hadamard pre-transform, or None without one.
    """
    elements: torch.Tensor
    scales: torch.Tensor
    tensor_scale: float | None
    fmt: BlockFormat
    hadamard_seed: int | None

    def dequantize(self, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """:func:`dequantize_blocks` of this result."""
        return dequantize_blocks(self.elements, self.scales, self.fmt, tensor_scale=self.tensor_scale,
                                 hadamard_seed=self.hadamard_seed, dtype=dtype)


def _to_blocks(x: torch.Tensor, fmt: BlockFormat) -> torch.Tensor:
    """``x`` as (..., blocks along rows, blocks along columns, elements per block)."""
    b, r = fmt.block_size, fmt.block_rows
    if r == 1:
        return x.reshape(*x.shape[:-1], x.shape[-1] // b, b)
    rows, cols = x.shape[-2], x.shape[-1]
    t = x.reshape(*x.shape[:-2], rows // r, r, cols // b, b).transpose(-3, -2)
    return t.reshape(*t.shape[:-2], r * b)


def _from_blocks(blocks: torch.Tensor, shape: torch.Size, fmt: BlockFormat) -> torch.Tensor:
    b, r = fmt.block_size, fmt.block_rows
    if r == 1:
        return blocks.reshape(shape)
    t = blocks.reshape(*blocks.shape[:-1], r, b).transpose(-3, -2)
    return t.reshape(shape)


def _check_shape(x: torch.Tensor, fmt: BlockFormat) -> None:
    if x.dim() == 0 or x.shape[-1] % fmt.block_size:
        last = x.shape[-1] if x.dim() else "none (a 0-d tensor)"
        raise ValueError(f"block_size: {fmt.block_size} ({fmt.name}) must divide x's last dimension, got {last}")
    if fmt.block_rows > 1 and (x.dim() < 2 or x.shape[-2] % fmt.block_rows):
        rows = x.shape[-2] if x.dim() >= 2 else "none (a 1-d tensor)"
        raise ValueError(f"block_rows: {fmt.block_rows} ({fmt.name}) must divide x's second-to-last dimension, "
                         f"got {rows}")


def _element_mode(rounding: str) -> str:
    modes = {"nearest": "nearest_even", "nearest_even": "nearest_even", "rne": "nearest_even",
             "stochastic": "stochastic", "sr": "stochastic"}
    if rounding not in modes:
        raise ValueError(f"rounding: expected 'nearest' or 'stochastic', got {rounding!r}")
    return modes[rounding]


def _tensor_scale(amax: torch.Tensor, fmt: BlockFormat, given: "float | torch.Tensor | None") -> float:
    if given is not None:
        value = float(given)
        if not (math.isfinite(value) and value > 0):
            raise ValueError(f"tensor_scale: expected a positive finite number, got {value}")
        return value
    finite = amax[torch.isfinite(amax)]
    top = float(finite.max()) if finite.numel() else 0.0
    if top == 0.0:
        return 1.0
    # rounded up to fp32, so that every block's amax / (elem_max * t) <= scale max
    t = quantize(torch.tensor(top / (fmt.element.max * fmt.scale_format.max), dtype=torch.float64), "fp32", "up")
    return float(t)


def quantize_blocks(x: torch.Tensor, fmt: "str | BlockFormat", rounding: str = "nearest", *,
                    random_bits: int | None = None, generator: torch.Generator | None = None,
                    tensor_scale: "float | torch.Tensor | None" = None, hadamard_seed: int | None = 0,
                    nonfinite: str = "nan") -> BlockQuantized:
    """Quantize ``x`` to the block format ``fmt`` (algorithm in the module docstring).

    Args:
        x: float32, bfloat16 or float16 tensor whose last dimension (and, for 2D tiles, second-to-last)
            the block divides.
        fmt: a :class:`BlockFormat` or a preset name (``"mxfp8_e4m3"``, ``"mxfp4"``, ``"nvfp4"`` ...).
        rounding: element rounding, ``"nearest"`` (nearest-even) or ``"stochastic"``.
        random_bits: random bits per stochastic decision, an int in [1, 24] (default: all discarded bits).
        generator: random source for stochastic rounding.
        tensor_scale: the per-tensor scale of a format that has one (default: the tensor's finite amax
            over ``element.max * scale_format.max``, rounded up to fp32; 1 for an all-zero tensor).
        hadamard_seed: seed of the random sign diagonal when ``fmt.hadamard`` is set (None: no signs).
        nonfinite: ``"nan"`` (a block holding NaN or inf gets a NaN scale) or ``"raise"`` (ValueError).
    """
    fmt = get_block_format(fmt)
    check_float_tensor(x, "x")
    if x.dtype not in _INPUT_DTYPES:
        raise TypeError(f"x: expected float32, bfloat16 or float16, got {x.dtype} (the exactness of the scale "
                        f"divisions needs at most 24 significand bits)")
    mode = _element_mode(rounding)
    if random_bits is not None:
        if mode != "stochastic":
            raise ValueError("random_bits: only meaningful with rounding='stochastic'")
        if isinstance(random_bits, bool) or not isinstance(random_bits, int) or not 1 <= random_bits <= 24:
            raise ValueError(f"random_bits: expected an int in [1, 24], got {random_bits!r}")
    if nonfinite not in ("nan", "raise"):
        raise ValueError(f"nonfinite: expected 'nan' or 'raise', got {nonfinite!r}")
    if tensor_scale is not None and not fmt.tensor_scale:
        raise ValueError(f"tensor_scale: {fmt.name} has no per-tensor scale")
    _check_shape(x, fmt)
    xf = x.float()
    if fmt.hadamard:
        xf = random_hadamard(xf, fmt.hadamard, hadamard_seed)
    blocks = _to_blocks(xf, fmt)
    amax = blocks.abs().amax(-1)
    finite = torch.isfinite(amax)
    all_finite = bool(finite.all())
    if not all_finite and nonfinite == "raise":
        where = tuple(int(i) for i in (~finite).nonzero()[0])
        raise ValueError(f"x: block {where} holds NaN or inf (pass nonfinite='nan' for NaN-scaled blocks)")
    amax64 = torch.where(finite, amax, 0.0).double()
    t = _tensor_scale(amax64, fmt, tensor_scale) if fmt.tensor_scale else 1.0
    scales = block_scales(amax64, fmt.element, fmt.scale_format, fmt.scale_rounding, t)
    efmt = fmt.element_format
    if fmt.scale_format.power_of_two:
        inverse = (1.0 / scales).float().unsqueeze(-1)   # 2**-k, exact in fp32 for |k| <= 127
        elements = quantize(blocks * inverse, efmt, mode, generator=generator, rand_bits=random_bits)
    elif mode == "nearest_even" and _midpoints(efmt) is not None:
        elements = _round_by_midpoints(blocks, scales * t, efmt)
    else:
        scaled = blocks.double() / (scales * t).unsqueeze(-1)
        elements = quantize(scaled, efmt, mode, generator=generator, rand_bits=random_bits).float()
    scales32 = scales.float()
    if not all_finite:
        elements = elements.masked_fill(~finite.unsqueeze(-1), 0.0)
        scales32 = scales32.masked_fill(~finite, math.nan)
    return BlockQuantized(_from_blocks(elements, xf.shape, fmt), scales32, t if fmt.tensor_scale else None, fmt,
                          hadamard_seed if fmt.hadamard else None)


@functools.lru_cache(maxsize=None)
def _midpoints(efmt: FloatFormat) -> tuple[tuple[float, ...], tuple[bool, ...], tuple[float, ...]] | None:
    """For an element format :func:`_round_by_midpoints` takes (subnormals, saturation, at most
    :data:`MIDPOINT_VALUES` nonnegative values ``v_0 = 0 < v_1 < ...``): the midpoints ``m_k =
    (v_k + v_(k+1)) / 2``, whether a tie at ``m_k`` rounds up (``v_(k+1)``'s code is even), and the
    values; None for any other format."""
    if efmt.overflow != "saturate" or not efmt.subnormals:
        return None
    values = all_values(efmt)
    values = values[values >= 0]
    if values.numel() > MIDPOINT_VALUES:
        return None
    codes = encode(values, efmt)
    mids = tuple(float(m) for m in (values[:-1] + values[1:]) / 2)   # exact: neighbours differ by one ulp
    return mids, tuple(bool(c % 2 == 0) for c in codes[1:].tolist()), tuple(values.tolist())


def _round_by_midpoints(blocks: torch.Tensor, divisors: torch.Tensor, efmt: FloatFormat) -> torch.Tensor:
    """``blocks / divisors`` (fp32 blocks over their last dimension; fp64 divisors ``S t``, one per
    block) rounded to nearest-even in ``efmt`` and saturated, as fp32, without dividing: the count of
    midpoints reached picks the value (module docstring). ``m_k * d`` is exact in fp64 (at most
    ``p + 1`` significand bits times a scale's and a tensor scale's, <= 50 bits by
    :class:`BlockFormat`'s check), and for fp32 ``a``, ``a >= m`` exactly when ``a >= up32(m)`` and
    ``a > m`` exactly when ``a > down32(m)``. NaN and inf blocks give garbage the caller masks."""
    mids, tie_up, values = _midpoints(efmt)  # type: ignore[misc]
    magnitude = blocks.abs()
    count = torch.zeros(blocks.shape, dtype=torch.uint8, device=blocks.device)
    up, down = torch.tensor(math.inf), torch.tensor(-math.inf)
    for m, tie in zip(mids, tie_up):
        exact = divisors * m
        nearest = exact.float()
        if tie:   # |x| >= m d: against m d rounded up to fp32
            bound = torch.where(nearest.double() < exact, torch.nextafter(nearest, up), nearest)
            count += magnitude >= bound.unsqueeze(-1)
        else:     # |x| > m d: against m d rounded down to fp32
            bound = torch.where(nearest.double() > exact, torch.nextafter(nearest, down), nearest)
            count += magnitude > bound.unsqueeze(-1)
    table = torch.tensor(values, dtype=torch.float32, device=blocks.device)
    return torch.copysign(table[count.long()], blocks)


def dequantize_blocks(elements: torch.Tensor, scales: torch.Tensor, fmt: "str | BlockFormat", *,
                      tensor_scale: float | None = None, hadamard_seed: int | None = 0,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``elements * scale * tensor_scale`` per block, computed in fp64 (exact for every preset: at
    most 4 + 24 + 8 significand bits) and rounded once to ``dtype``; then the inverse Hadamard
    transform when ``fmt.hadamard`` is set (in fp32 if ``dtype`` is narrower). NaN scales give NaN blocks."""
    fmt = get_block_format(fmt)
    check_float_tensor(elements, "elements")
    check_float_tensor(scales, "scales")
    _check_shape(elements, fmt)
    blocks = _to_blocks(elements, fmt)
    if tuple(scales.shape) != tuple(blocks.shape[:-1]):
        raise ValueError(f"scales: expected shape {tuple(blocks.shape[:-1])} for elements of shape "
                         f"{tuple(elements.shape)}, got {tuple(scales.shape)}")
    if fmt.tensor_scale and tensor_scale is None:
        raise ValueError(f"tensor_scale: {fmt.name} needs the per-tensor scale quantize_blocks returned")
    t = float(tensor_scale) if tensor_scale is not None else 1.0
    values = blocks.double() * (scales.double() * t).unsqueeze(-1)
    out = _from_blocks(values, elements.shape, fmt)
    if fmt.hadamard:
        work = dtype if dtype in (torch.float32, torch.float64) else torch.float32
        return inverse_random_hadamard(out.to(work), fmt.hadamard, hadamard_seed).to(dtype)
    return out.to(dtype)


def fake_quantize(x: torch.Tensor, fmt: "str | BlockFormat", rounding: str = "nearest", *,
                  random_bits: int | None = None, generator: torch.Generator | None = None,
                  tensor_scale: "float | torch.Tensor | None" = None, hadamard_seed: int | None = 0,
                  nonfinite: str = "nan") -> torch.Tensor:
    """``x`` quantized to ``fmt`` and decoded again, in ``x``'s dtype (arguments of :func:`quantize_blocks`)."""
    q = quantize_blocks(x, fmt, rounding, random_bits=random_bits, generator=generator, tensor_scale=tensor_scale,
                        hadamard_seed=hadamard_seed, nonfinite=nonfinite)
    return q.dequantize(x.dtype)
