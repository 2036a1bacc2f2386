"""What a state encoding is: :class:`Code`, one frozen description that the codec, every backend
and the checks read.

A block-scaled code (:mod:`lowp.optim.codes` has the block arithmetic) is its **grid** (the
largest code ``Q``, the mantissa bits ``m`` and least exponent ``emin`` of a small float format,
signed or square-root) and its **storage** (how codes sit in bytes). One module of this package
holds each encoding: the ``Code`` with its storage's reference ``pack`` / ``unpack`` and, beside
it, the C++ header that specializes ``Storage<KIND>`` for the native codec and step (loads and
stores of 8 and of 16 codes; ``native/codes.h`` has them for one-byte integers, fp8 bytes and
nibbles, so a header usually names its base and its flags). The Triton kernel reads the grid and storage numbers
(``bits``, ``signed``, ``storage``) and needs nothing per encoding. Adding an encoding is one
module (and its header) plus one entry in :data:`lowp.optim.encodings.CODES`.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

__all__ = ["Code", "HEADERS"]

#: The folder of the encodings' C++ headers (the native build adds it to the include path).
HEADERS = Path(__file__).parent


@dataclass(frozen=True)
class Code:
    """One block-scaled code: its storage and its grid.

    Args:
        name: the code's name as printed.
        dtype: the dtype that asks for it in ``state_dtype`` (``torch.int8``, ``torch.uint8``,
            ``torch.uint4``, ``torch.float8_e4m3fn``, ``torch.float8_e5m2``...).
        storage: the dtype of the stored codes (4-bit codes: two per ``uint8``).
        bits: bits per code (8 or 4).
        top: ``Q``, the largest code magnitude.
        mantissa_bits: ``m`` of the grid (see :mod:`lowp.optim.codes`).
        min_exponent: ``emin`` of the grid.
        signed: ``True``: any value, stored linearly; ``False``: nonnegative values, stored as
            their square roots.
        pack: ``pack(q)``: the flat storage of the codes ``q`` (fp32 values on the grid, flat).
        unpack: ``unpack(codes, numel)``: the ``numel`` codes of ``codes`` as fp32 values (flat).
        kind: the number of its ``Storage<KIND>`` specialization in the native code.
        native_header: the file name of its C++ header in :data:`HEADERS`.
    """

    name: str
    dtype: torch.dtype
    storage: torch.dtype
    bits: int
    top: float
    mantissa_bits: int
    min_exponent: int
    signed: bool
    pack: Callable[[torch.Tensor], torch.Tensor]
    unpack: Callable[[torch.Tensor, int], torch.Tensor]
    kind: int
    native_header: str

    def spacing(self, a: torch.Tensor) -> torch.Tensor:
        """The grid spacing at the nonnegative fp32 magnitudes ``a``: a power of two."""
        binade = (a.view(torch.int32) & 0x7F800000).view(torch.float32)   # 2**e(a), 0 below fp32's normals
        return torch.clamp_min(binade, 2.0 ** self.min_exponent) * 2.0 ** -self.mantissa_bits
