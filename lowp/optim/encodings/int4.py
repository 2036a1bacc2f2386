"""``int4``: signed 4-bit integer codes, ``q`` in ``[-7, 7]`` times the block scale, two per byte
(a two's complement nibble each): any state in half a byte, such as Adam's first moment beside a
``uint4`` second moment (Li et al., "Memory Efficient Optimizers with 4-bit States", NeurIPS 2023,
keep both moments in 4 bits; their first-moment map is signed too)."""
from __future__ import annotations

import torch

from lowp.optim.encodings.code import Code
from lowp.optim.encodings.storage import pack_nibbles, unpack_signed_nibbles

__all__ = ["INT4"]

INT4 = Code("int4", torch.int4, torch.uint8, 4, 7.0, 2, 2, True, pack_nibbles,  # type: ignore[attr-defined]
            unpack_signed_nibbles, kind=5, native_header="int4.h")
