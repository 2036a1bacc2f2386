"""The native CPU codec of block-scaled states: :func:`lowp.optim.codes.encode` and
:func:`~lowp.optim.codes.decode` in C++ (``native/codes.h``, ``native/codes.cpp``), bit for bit.

The torch functions of :mod:`lowp.optim.codes` are the definition; this module runs the same
formulas over many tensors in one call, vectorised with AVX2 on torch's OpenMP threads
(``torch.get_num_threads()``), and draws the random bits of stochastic rounding itself
(:class:`CountedBits`: ``random16(first + j, key)`` for element ``j``, as
:mod:`lowp.optim.randomness` defines them) instead of reading a tensor of them. The grid's
numbers come from the :class:`~lowp.optim.codes.Code`; decoding fp8 codes reads a table of
torch's own fp8-to-fp32 casts, so NaN and infinity codes decode as torch decodes them.

Every tensor is checked before the C++ call (:func:`encode_many`, :func:`decode_many`): a dense
contiguous CPU tensor of the expected dtype and element count, aligned and inside its storage,
and the written tensors share no bytes with any other; anything else is a ``ValueError`` naming
the argument, raised before anything is written. :data:`COUNTS` counts the elements coded here.
"""
from __future__ import annotations

import ctypes
from dataclasses import dataclass
from typing import Sequence, Union

import torch

from lowp.optim.codes import CODES, SCALE_DTYPES, Code, check_block, codes_shape, scales_shape
from lowp.optim.kernels.checks import Span, kernel_memory, overlapping
from lowp.optim.kernels.native.source import codec_source
from lowp.optim.kernels.native.build import decode_function, encode_function, native_available

__all__ = ["CountedBits", "Noise", "Encoding", "Decoding", "CodecCounts", "COUNTS", "available", "scale_code",
           "grid_numbers", "encode_many", "decode_many", "encode", "decode"]

#: scale dtype -> its ScaleType in native/simd.h
_SCALES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class CountedBits:
    """The random bits of stochastic rounding drawn by the codec: element ``j`` of a tensor rounds
    with ``random16(first + j, key)`` (:func:`lowp.optim.randomness.random16_int`).

    Args:
        first: the global index of the tensor's element 0 in its parameter, ``0 <= first < 2**63``.
        key: the stream key (:func:`lowp.optim.randomness.stream_key`), ``0 <= key < 2**32``.
    """

    first: int
    key: int


#: How an encode rounds: ``None`` to nearest, :class:`CountedBits`, or an int32 tensor of 16-bit draws.
Noise = Union[CountedBits, torch.Tensor, None]


@dataclass(frozen=True)
class Encoding:
    """One tensor to encode (:func:`encode_many`).

    Args:
        values: the fp32 values, contiguous, any shape (taken row-major).
        codes: where the codes go (``code.storage``; ``ceil(n / 2)`` bytes for 4-bit codes).
        scales: where the block scales go (one of :data:`~lowp.optim.codes.SCALE_DTYPES`).
        noise: the rounding (:data:`Noise`); a tensor holds one int32 per value.
    """

    values: torch.Tensor
    codes: torch.Tensor
    scales: torch.Tensor
    noise: Noise


@dataclass(frozen=True)
class Decoding:
    """One tensor to decode (:func:`decode_many`).

    Args:
        codes: the codes.
        scales: their block scales.
        out: the fp32 output, contiguous; its element count is the number of coded values.
    """

    codes: torch.Tensor
    scales: torch.Tensor
    out: torch.Tensor


@dataclass
class CodecCounts:
    """Elements encoded and decoded by the native codec since the last reset (assign 0 to reset).

    Args:
        encoded: elements encoded (default 0).
        decoded: elements decoded (default 0).
    """

    encoded: int = 0
    decoded: int = 0


#: What the native codec has done in this process (a test can see that it ran).
COUNTS = CodecCounts()


def available() -> bool:
    """Whether the native codec runs here (the native kernel's requirements: x86-64 with AVX2 and
    a C++ compiler)."""
    return native_available()


def load() -> None:
    """Build (or take from the cache) and load the codec's library now: a step whose block-scaled
    states are decoded outside its kernel would otherwise load it on first use, while it writes
    (:func:`lowp.optim.coded.load_codec`)."""
    decode_function(codec_source())
    encode_function(codec_source())


def scale_code(dtype: torch.dtype) -> int:
    """The ``ScaleType`` of ``native/simd.h`` of a scale dtype."""
    return _SCALES[dtype]


def grid_numbers(code: Code) -> tuple[float, float, float, float]:
    """What ``native/codes.h``'s ``Grid`` reads of ``code``: signed, Q, m, emin."""
    return float(code.signed), code.top, float(code.mantissa_bits), float(code.min_exponent)


def _grid(code: Code) -> ctypes.Array:
    return (ctypes.c_double * 4)(*grid_numbers(code))


def _check(name: str, t: object, dtypes: Sequence[torch.dtype], numel: int, spans: list[Span], written: bool) -> None:
    """``ValueError`` unless ``t`` is kernel memory on the CPU of one of ``dtypes`` with ``numel``
    elements; its byte range goes to ``spans``."""
    if not (isinstance(t, torch.Tensor) and t.is_cpu and kernel_memory(t, dtypes) and t.numel() == numel):
        got = (f"a {type(t).__name__} of {t.dtype}, shape {tuple(t.shape)} on {t.device}"
               f"{'' if t.is_contiguous() else ', not contiguous'}" if isinstance(t, torch.Tensor) else repr(t))
        raise ValueError(f"{name}: expected a contiguous CPU tensor of {' or '.join(map(str, dtypes))} with {numel} "
                         f"elements (plain, aligned, inside its storage), got {got}")
    start = t.data_ptr()
    spans.append((start, start + t.numel() * t.element_size(), written))


def _check_block(code: object, block: object) -> None:
    if not isinstance(code, Code) or code not in CODES.values():   # the kernels know the kinds of CODES only
        raise ValueError(f"code: expected one of lowp.optim.codes.CODES ({', '.join(c.name for c in CODES.values())}), "
                         f"got {code!r}")
    check_block(block)


def _check_codes(where: str, codes: torch.Tensor, scales: object, code: Code, block: int, n: int,
                 spans: list[Span], written: bool) -> None:
    _check(f"{where}codes", codes, (code.storage,), codes_shape(code, torch.Size([n]))[0], spans, written)
    _check(f"{where}scales", scales, SCALE_DTYPES, scales_shape(n, block)[0], spans, written)


def _pointers(rows: list[list[int | None]]) -> ctypes.Array:
    """``rows[role][tensor]`` as one ``void *`` table, role-major."""
    flat = [p for row in rows for p in row]
    return (ctypes.c_void_p * len(flat))(*flat)


def encode_many(jobs: Sequence[Encoding], code: Code, block: int) -> None:
    """Encode every job with ``code`` in blocks of ``block`` (:func:`lowp.optim.codes.encode`, bit for
    bit): one C++ call per kind of rounding and scale dtype among the jobs. Every tensor is checked
    first (see the module docstring); ``RuntimeError`` when the native codec is not available."""
    _check_block(code, block)
    spans: list[Span] = []
    for k, job in enumerate(jobs):
        where = f"jobs[{k}]."
        if not isinstance(job, Encoding):
            raise ValueError(f"jobs[{k}]: expected an Encoding, got {type(job).__name__}")
        n = job.values.numel() if isinstance(job.values, torch.Tensor) else 0
        _check(f"{where}values", job.values, (torch.float32,), max(n, 1), spans, False)
        _check_codes(where, job.codes, job.scales, code, block, n, spans, True)
        if isinstance(job.noise, torch.Tensor):
            _check(f"{where}noise", job.noise, (torch.int32,), n, spans, False)
        elif isinstance(job.noise, CountedBits):
            if not (0 <= job.noise.first and job.noise.first + n <= 1 << 63 and 0 <= job.noise.key < 1 << 32):
                raise ValueError(f"{where}noise: expected 0 <= first, first + {n} <= 2**63 and 0 <= key < 2**32, "
                                 f"got {job.noise}")
        elif job.noise is not None:
            raise ValueError(f"{where}noise: expected None, CountedBits or an int32 tensor, got {job.noise!r}")
    if overlapping(spans):
        raise ValueError("jobs: the codes or scales share memory with another tensor of the call")
    groups: dict[tuple[int, torch.dtype], list[Encoding]] = {}
    for job in jobs:
        mode = 1 if isinstance(job.noise, CountedBits) else 2 if isinstance(job.noise, torch.Tensor) else 0
        groups.setdefault((mode, job.scales.dtype), []).append(job)
    for (mode, scale_dtype), members in groups.items():
        counted = [j.noise if isinstance(j.noise, CountedBits) else CountedBits(0, 0) for j in members]
        table = _pointers([[j.values.data_ptr() for j in members], [j.codes.data_ptr() for j in members],
                           [j.scales.data_ptr() for j in members],
                           [j.noise.data_ptr() if isinstance(j.noise, torch.Tensor) else None for j in members]])
        n = len(members)
        numel = (ctypes.c_int64 * n)(*(j.values.numel() for j in members))
        firsts = (ctypes.c_uint64 * n)(*(c.first for c in counted))
        keys = (ctypes.c_uint32 * n)(*(c.key for c in counted))
        done = encode_function(codec_source())(n, table, numel, firsts, keys, code.kind, scale_code(scale_dtype),
                                               block, _grid(code), mode, torch.get_num_threads())
        if done != 0:
            raise RuntimeError(f"the native codec refused code {code.name}, block {block}")
        COUNTS.encoded += sum(numel)


def decode_many(jobs: Sequence[Decoding], code: Code, block: int) -> None:
    """Decode every job (:func:`lowp.optim.codes.decode`, bit for bit) into its ``out``: one C++
    call per scale dtype among the jobs. Every tensor is checked first (see the module docstring);
    ``RuntimeError`` when the native codec is not available."""
    _check_block(code, block)
    spans: list[Span] = []
    for k, job in enumerate(jobs):
        if not isinstance(job, Decoding):
            raise ValueError(f"jobs[{k}]: expected a Decoding, got {type(job).__name__}")
        n = job.out.numel() if isinstance(job.out, torch.Tensor) else 0
        _check(f"jobs[{k}].out", job.out, (torch.float32,), max(n, 1), spans, True)
        _check_codes(f"jobs[{k}].", job.codes, job.scales, code, block, n, spans, False)
    if overlapping(spans):
        raise ValueError("jobs: an output shares memory with another tensor of the call")
    groups: dict[torch.dtype, list[Decoding]] = {}
    for job in jobs:
        groups.setdefault(job.scales.dtype, []).append(job)
    for scale_dtype, members in groups.items():
        n = len(members)
        table = _pointers([[j.codes.data_ptr() for j in members], [j.scales.data_ptr() for j in members],
                           [j.out.data_ptr() for j in members]])
        numel = (ctypes.c_int64 * n)(*(j.out.numel() for j in members))
        done = decode_function(codec_source())(n, table, numel, code.kind, scale_code(scale_dtype), block,
                                               torch.get_num_threads())
        if done != 0:
            raise RuntimeError(f"the native codec refused code {code.name}, block {block}")
        COUNTS.decoded += sum(numel)


def encode(x: torch.Tensor, code: Code, block: int, codes: torch.Tensor, scales: torch.Tensor, noise: Noise) -> None:
    """:func:`lowp.optim.codes.encode` of one contiguous fp32 tensor (``noise`` may also be
    :class:`CountedBits`)."""
    encode_many([Encoding(x, codes, scales, noise)], code, block)


def decode(codes: torch.Tensor, scales: torch.Tensor, code: Code, block: int, numel: int,
           out: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`lowp.optim.codes.decode` (flat fp32 values, into ``out`` when given)."""
    if not isinstance(numel, int) or numel < 1:
        raise ValueError(f"numel: expected a positive int, got {numel!r}")
    result = torch.empty(numel, dtype=torch.float32) if out is None else out
    decode_many([Decoding(codes, scales, result)], code, block)
    return result
