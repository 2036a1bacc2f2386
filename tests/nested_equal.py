"""Bit-for-bit comparison of nested checkpoints (dicts, lists, tuples, tensors, plain values)."""
from __future__ import annotations

from typing import Any

import torch


def assert_nested_equal(a: Any, b: Any, where: str = "") -> None:
    """``a`` and ``b`` have the same structure, tensors of the same dtype and bits, equal values;
    the message names the path of the first difference."""
    assert type(a) is type(b), where
    if isinstance(a, dict):
        assert a.keys() == b.keys(), where
        for k in a:
            assert_nested_equal(a[k], b[k], f"{where}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            assert_nested_equal(x, y, f"{where}[{i}]")
    elif isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and torch.equal(a, b), where
    else:
        assert a == b, where
