"""Helpers the optimizer tests share: a small regression model's training steps, and a snapshot of
everything a failed step or load must leave alone."""
from __future__ import annotations

from typing import Any

import torch

from lowp.optim import sharding


def regression_steps(model: torch.nn.Sequential, opt: Any, steps: int, start: int = 0) -> None:
    """Steps ``start`` to ``start + steps - 1`` of ``opt`` on a mean squared error of ``model``
    (a ``Sequential`` from a ``Linear`` to a ``Linear``), the inputs and targets of step ``t``
    drawn from seed ``t`` (8 rows), the inputs in the model's dtype, the loss in fp32."""
    width, outputs = model[0].in_features, model[-1].out_features
    for t in range(start, start + steps):
        gen = torch.Generator().manual_seed(t)
        x, y = torch.randn(8, width, generator=gen), torch.randn(8, outputs, generator=gen)
        opt.zero_grad()
        ((model(x.to(next(model.parameters()).dtype)).float() - y) ** 2).mean().backward()
        opt.step()


def snapshot(opt: Any, params: list[torch.Tensor]) -> dict[str, Any]:
    """Everything a failed step or load must leave alone, as comparable values: the weights and
    states of ``params`` as (dtype, shape, bytes), the groups' hyper-parameters, the seed and the
    skip counters; compare two with :func:`same_snapshot`."""
    def bits(t: torch.Tensor) -> tuple:
        t = sharding.local(t).detach()
        return (t.dtype, tuple(t.shape), t.clone().view(torch.uint8) if t.dim() else t.clone())
    state = {i: {k: bits(v) if torch.is_tensor(v) else v for k, v in opt.state[p].items()}
             for i, p in enumerate(params) if p in opt.state}
    groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
    return dict(weights=[bits(p) for p in params], state=state, groups=repr(groups),
                extras=(opt.seed, opt.skipped_params, opt.skipped_steps))


def same_snapshot(a: Any, b: Any) -> bool:
    """Two :func:`snapshot` values (or parts of them) hold the same bits and values."""
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_snapshot(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_snapshot(x, y) for x, y in zip(a, b))
    if torch.is_tensor(a):
        return torch.equal(a, b)
    return a == b
