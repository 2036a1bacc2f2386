"""The random Hadamard transform: a seeded orthonormal rotation applied before block quantization.

``Q = H_n D / sqrt(n)``, where ``H_n`` is the Sylvester Hadamard matrix (``H_1 = [1]``,
``H_2k = [[H_k, H_k], [H_k, -H_k]]``, entries ±1, ``H_n H_n^T = n I``) and ``D`` is a diagonal of
random signs drawn from ``torch.Generator().manual_seed(seed)``. Every entry of ``Q`` is
``±1/sqrt(n)`` and ``Q Q^T = I``, so the inverse is ``Q^T``. The transform acts on the last
dimension in consecutive groups of ``n``: ``y[..., g] = x[..., g] @ Q`` for each group ``g``.

Spreading a block's outlier over ``n`` coordinates lowers the block's ``amax`` relative to its
norm; NVIDIA's NVFP4 recipe applies a 16x16 random Hadamard transform to the inputs of the
weight-gradient GEMM ("Pretraining Large Language Models with NVFP4", NVIDIA 2025,
arXiv:2509.25149, section 4.2). Since ``Q`` is orthonormal the GEMM is unchanged when both
operands are transformed along the reduction dimension.

Rounding: in a float dtype with unit roundoff ``u``, each output is a dot product of ``n`` terms,
so ``|fl(x Q) - x Q| <= gamma_n ||x_g||_1 / sqrt(n) <= gamma_n ||x_g||_2`` per group
(``gamma_n = n u / (1 - n u)``, Higham, "Accuracy and Stability of Numerical Algorithms",
2nd ed., section 3.1), and a forward-inverse round trip is within ``2 gamma_n ||x_g||_2 + O(u^2)``.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch

__all__ = ["hadamard_matrix", "random_hadamard", "inverse_random_hadamard"]


def _check_size(n: object) -> int:
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"hadamard: expected a power of two >= 1 (16, 32, ...), got {n!r}")
    return n


@lru_cache(maxsize=64)
def _matrix64(n: int, seed: int | None) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    if seed is not None:
        g = torch.Generator().manual_seed(seed)
        signs = torch.randint(0, 2, (n,), generator=g, dtype=torch.int64).to(torch.float64) * 2 - 1
        h = h * signs  # H D: column j times the j-th sign
    return h / math.sqrt(n)


def hadamard_matrix(n: int, seed: int | None = 0, *, dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """``Q = H_n D / sqrt(n)`` (``D = I`` when ``seed`` is None), an ``n x n`` tensor of ``dtype``."""
    _check_size(n)
    if seed is not None and (isinstance(seed, bool) or not isinstance(seed, int)):
        raise TypeError(f"seed: expected an int or None, got {type(seed).__name__}")
    return _matrix64(n, seed).to(dtype).clone()


def _apply(x: torch.Tensor, q: torch.Tensor, n: int) -> torch.Tensor:
    if not isinstance(x, torch.Tensor) or not x.is_floating_point():
        got = f"dtype {x.dtype}" if isinstance(x, torch.Tensor) else type(x).__name__
        raise TypeError(f"x: expected a floating-point tensor, got {got}")
    if x.dim() == 0 or x.shape[-1] % n:
        raise ValueError(f"hadamard: the size {n} must divide x's last dimension, got shape {tuple(x.shape)}")
    groups = x.reshape(*x.shape[:-1], x.shape[-1] // n, n)
    return (groups @ q.to(x.dtype)).reshape(x.shape)


def random_hadamard(x: torch.Tensor, n: int = 16, seed: int | None = 0) -> torch.Tensor:
    """``x`` rotated by ``Q`` in groups of ``n`` along the last dimension (see the module docstring)."""
    return _apply(x, hadamard_matrix(n, seed), n)


def inverse_random_hadamard(y: torch.Tensor, n: int = 16, seed: int | None = 0) -> torch.Tensor:
    """The inverse of :func:`random_hadamard` with the same ``n`` and ``seed`` (``Q^T``)."""
    return _apply(y, hadamard_matrix(n, seed).T, n)
