"""The encodings of optimizer states: block-scaled codes, one module each.

=========  ======================================  ===========================
encoding   grid                                    holds
=========  ======================================  ===========================
``int8``   integers ``-127..127``                  any state, linearly
``uint8``  integers ``1..255``                     ``sqrt`` of a nonnegative state
``uint4``  integers ``1..15``, two per byte        ``sqrt`` of a nonnegative state
``int4``   integers ``-7..7``, two per byte         any state, linearly
``e4m3``   fp8 e4m3fn values                       any state, linearly
``e5m2``   fp8 e5m2 values                         any state, linearly
=========  ======================================  ===========================

A group asks for one with ``state_dtype`` (``{"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}``);
:mod:`lowp.optim.codes` has the block arithmetic every encoding shares, and
:class:`~lowp.optim.encodings.code.Code` says what a new encoding's module defines.
"""
from __future__ import annotations

import torch

from lowp.optim.encodings.code import Code
from lowp.optim.encodings.e4m3 import E4M3
from lowp.optim.encodings.e5m2 import E5M2
from lowp.optim.encodings.int4 import INT4
from lowp.optim.encodings.int8 import INT8
from lowp.optim.encodings.uint4 import UINT4
from lowp.optim.encodings.uint8 import UINT8

__all__ = ["Code", "CODES", "code_for"]

#: Every encoding, by the dtype that asks for it: the one registration of an encoding.
CODES: dict[torch.dtype, Code] = {c.dtype: c for c in (INT8, UINT8, UINT4, E4M3, E5M2, INT4)}


def code_for(dtype: object) -> Code | None:
    """The code that ``dtype`` asks for in ``state_dtype``, ``None`` for a float dtype."""
    return CODES.get(dtype) if isinstance(dtype, torch.dtype) else None
