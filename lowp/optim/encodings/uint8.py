"""``uint8``: unsigned 8-bit codes ``q`` in ``[1, 255]`` of the square root of a nonnegative state
(Adam's second moment): the state is ``(q * s)**2``."""
from __future__ import annotations

import torch

from lowp.optim.encodings.code import Code
from lowp.optim.encodings.storage import pack_bytes, unpack_bytes

__all__ = ["UINT8"]

UINT8 = Code("uint8", torch.uint8, torch.uint8, 8, 255.0, 7, 7, False, pack_bytes(torch.uint8), unpack_bytes,
             kind=1, native_header="uint8.h")
