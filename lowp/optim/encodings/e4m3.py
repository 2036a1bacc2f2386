"""``e4m3``: fp8 e4m3fn codes (OCP 8-bit floating point, 2023: 4 exponent bits, 3 mantissa bits,
largest 448, no infinities) times the block scale, stored as torch's ``float8_e4m3fn``."""
from __future__ import annotations

import torch

from lowp.optim.encodings.code import Code
from lowp.optim.encodings.storage import pack_bytes, unpack_bytes

__all__ = ["E4M3"]

E4M3 = Code("e4m3", torch.float8_e4m3fn, torch.float8_e4m3fn, 8, 448.0, 3, -6, True,
            pack_bytes(torch.float8_e4m3fn), unpack_bytes, kind=3, native_header="e4m3.h")
