"""``e5m2``: fp8 e5m2 codes (OCP 8-bit floating point, 2023: 5 exponent bits, 2 mantissa bits,
largest finite 57344) times the block scale, stored as torch's ``float8_e5m2``."""
from __future__ import annotations

import torch

from lowp.optim.encodings.code import Code
from lowp.optim.encodings.storage import pack_bytes, unpack_bytes

__all__ = ["E5M2"]

E5M2 = Code("e5m2", torch.float8_e5m2, torch.float8_e5m2, 8, 57344.0, 2, -14, True,
            pack_bytes(torch.float8_e5m2), unpack_bytes, kind=4, native_header="e5m2.h")
