"""What test_kernel_cache.py runs in this process and in child processes (importing nothing of
the test itself, so a child builds only the kernels its work needs)."""
from __future__ import annotations

import warnings
from typing import Callable

import torch

import lowp.optim as lo
from lowp.optim.kernels.native.kernel import NativeKernel


def sgd_step() -> None:
    """One SGD step with backend="native" on fp32 weights, checked against the formula, and one
    native non-finite check."""
    p = torch.arange(40, dtype=torch.float32)
    p.grad = torch.ones(40)
    opt = lo.SGD([p], lr=0.5, backend="native")
    opt.step()
    assert torch.equal(p, torch.arange(40, dtype=torch.float32) - 0.5), p
    assert opt.backend.finite_flags([torch.ones(100), torch.tensor([1.0, float("nan")])]) == [True, False]


def finite_check() -> None:
    """The native non-finite check only (one small library)."""
    grads = [torch.ones(100), torch.tensor([1.0, float("inf")])]
    flags = NativeKernel.finite_flags(object.__new__(NativeKernel), grads)
    assert flags == [True, False], flags


def cache_warnings(work: Callable[[], object]) -> int:
    """Run ``work()``; the number of kernel-cache warnings it gave."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        work()
    return sum("kernel cache" in str(w.message) for w in caught)
