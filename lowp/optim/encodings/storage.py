"""Reference storage of codes in bytes: one code per byte (an integer or an fp8 pattern), or two
4-bit codes per byte, element ``2k`` in the low nibble of byte ``k`` (an odd count pads a 0)."""
from __future__ import annotations

from typing import Callable

import torch

__all__ = ["pack_bytes", "unpack_bytes", "pack_nibbles", "unpack_nibbles", "unpack_signed_nibbles"]


def pack_bytes(storage: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """``pack`` of a one-byte code stored as ``storage`` (the cast of a value on the grid is exact)."""
    def pack(q: torch.Tensor) -> torch.Tensor:
        return q.to(storage) if storage.is_floating_point else q.to(torch.int32).to(storage)
    return pack


def unpack_bytes(codes: torch.Tensor, numel: int) -> torch.Tensor:
    """``unpack`` of one-byte codes: their values as fp32."""
    return codes.reshape(-1).float()


def pack_nibbles(q: torch.Tensor) -> torch.Tensor:
    """Codes in ``[-8, 15]`` (fp32, flat) as bytes, element ``2k`` in the low nibble of byte ``k``
    (a negative code as its two's complement nibble)."""
    nibbles = q.to(torch.int32) & 15
    if nibbles.numel() % 2:
        nibbles = torch.cat([nibbles, nibbles.new_zeros(1)])
    pairs = nibbles.view(-1, 2)
    return (pairs[:, 0] | (pairs[:, 1] << 4)).to(torch.uint8)


def unpack_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The ``numel`` unsigned codes (0..15) of :func:`pack_nibbles`'s bytes, as fp32."""
    b = packed.reshape(-1).to(torch.int32)
    return torch.stack([b & 15, b >> 4], dim=1).reshape(-1)[:numel].float()


def unpack_signed_nibbles(packed: torch.Tensor, numel: int) -> torch.Tensor:
    """The ``numel`` signed codes (-8..7, two's complement nibbles) of :func:`pack_nibbles`'s
    bytes, as fp32."""
    n = packed.reshape(-1).to(torch.int32)
    n = torch.stack([n & 15, n >> 4], dim=1).reshape(-1)[:numel]
    return (n - ((n & 8) << 1)).float()
