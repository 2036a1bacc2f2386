"""``int8``: signed 8-bit integer codes, ``q`` in ``[-127, 127]`` times the block scale (any state)."""
from __future__ import annotations

import torch

from lowp.optim.encodings.code import Code
from lowp.optim.encodings.storage import pack_bytes, unpack_bytes

__all__ = ["INT8"]

INT8 = Code("int8", torch.int8, torch.int8, 8, 127.0, 7, 7, True, pack_bytes(torch.int8), unpack_bytes,
            kind=0, native_header="int8.h")
