"""The rebuild of sharded tensors' ordered sums in C++ (``native/rebuild.cpp``):
:meth:`lowp.optim.ordered_sum.Rebuild.totals`, the definition, in one call instead of some twenty
tensor operations over the pieces (GPT-2's shapes / 8 on 2 ranks, 80,606 pieces: 1.0-1.5 ms in
torch, 0.28 ms here, 0.15 ms of it in the C++; ``docs/distributed.md``), the same bits.

The indices come from the :class:`~lowp.optim.ordered_sum.Rebuild`, which made and checked them;
the values are checked here (one float64 per piece, pieces given twice equal:
:meth:`~lowp.optim.ordered_sum.Rebuild.check_values`) before the call, and the C++ checks every
index and count against its range again. :data:`CALLS` counts the calls (a test's proof that
it ran).
"""
from __future__ import annotations

import ctypes
import functools
import weakref

import torch

from lowp.optim.kernels.native.build import native_available, rebuild_function
from lowp.optim.ordered_sum import Rebuild, inexact_term

__all__ = ["totals", "available", "CALLS"]

#: calls of :func:`totals` that ran the C++ rebuild, in this process
CALLS = [0]
#: the position of ``term_from`` among the index arrays, and the C++'s result when it could not allocate
_TERM_FROM, _NO_MEMORY = 7, -3
#: per Rebuild: its index arrays (int64, contiguous; kept alive here), their pointer table and
#: the sizes after the value count (``native/rebuild.cpp``'s ``Count``)
_PREPARED: weakref.WeakKeyDictionary[Rebuild, tuple[list[torch.Tensor], ctypes.Array, list[int]]] = \
    weakref.WeakKeyDictionary()


@functools.lru_cache(maxsize=None)
def available() -> bool:
    """Whether the C++ rebuild runs here: the native kernel's requirements, and its library
    builds (or is in the cache) and loads."""
    if not native_available():
        return False
    try:
        rebuild_function()
    except (RuntimeError, OSError):
        return False
    return True


def totals(rebuild: Rebuild, values: torch.Tensor) -> torch.Tensor:
    """``rebuild.totals(values)`` (float64, one per tensor) computed in C++: ``values`` float64,
    one dimension, one per piece of the rebuild's runs. ``ValueError`` as
    :meth:`~lowp.optim.ordered_sum.Rebuild.totals` raises it."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().contiguous()
    rebuild.check_values(values)
    index, table, sizes = _prepared(rebuild)
    count = torch.tensor([values.numel(), *sizes], dtype=torch.int64)
    out = torch.zeros(sizes[-1], dtype=torch.float64)   # the prepared tensor count, which the C++ reads
    result = rebuild_function()(values.data_ptr(), count.data_ptr(), table, out.data_ptr())
    if result > 0:
        raise inexact_term(float(values[index[_TERM_FROM][result - 1]]))
    if result == _NO_MEMORY:
        raise MemoryError("rebuild: the C++ rebuild could not allocate its units and blocks")
    if result < 0:
        raise RuntimeError("rebuild: an index or size of the Rebuild is outside its array (nothing was summed)")
    CALLS[0] += 1
    return out


def _prepared(rebuild: Rebuild) -> tuple[list[torch.Tensor], ctypes.Array, list[int]]:
    """The rebuild's index arrays in ``native/rebuild.cpp``'s ``Index`` order, their pointer table
    and sizes, made once per Rebuild (a sharded step's is the same every step); ``ValueError``
    when arrays that pair up differ in length."""
    if rebuild not in _PREPARED:   # copies: a later change to the Rebuild's own tensors changes nothing here
        index = [t.to(torch.int64, copy=True).contiguous() for t in (
            rebuild.unit_to, rebuild.unit_from, rebuild.partial, rebuild.sizes, rebuild.block_to, rebuild.block_from,
            rebuild.term_to, rebuild.term_from, rebuild.split, rebuild.base, rebuild.nunits)]
        if any(index[a].numel() != index[a + 1].numel() for a in (0, 2, 4, 6, 9)) \
                or rebuild.tensors != index[9].numel():
            raise ValueError("rebuild: its index arrays do not pair up or do not describe its tensors")
        sizes = [rebuild.units, rebuild.blocks, *(index[a].numel() for a in (0, 2, 4, 6, 8, 9))]
        _PREPARED[rebuild] = index, (ctypes.c_void_p * len(index))(*[t.data_ptr() for t in index]), sizes
    return _PREPARED[rebuild]
