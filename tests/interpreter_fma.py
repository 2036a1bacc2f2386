"""A correctly rounded ``tl.fma`` for Triton's CPU interpreter, where the installed Triton lacks one.

Triton's interpreter (``TRITON_INTERPRET=1``) computed ``fma(x, y, z)`` as ``x * y + z`` in the
operands' dtype up to Triton 3.8 (two roundings); 3.9 rounds once, as the GPU's fma does. torch
2.11 pins Triton 3.6, so there the interpreted kernels' explicit fmas (the optimizers' rules)
differ from the definition in the last bit of about 2 in 1,000 Kahan compensations. The tests run
the kernels through the interpreter to check them bit for bit, so they install :func:`fma32` into
the interpreter when its own fma rounds twice (:func:`install`).

fp32 fma through fp64, exactly: the product ``p = x * y`` of two fp32 values is exact in fp64 (48
significant bits), ``s = fl64(p + z)`` and its error ``e = p + z - s`` (exact, Knuth's TwoSum).
Rounding ``s`` to fp32 gives the correctly rounded ``p + z`` unless ``s`` lies exactly halfway
between two fp32 values while ``e != 0`` (every fp32 midpoint is an fp64 value, and rounding to
fp64 never crosses one); then the true sum is on ``e``'s side of the midpoint.
"""
from __future__ import annotations

import numpy as np


def fma32(x: np.ndarray, y: np.ndarray, z: np.ndarray) -> np.ndarray:
    """``x * y + z`` of float32 arrays rounded once to float32 (round to nearest even)."""
    p = x.astype(np.float64) * y.astype(np.float64)
    z64 = z.astype(np.float64)
    with np.errstate(invalid="ignore", over="ignore"):
        s = p + z64
        b = s - p
        e = (p - (s - b)) + (z64 - b)
        r = s.astype(np.float32)
        d = s - r.astype(np.float64)  # where s sits from r: r's neighbour on that side is n
        n = np.nextafter(r, np.where(d > 0, np.float32(np.inf), np.float32(-np.inf)).astype(np.float32))
        midpoint = (d != 0) & (2 * s == r.astype(np.float64) + n.astype(np.float64))
        fix = midpoint & (e != 0) & np.isfinite(e)
    return np.where(fix & (np.sign(e) == np.sign(d)), n, r).astype(np.float32)


def _rounds_twice() -> bool:
    """Whether the interpreter's fma rounds twice: with x = 1 + 2^-12, x * x - 1 is 2^-11 + 2^-24
    rounded once, 2^-11 when x * x is rounded first (to even, from halfway)."""
    import triton.language as tl
    import torch
    import triton

    @triton.jit
    def probe(x_ptr, out_ptr):
        x = tl.load(x_ptr)
        tl.store(out_ptr, tl.fma(x, x, -1.0))

    x = torch.tensor([1 + 2.0**-12], dtype=torch.float32)
    out = torch.empty(1, dtype=torch.float32)
    probe[(1,)](x, out)
    return out.item() == 2.0**-11


def install() -> bool:
    """Make the interpreter's fp32 fma round once where it rounds twice (Triton < 3.9); returns
    whether it was replaced. Only under ``TRITON_INTERPRET=1``."""
    from triton.runtime import interpreter

    if not _rounds_twice():
        return False
    builder = interpreter.InterpreterBuilder
    original = builder.create_fma

    def create_fma(self, x, y, z):
        if z.data.dtype != np.float32:
            return original(self, x, y, z)
        return interpreter.TensorHandle(fma32(*np.broadcast_arrays(x.data, y.data, z.data)), z.dtype.scalar)

    builder.create_fma = create_fma
    assert not _rounds_twice(), "the interpreter kept its own fma"
    return True
