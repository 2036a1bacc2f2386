"""``BucketStats``: cheap statistics of one gradient bucket across ranks, what
:mod:`lowp.distributed.hooks` records and :mod:`lowp.distributed.advisor` reads."""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BucketStats"]


@dataclass(frozen=True)
class BucketStats:
    """Statistics of one gradient bucket across R ranks.

    The fields are checked by :func:`advise` (``ValueError`` naming ``stats.<field>``), not here.

    Args:
        numel: elements in the bucket, a positive int.
        world_size: R, the number of ranks, an int in [1, 65536].
        mean_rms: rms over elements of the across-rank mean, in gradient units (>= 0, finite).
        spread_rms: rms over elements of the across-rank standard deviation, in gradient units
            (>= 0, finite); 0 means the ranks agree exactly, so there is no sampling noise.
        underflow_fraction: fraction in [0, 1] of per-rank values with ``|g / R|`` below half the
            wire format's smallest subnormal (default 0.0: :func:`advise` then estimates it from
            ``mean_rms`` and ``spread_rms`` when averaging divides before the sum).
        absmax: largest ``|g|`` divided by R (sum over ranks of the local maxima / R, an upper
            bound's scale), >= 0 (default 0.0: no fp16 overflow check).
    """

    numel: int
    world_size: int
    mean_rms: float
    spread_rms: float
    underflow_fraction: float = 0.0
    absmax: float = 0.0
