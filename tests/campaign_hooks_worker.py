"""Child process of tests/test_campaign_hooks.py: runs cases of its table and reports each.

``python tests/campaign_hooks_worker.py NAME...``: the cases of kind ``local`` (no process group)
first, then ``group1`` (a one-rank gloo group on a file store), then ``ddp`` (two gloo ranks on
127.0.0.1 launched by :func:`lowp.distributed.launch.run_local_group`, each rank running every
named case; an ``alone`` case gets a launch of its own).

For each case the worker prints ``CASE <rank> <name>`` before it starts and ``DONE <rank> <name>``
or ``FAIL <rank> <name> <json why>`` after it (rank ``-`` outside a group), flushing each line, so
a process that dies (a signal, an abort inside a collective) names the case it died in.

A case runs ``setup``, snapshots every object it made (module weights, optimizer state dicts and
counters, release handles, hook states, GradScalers, tensors and the hooks on parameters), runs
``action`` and compares the outcome with the expected one: ``"ok"``, or an exception of a given
type whose message matches a regex, after which (for an atomic case) every snapshot must be
unchanged. ``after`` then runs whatever the outcome, with ``error`` bound to the exception or
``None``.
"""
from __future__ import annotations

import copy
import json
import math
import os
import re
import sys
import tempfile
import traceback
from pathlib import Path
from typing import Any

import numpy as np
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE.parent), str(HERE)]

import lowp.optim as lo  # noqa: E402
from lowp.optim.base import LowpOptimizer  # noqa: E402
from lowp.optim.release import GradientRelease, release_gradients  # noqa: E402
from nested_equal import assert_nested_equal  # noqa: E402


# ---- helpers the cases use -----------------------------------------------------------------------
def make(dtype: torch.dtype = torch.float32, **kw: Any) -> tuple[torch.nn.Sequential, LowpOptimizer]:
    """A small MLP (Linear(4, 8), Tanh, Linear(8, 2)) in ``dtype`` and an AdamW over it."""
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)).to(dtype)
    return net, lo.AdamW(net.parameters(), lr=1e-2, weight_decay=0.1, seed=5, **kw)


def batch(t: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.randn(3, 4, generator=torch.Generator().manual_seed(100 + t)).to(dtype)


def loss(net: torch.nn.Module, t: int = 0) -> torch.Tensor:
    """A loss of ``net`` on batch ``t``."""
    dtype = next(net.parameters()).dtype
    return net(batch(t, dtype)).float().square().mean()


def train(net: torch.nn.Module, opt: Any, steps: int, k: int = 1, start: int = 0) -> None:
    """``steps`` steps of ``k`` micro-batches each, the usual loop."""
    for s in range(start, start + steps):
        for m in range(k):
            loss(net, s * k + m).backward()
        opt.step()
        opt.zero_grad()


def same(a: tuple[torch.nn.Module, LowpOptimizer], b: tuple[torch.nn.Module, LowpOptimizer]) -> None:
    """Equal weights and optimizer state dicts, bit for bit."""
    assert_nested_equal(a[0].state_dict(), b[0].state_dict(), "model")
    assert_nested_equal(a[1].state_dict(), b[1].state_dict(), "optimizer")


def steps_of(opt: LowpOptimizer, p: torch.Tensor) -> int:
    """The step count of ``p`` (0 without a state)."""
    return int(opt.state[p]["step"]) if p in opt.state else 0


class _Boom(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, exc: BaseException) -> torch.Tensor:
        ctx.exc = exc
        return x.clone()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        raise ctx.exc


def boom(x: torch.Tensor, exc: BaseException | None = None) -> torch.Tensor:
    """``x``, whose backward raises ``exc`` (default ``ValueError("boom in backward")``)."""
    return _Boom.apply(x, exc if exc is not None else ValueError("boom in backward"))


def staged(net: torch.nn.Sequential, t: int, on_hidden: Any) -> torch.Tensor:
    """The loss of ``net`` on batch ``t`` with ``on_hidden`` as a hook on the hidden activation:
    in backward it runs after the last layer's gradients were accumulated, before the first's."""
    h = torch.tanh(net[0](batch(t, net[0].weight.dtype)))
    h.register_hook(on_hidden)
    return net[2](h).float().square().mean()


class FakeBucket:
    """What the hooks read of a :class:`torch.distributed.GradBucket`: ``buffer()`` and ``index()``."""

    def __init__(self, buffer: torch.Tensor, index: int = 0) -> None:
        self._buffer, self._index = buffer, index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def index(self) -> int:
        return self._index


def ddp_grads(model: torch.nn.Module, x: torch.Tensor, hook: Any = None, state: Any = None,
              **ddp_kw: Any) -> list[torch.Tensor]:
    """The gradients DDP leaves in ``model`` after one backward pass of ``model(x).sum()`` (with
    ``hook`` registered under ``state`` when given)."""
    from torch.nn.parallel import DistributedDataParallel as DDP
    ddp = DDP(model, **ddp_kw)
    if hook is not None:
        ddp.register_comm_hook(state, hook)
    ddp(x).float().sum().backward()
    return [p.grad.detach().clone() for p in model.parameters()]


def init_group1() -> None:
    """A one-rank gloo group on a file store (once per process)."""
    import torch.distributed as dist
    if not dist.is_initialized():
        store = dist.FileStore(os.path.join(tempfile.mkdtemp(), "store"), 1)
        dist.init_process_group("gloo", store=store, rank=0, world_size=1)


HELPERS: dict[str, Any] = {
    "torch": torch, "np": np, "math": math, "copy": copy, "lo": lo, "LowpOptimizer": LowpOptimizer,
    "GradientRelease": GradientRelease, "release_gradients": release_gradients, "make": make, "batch": batch,
    "loss": loss, "train": train, "same": same, "steps_of": steps_of, "boom": boom, "staged": staged,
    "FakeBucket": FakeBucket, "ddp_grads": ddp_grads, "assert_nested_equal": assert_nested_equal,
}


# ---- snapshots -----------------------------------------------------------------------------------
def _clone(t: torch.Tensor) -> Any:
    if t.is_meta:
        return ("meta", t.dtype, tuple(t.shape))
    return t.detach().clone()


def _snapshot(value: Any) -> Any:
    """What of ``value`` an atomic failure must leave as it was (``None``: nothing tracked)."""
    from lowp.distributed.hooks import ReduceState
    if isinstance(value, torch.nn.Module):
        return ({k: _clone(v) for k, v in value.state_dict().items()},
                [len(p._post_accumulate_grad_hooks or {}) for p in value.parameters()])
    if isinstance(value, LowpOptimizer):
        return (copy.deepcopy(value.state_dict()), value.skipped_params, value.skipped_steps,
                id(value._released_by))
    if isinstance(value, GradientRelease):
        return (value.backward_passes, value.active, len(value._hooks), value.accumulation_steps)
    if isinstance(value, ReduceState):
        return (value.calls, copy.copy(value.stats), value.seed, value.wire_dtype, value.gather_dtype,
                value.collect_stats)
    if isinstance(value, torch.amp.GradScaler):
        return copy.deepcopy(value.state_dict())
    if isinstance(value, torch.Tensor):
        return _clone(value)
    if isinstance(value, tuple) and value and all(isinstance(v, (torch.nn.Module, LowpOptimizer)) for v in value):
        return tuple(_snapshot(v) for v in value)
    return None


def _differ(a: Any, b: Any, where: str) -> str | None:
    """Where nested ``a`` and ``b`` first differ (tensors compared bit for bit, NaN equal to NaN),
    or ``None``."""
    if type(a) is not type(b):
        return where
    if isinstance(a, dict):
        if a.keys() != b.keys():
            return where
        return next((d for k in a if (d := _differ(a[k], b[k], f"{where}[{k!r}]")) is not None), None)
    if isinstance(a, (list, tuple)):
        if len(a) != len(b):
            return where
        return next((d for i, (x, y) in enumerate(zip(a, b)) if (d := _differ(x, y, f"{where}[{i}]")) is not None),
                    None)
    if isinstance(a, torch.Tensor):
        if a.layout != torch.strided or b.layout != torch.strided:
            return None if a.layout == b.layout and torch.equal(a.to_dense(), b.to_dense()) else where
        bits = [t.detach().reshape(-1).contiguous().view(torch.uint8) for t in (a, b)]
        same_bits = a.dtype == b.dtype and a.shape == b.shape and torch.equal(*bits)
        return None if same_bits else where
    if isinstance(a, float) and math.isnan(a) and math.isnan(b):
        return None
    return None if a == b else where


def _changed(before: dict[str, Any], ns: dict[str, Any]) -> list[str]:
    return [d for name, old in before.items() if (d := _differ(old, _snapshot(ns.get(name)), name)) is not None]


# ---- running cases -------------------------------------------------------------------------------
def _describe(exc: BaseException | None) -> str:
    return "no error" if exc is None else f"{type(exc).__name__}: {str(exc)[:600]}"


def _check(case: Any, expect: Any, ns: dict[str, Any], rank: int | None) -> str | None:
    """Run ``case`` in ``ns``; ``None`` when it went as expected, else why not."""
    exec(case.setup, ns)
    before = {k: s for k, v in list(ns.items()) if k not in HELPERS and not k.startswith("__")
              and (s := _snapshot(v)) is not None}
    error: BaseException | None = None
    try:
        exec(case.action, ns)
    except BaseException as exc:  # noqa: BLE001 - KeyboardInterrupt and SystemExit are outcomes too
        error = exc
    trace = "".join(traceback.format_exception(error, limit=-4)) if error is not None else ""
    if expect == "ok":
        if error is not None:
            kind = "wrong" if isinstance(error, AssertionError) else "error"
            return f"{kind}: expected no error, got {_describe(error)}\n{trace}"
    else:
        etype, pattern = expect
        if error is None:
            return f"silent: expected {etype.__name__} matching {pattern!r}, got no error"
        if not isinstance(error, etype) or not re.search(pattern, str(error)):
            return f"unnamed: expected {etype.__name__} matching {pattern!r}, got {_describe(error)}\n{trace}"
        if case.atomic:
            changed = _changed(before, ns)
            if changed:
                return f"changed: {_describe(error)}; changed: {changed}"
    if case.after:
        ns["error"] = error
        try:
            exec(case.after, ns)
        except BaseException as exc:  # noqa: BLE001
            return f"after: {_describe(exc)}\n{''.join(traceback.format_exception(exc, limit=-4))}"
    return None


def _say(line: str) -> None:
    """Print ``line`` in one write of under PIPE_BUF (4096) bytes: the ranks share the pipe, and
    ``print`` writes the newline separately, so their lines could interleave."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def run(cases: list[Any], rank: int | None = None) -> None:
    """Run ``cases`` one after the other, printing the markers the parent reads."""
    tag = "-" if rank is None else str(rank)
    for case in cases:
        _say(f"CASE {tag} {case.name}")
        expect = case.expect[rank] if isinstance(case.expect, list) else case.expect
        ns = dict(HELPERS, __name__=f"case_{case.name}", rank=rank)
        if rank is not None:
            import torch.distributed as dist
            ns.update(dist=dist, world=dist.get_world_size())
        try:
            why = _check(case, expect, ns, rank)
        except BaseException as exc:  # noqa: BLE001 - the setup failed
            why = f"setup: {_describe(exc)}\n{''.join(traceback.format_exception(exc, limit=-4))}"
        if why is None:
            _say(f"DONE {tag} {case.name}")
        else:
            _say(f"FAIL {tag} {case.name} {json.dumps(why[:3000])}")


def _rank_main(rank: int, world_size: int, names: list[str]) -> None:
    from test_campaign_hooks import BY_NAME
    torch.manual_seed(0)
    run([BY_NAME[n] for n in names], rank)


def _launch(names: list[str]) -> None:
    """Run ``names`` on every rank of a fresh two-rank gloo group."""
    from lowp.distributed.launch import GroupFailure, run_local_group
    from test_campaign_hooks import GROUP_TIMEOUT_S
    try:
        run_local_group(_rank_main, 2, names, timeout_s=GROUP_TIMEOUT_S)
    except GroupFailure as exc:
        _say(f"GROUP {json.dumps(str(exc)[:3000])}")
        raise SystemExit(3) from None


def main(names: list[str]) -> int:
    """Run the named cases: those without a process group, then those of a one-rank group, then
    the two-rank ones in one launch, then each ``alone`` case in a launch of its own."""
    from test_campaign_hooks import BY_NAME
    cases = [BY_NAME[n] for n in names]
    run([c for c in cases if c.kind == "local"])
    group1 = [c for c in cases if c.kind == "group1"]
    if group1:
        init_group1()
        run(group1)
    together = [c.name for c in cases if c.kind == "ddp" and not c.alone]
    if together:
        _launch(together)
    for case in cases:
        if case.kind == "ddp" and case.alone:
            _launch([case.name])
    return 0


if __name__ == "__main__":
    torch.set_num_threads(1)
    sys.exit(main(sys.argv[1:]))
