"""Number formats: one small immutable description per binary floating-point format.

A :class:`FloatFormat` says how a format encodes numbers (exponent bits, mantissa
bits, bias, subnormals, special values) and what happens on overflow. Everything
else — machine epsilon, the largest finite value, the smallest subnormal — is a
property derived from those fields, so a format can be printed and trusted like
``numpy.finfo``.

Encodings of special values (``special``):

``"ieee"``
    All-ones exponent is reserved: mantissa 0 is ±inf, anything else NaN
    (fp64, fp32, fp16, bf16, fp8 e5m2).
``"finite_nan"``
    No infinities; only all-ones exponent *and* all-ones mantissa is NaN, so the
    top binade holds finite values (fp8 e4m3fn, DLFloat16).
``"fnuz"``
    Finite, NaN, unsigned zero: no infinities, no negative zero, and the code
    ``1000…0`` (what would be -0) is the single NaN (fp8 e4m3fnuz, e5m2fnuz).
``"none"``
    Every code is a finite number (OCP MX fp6 e2m3/e3m2, fp4 e2m1).

Overflow policies (``overflow``): ``"inf"`` (IEEE), ``"nan"`` or ``"saturate"``
(clamp to ±max). Directed roundings toward zero always clamp to ±max, as IEEE 754
requires for round-toward-zero.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal

import torch

Special = Literal["ieee", "finite_nan", "fnuz", "none"]
Overflow = Literal["inf", "nan", "saturate"]

__all__ = ["FloatFormat", "get_format", "register_format", "PRESETS", "custom_format"]


@dataclass(frozen=True)
class FloatFormat:
    """An immutable description of a binary floating-point format.

    Every inconsistency is a ``ValueError`` at construction, so a built format can be trusted.

    Args:
        name: the format's name, as printed and as :func:`register_format` registers it.
        exponent_bits: width of the exponent field, an int in [1, 11].
        mantissa_bits: width of the stored mantissa (without the hidden bit), an int in [0, 52].
        bias: exponent bias; default ``None``: ``2**(exponent_bits-1) - 1``
            (``2**(exponent_bits-1)`` for ``fnuz``). A bias that leaves no normal binade
            (``emax < emin``) is rejected.
        subnormals: whether the format has subnormal numbers (default ``True``); without them the
            smallest positive value is ``min_normal``.
        special: encoding of special values, ``"ieee"`` (default), ``"finite_nan"``, ``"fnuz"`` or
            ``"none"`` (see the module docstring); ``"finite_nan"`` needs a mantissa bit.
        overflow: what rounding beyond ``max`` gives: ``"inf"``, ``"nan"`` or ``"saturate"``;
            default ``None``: what the encoding allows (``inf`` for IEEE, ``nan`` for fnuz,
            ``saturate`` otherwise). A policy the encoding cannot represent is rejected.
        torch_dtype_name: name of the matching ``torch`` dtype attribute (e.g. ``"bfloat16"``), or
            ``None`` (default) for formats torch lacks; a name this torch does not have makes
            :attr:`torch_dtype` ``None``.
        aliases: other names :func:`get_format` finds it by once registered (case-insensitive;
            default: none).
    """

    name: str
    exponent_bits: int
    mantissa_bits: int
    bias: int | None = None
    subnormals: bool = True
    special: Special = "ieee"
    overflow: Overflow | None = None
    torch_dtype_name: str | None = None
    aliases: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.exponent_bits, int) or not 1 <= self.exponent_bits <= 11:
            raise ValueError(f"exponent_bits must be an int in [1, 11], got {self.exponent_bits!r}")
        if not isinstance(self.mantissa_bits, int) or not 0 <= self.mantissa_bits <= 52:
            raise ValueError(f"mantissa_bits must be an int in [0, 52], got {self.mantissa_bits!r}")
        if self.special not in ("ieee", "finite_nan", "fnuz", "none"):
            raise ValueError(f"special must be 'ieee', 'finite_nan', 'fnuz' or 'none', got {self.special!r}")
        if self.bias is None:
            default_bias = 2 ** (self.exponent_bits - 1) - (0 if self.special == "fnuz" else 1)
            object.__setattr__(self, "bias", default_bias)
        if self.overflow is None:
            default = {"ieee": "inf", "fnuz": "nan"}.get(self.special, "saturate")
            object.__setattr__(self, "overflow", default)
        if self.overflow not in ("inf", "nan", "saturate"):
            raise ValueError(f"overflow must be 'inf', 'nan' or 'saturate', got {self.overflow!r}")
        if self.overflow == "inf" and not self.has_inf:
            raise ValueError(f"format {self.name!r} has no infinity, so overflow='inf' is impossible")
        if self.overflow == "nan" and not self.has_nan:
            raise ValueError(f"format {self.name!r} has no NaN, so overflow='nan' is impossible")
        if self.special == "finite_nan" and self.mantissa_bits == 0:
            raise ValueError("special='finite_nan' needs at least one mantissa bit")
        if self.emax < self.emin:
            raise ValueError(f"format {self.name!r} has an empty normal range (emax < emin)")

    # ---- encoding -------------------------------------------------------------
    @property
    def bits(self) -> int:
        """Total width: sign + exponent + mantissa."""
        return 1 + self.exponent_bits + self.mantissa_bits

    @property
    def has_inf(self) -> bool:
        """Whether the format encodes infinities (only ``special="ieee"``)."""
        return self.special == "ieee"

    @property
    def has_nan(self) -> bool:
        """Whether the format encodes NaN (all but ``special="none"``)."""
        return self.special != "none"

    @property
    def has_negative_zero(self) -> bool:
        """Whether ``-0`` is a value of its own (all but ``fnuz``, where that code is NaN)."""
        return self.special != "fnuz"

    @property
    def precision(self) -> int:
        """Significand bits p, the hidden bit included."""
        return self.mantissa_bits + 1

    @property
    def emin(self) -> int:
        """Exponent of the smallest normal number, ``1 - bias``."""
        return 1 - self.bias  # type: ignore[operator]

    @property
    def emax(self) -> int:
        """Exponent of the largest finite number."""
        top = 2**self.exponent_bits - 1
        return (top - 1 if self.special == "ieee" else top) - self.bias  # type: ignore[operator]

    # ---- values -----------------------------------------------------------------
    @property
    def eps(self) -> float:
        """Machine epsilon: the gap between 1 and the next larger number, ``2**-m``."""
        return 2.0**-self.mantissa_bits

    @property
    def unit_roundoff(self) -> float:
        """u = eps/2: the largest relative error of round-to-nearest in the normal range."""
        return 2.0 ** -(self.mantissa_bits + 1)

    @property
    def max(self) -> float:
        """Largest finite value. With ``finite_nan`` the all-ones mantissa of the top binade is NaN."""
        top_mantissa = 2**self.mantissa_bits - (2 if self.special == "finite_nan" else 1)
        return math.ldexp(1.0 + top_mantissa / 2**self.mantissa_bits, self.emax)

    @property
    def min_normal(self) -> float:
        """Smallest positive normal value, ``2**emin``."""
        return math.ldexp(1.0, self.emin)

    @property
    def min_subnormal(self) -> float:
        """Smallest positive value (``min_normal`` when the format has no subnormals)."""
        if not self.subnormals:
            return self.min_normal
        return math.ldexp(1.0, self.emin - self.mantissa_bits)

    @property
    def decimal_digits(self) -> float:
        """Significant decimal digits, ``p * log10(2)`` (fp16: 3.31, bf16: 2.41)."""
        return self.precision * math.log10(2.0)

    @property
    def dynamic_range_log2(self) -> float:
        """log2(max / min_subnormal): binades spanned by the positive finite values."""
        return math.log2(self.max) - math.log2(self.min_subnormal)

    @property
    def torch_dtype(self) -> torch.dtype | None:
        """The torch dtype with exactly this encoding, when torch has one."""
        if self.torch_dtype_name is None:
            return None
        return getattr(torch, self.torch_dtype_name, None)

    def with_overflow(self, overflow: Overflow) -> "FloatFormat":
        """The same encoding with another overflow policy (``"inf"``, ``"nan"``, ``"saturate"``)."""
        return dataclasses.replace(self, overflow=overflow)

    def summary(self) -> dict[str, object]:
        """Every property as a plain dict (for tables, JSON and ``lowp formats``)."""
        return {
            "name": self.name,
            "bits": self.bits,
            "exponent_bits": self.exponent_bits,
            "mantissa_bits": self.mantissa_bits,
            "bias": self.bias,
            "subnormals": self.subnormals,
            "special": self.special,
            "overflow": self.overflow,
            "eps": self.eps,
            "unit_roundoff": self.unit_roundoff,
            "max": self.max,
            "min_normal": self.min_normal,
            "min_subnormal": self.min_subnormal,
            "precision_bits": self.precision,
            "decimal_digits": round(self.decimal_digits, 3),
            "torch_dtype": str(self.torch_dtype).replace("torch.", "") if self.torch_dtype else None,
        }

    def __str__(self) -> str:
        return self.name


def custom_format(exponent_bits: int, mantissa_bits: int, **kwargs: object) -> FloatFormat:
    """An IEEE-style format with the given field widths, e.g. ``custom_format(5, 2)``."""
    name = str(kwargs.pop("name", f"e{exponent_bits}m{mantissa_bits}"))
    return FloatFormat(name, exponent_bits, mantissa_bits, **kwargs)  # type: ignore[arg-type]


_PRESET_LIST = [
    FloatFormat("fp64", 11, 52, torch_dtype_name="float64", aliases=("float64", "double")),
    FloatFormat("fp32", 8, 23, torch_dtype_name="float32", aliases=("float32", "float", "single")),
    FloatFormat("tf32", 8, 10, aliases=("tensorfloat32",)),
    FloatFormat("fp16", 5, 10, torch_dtype_name="float16", aliases=("float16", "half")),
    FloatFormat("bf16", 8, 7, torch_dtype_name="bfloat16", aliases=("bfloat16",)),
    # DLFloat16 (Agrawal et al., ARITH 2019): no subnormals, the all-ones code is the one NaN/inf.
    FloatFormat("dlfloat16", 6, 9, subnormals=False, special="finite_nan", aliases=("dlf16",)),
    FloatFormat("fp8_e4m3fn", 4, 3, special="finite_nan", overflow="saturate",
                torch_dtype_name="float8_e4m3fn", aliases=("e4m3", "e4m3fn", "float8_e4m3fn")),
    FloatFormat("fp8_e5m2", 5, 2, torch_dtype_name="float8_e5m2", aliases=("e5m2", "float8_e5m2")),
    FloatFormat("fp8_e4m3fnuz", 4, 3, special="fnuz",
                torch_dtype_name="float8_e4m3fnuz", aliases=("e4m3fnuz", "float8_e4m3fnuz")),
    FloatFormat("fp8_e5m2fnuz", 5, 2, special="fnuz",
                torch_dtype_name="float8_e5m2fnuz", aliases=("e5m2fnuz", "float8_e5m2fnuz")),
    FloatFormat("fp6_e2m3", 2, 3, special="none", aliases=("e2m3", "float6_e2m3fn")),
    FloatFormat("fp6_e3m2", 3, 2, special="none", aliases=("e3m2", "float6_e3m2fn")),
    FloatFormat("fp4_e2m1", 2, 1, special="none", aliases=("e2m1", "float4_e2m1fn")),
]

PRESETS: dict[str, FloatFormat] = {f.name: f for f in _PRESET_LIST}
_LOOKUP: dict[str, FloatFormat] = {}


def register_format(fmt: FloatFormat) -> FloatFormat:
    """Make ``fmt`` findable by :func:`get_format` under its name and aliases."""
    for key in (fmt.name, *fmt.aliases):
        _LOOKUP[key.lower()] = fmt
    return fmt


for _fmt in _PRESET_LIST:
    register_format(_fmt)


def get_format(spec: "str | torch.dtype | FloatFormat") -> FloatFormat:
    """Look a format up by name (``"bf16"``, ``"fp8_e4m3fn"``, ``"e5m2"``, ``"e3m4"`` for a custom
    IEEE-style pair), by torch floating dtype, or pass a :class:`FloatFormat` through."""
    if isinstance(spec, FloatFormat):
        return spec
    if isinstance(spec, torch.dtype):
        for fmt in _PRESET_LIST:
            if fmt.torch_dtype == spec:
                return fmt
        raise ValueError(f"format: torch dtype {spec} is not a floating-point format lowp knows")
    if isinstance(spec, str):
        key = spec.lower().strip()
        if key in _LOOKUP:
            return _LOOKUP[key]
        parsed = _parse_em(key)
        if parsed is not None:
            return custom_format(*parsed)
        known = ", ".join(sorted(PRESETS))
        raise ValueError(f"format: unknown format name {spec!r}; known: {known}, or 'eXmY' for a custom format")
    raise TypeError(f"format: expected a name, a torch.dtype or a FloatFormat, got {type(spec).__name__}")


def _parse_em(key: str) -> tuple[int, int] | None:
    """'e3m4' or 'fp8_e3m4' -> (3, 4)."""
    key = key.split("_")[-1]
    if not key.startswith("e") or "m" not in key:
        return None
    e_text, _, m_text = key[1:].partition("m")
    if not (e_text.isdigit() and m_text.isdigit()):
        return None
    return int(e_text), int(m_text)
