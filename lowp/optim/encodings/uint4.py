"""``uint4``: unsigned 4-bit codes ``q`` in ``[1, 15]`` of the square root of a nonnegative state,
two per byte (Li et al., "Memory Efficient Optimizers with 4-bit States", NeurIPS 2023, keep
second moments in 4 bits without the zero point)."""
from __future__ import annotations

import torch

from lowp.optim.encodings.code import Code
from lowp.optim.encodings.storage import pack_nibbles, unpack_nibbles

__all__ = ["UINT4"]

UINT4 = Code("uint4", torch.uint4, torch.uint8, 4, 15.0, 3, 3, False, pack_nibbles,  # type: ignore[attr-defined]
             unpack_nibbles, kind=2, native_header="uint4.h")
