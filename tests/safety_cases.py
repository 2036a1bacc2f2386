"""Odd inputs for the fused backends, run by test_native_safety.py in child processes:
``python tests/safety_cases.py BACKEND:OPTIMIZER:MODE:CASE ...``.

Every case builds the same parameters, gradients and state changes twice, steps a lowp
optimizer with ``backend=BACKEND`` and with the reference ``backend="foreach"``, and checks that
the fused backend either worked and agrees with the reference (bit for bit; in stochastic mode,
whose bits differ between backends, the steps before the last round to nearest and the last
lands within one ulp) or raised an error whose
message names the argument (a parameter, the gradient, a state or the mode's buffer), leaving
every weight and state tensor bit-unchanged. The child prints ``CASE <id>`` before a case and
``DONE <id> <outcome>`` or ``FAIL <id> <why>`` after it, so a crash names its case.
"""
from __future__ import annotations

import os
import re
import sys
import traceback
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from lowp.optim.registry import entries

#: every optimizer of the registry with its first example (lowp/optim/registry.py)
OPTIMIZERS: dict[str, tuple[type, dict[str, Any]]] = {e.name: (e.cls, dict(e.examples[0])) for e in entries()}


def _state_names() -> tuple[str, ...]:
    """The states of every optimizer of the registry, for each of its examples, of a matrix and a vector."""
    names: dict[str, None] = {}
    for e in entries():
        for example in e.examples:
            params = [torch.zeros(2, 3), torch.zeros(3)]
            opt = e.cls(params, seed=0, **example)
            names.update(dict.fromkeys(n for p in params for n in opt.state_names(opt.param_groups[0], p)))
    return tuple(names)


_STATE_NAMES = _state_names()
#: names an error message may point at: arguments, states (and the block scales of coded ones), buffers
ARGUMENTS = ("params", "grad", "states", "state_dtype", "compensation", "remainder", "remainder8", *_STATE_NAMES,
             *(f"{n}_scale" for n in _STATE_NAMES))


@dataclass
class Scenario:
    """Parameters, the gradients of each step, and a change made to the optimizer before a step."""

    params: list[torch.Tensor]
    grads: Callable[[int], list[torch.Tensor | None]]
    tamper: Callable[[Any, int], None] = lambda opt, step: None
    options: dict[str, Any] = field(default_factory=dict)
    steps: int = 2
    reference: bool = True  # False: the reference pipeline itself would crash (torch reads freed memory)


def bf16(shape, gen, scale=0.1) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale).bfloat16()


def set_grad(p: torch.Tensor, g: torch.Tensor | None) -> None:
    """``p.grad = g`` whatever ``g``'s dtype or shape (torch's setter refuses other ones; from
    torch 2.10 on a parameter whose ``grad_dtype`` is ``None`` takes any dtype)."""
    if hasattr(p, "grad_dtype"):
        p.grad_dtype = None
    try:
        p.grad = g
    except RuntimeError:
        p.grad = torch.zeros_like(p)
        p.grad.data = g


def plain_grads(params: list[torch.Tensor], seed: int = 7, dtype=None) -> Callable[[int], list[torch.Tensor]]:
    def grads(step: int) -> list[torch.Tensor]:
        gen = torch.Generator().manual_seed(seed + step)
        return [torch.randn(p.shape, generator=gen).to(dtype or p.dtype) for p in params]
    return grads


def state_names(opt) -> tuple[str, ...]:
    return opt.state_names(opt.param_groups[0], opt.param_groups[0]["params"][0])


def replace_state(fn: Callable[[torch.Tensor], torch.Tensor], at: int = 1) -> Callable[[Any, int], None]:
    """Before step ``at``: the first state of the first parameter becomes ``fn(state)``."""
    def tamper(opt, step: int) -> None:
        if step == at:
            p = opt.param_groups[0]["params"][0]
            name = state_names(opt)[0]
            opt.state[p][name] = fn(opt.state[p][name])
    return tamper


def drop(key: Callable[[Any], str | None], at: int = 1) -> Callable[[Any, int], None]:
    """Before step ``at``: delete the entry ``key(opt)`` of the first parameter's state."""
    def tamper(opt, step: int) -> None:
        name = key(opt)
        if step == at and name:
            opt.state[opt.param_groups[0]["params"][0]].pop(name, None)
    return tamper


def standard(gen) -> list[torch.Tensor]:
    return [bf16((37, 11), gen), bf16((300,), gen)]


# ---- the cases: name -> (mode -> Scenario) ------------------------------------------------------
def offset_views(mode, gen):
    flat = bf16(1000, gen)
    params = [flat[3:103].view(10, 10), flat[103:403], flat[500:501]]
    return Scenario(params, plain_grads(params))


def transposed(mode, gen):
    params = [bf16((8, 6), gen).t(), *standard(gen)]
    return Scenario(params, plain_grads(params))


def expanded_grad(mode, gen):
    params = [bf16((4, 16), gen), bf16((5,), gen)]
    return Scenario(params, lambda step: [bf16((1, 16), torch.Generator().manual_seed(step), 1).expand(4, 16),
                                          bf16((1,), torch.Generator().manual_seed(step), 1).expand(5)])


def expanded_param(mode, gen):
    params = [bf16((1,), gen).expand(8), bf16((20,), gen)]
    return Scenario(params, plain_grads(params))


def empty_and_single(mode, gen):
    params = [bf16((0,), gen), bf16((1,), gen), bf16((), gen), bf16((3, 0), gen), bf16((40,), gen)]
    return Scenario(params, plain_grads(params))


def shared_storage(mode, gen):
    flat = bf16(300, gen)
    params = [flat[0:100], flat[50:150], bf16((64,), gen)]
    return Scenario(params, plain_grads(params))


def grad_views_of_one_buffer(mode, gen):
    params = standard(gen)

    def grads(step):
        flat = torch.randn(sum(p.numel() for p in params), generator=torch.Generator().manual_seed(step)).bfloat16()
        return [flat[:407].view(37, 11), flat[407:]]
    return Scenario(params, grads)


def grad_fp32(mode, gen):
    params = standard(gen)
    return Scenario(params, plain_grads(params, dtype=torch.float32))


def grad_fp64(mode, gen):
    params = standard(gen)
    return Scenario(params, plain_grads(params, dtype=torch.float64))


def grad_smaller(mode, gen):
    params = standard(gen)
    return Scenario(params, lambda step: [bf16((37, 5), torch.Generator().manual_seed(step), 1), bf16((300,), gen, 1)])


def grad_reshaped(mode, gen):
    params = standard(gen)
    return Scenario(params, lambda step: [bf16((11, 37), torch.Generator().manual_seed(step), 1), bf16((300,), gen, 1)])


def grad_strided(mode, gen):
    params = [bf16((4, 16), gen), bf16((64,), gen)]
    return Scenario(params, lambda step: [bf16((16, 4), torch.Generator().manual_seed(step), 1).t(),
                                          bf16((128,), torch.Generator().manual_seed(step + 9), 1)[::2]])


def grad_negative_view(mode, gen):
    params = standard(gen)
    inner = plain_grads(params)
    return Scenario(params, lambda step: [torch._neg_view(g) for g in inner(step)])


def grad_storage_freed(mode, gen):
    params = standard(gen)
    inner = plain_grads(params)

    def grads(step):
        out = inner(step)
        if step == 1:
            out[0].untyped_storage().resize_(0)
        return out
    return Scenario(params, grads, reference=False)


def grad_storage_freed_unchecked(mode, gen):
    scenario = grad_storage_freed(mode, gen)
    scenario.options = dict(nonfinite="off")
    return scenario


def param_storage_freed(mode, gen):
    params = standard(gen)

    def tamper(opt, step):
        if step == 1:
            params[1].untyped_storage().resize_(0)
    return Scenario(params, plain_grads(params), tamper, reference=False)


def param_misaligned(mode, gen):
    values = bf16(64, gen)
    raw = bytearray(values.numel() * 2 + 1)
    p = torch.frombuffer(raw, dtype=torch.bfloat16, offset=1, count=64)
    p.copy_(values)
    params = [p, bf16((16,), gen)]
    return Scenario(params, plain_grads(params))


def param_fp64(mode, gen):
    params = [torch.randn(30, generator=gen, dtype=torch.float64), *standard(gen)]
    return Scenario(params, plain_grads(params))


def buffer_deleted(mode, gen):
    params = standard(gen)
    return Scenario(params, plain_grads(params), drop(lambda opt: {"kahan": "compensation", "exact": "remainder",
                                                                   "exact8": "remainder8"}.get(mode)))


def mode_switched(mode, gen):
    """stochastic -> kahan mid-training (no compensation yet); kahan -> exact (no remainder)."""
    params = standard(gen)

    def tamper(opt, step):
        if step == 1:
            opt.param_groups[0]["mode"] = "exact" if mode == "kahan" else "kahan"
    return Scenario(params, plain_grads(params), tamper)


def state_missing(mode, gen):
    params = standard(gen)
    return Scenario(params, plain_grads(params), drop(lambda opt: state_names(opt)[0]))


def state_extra(mode, gen):
    params = standard(gen)

    def tamper(opt, step):
        if step == 1:
            opt.state[params[0]]["unused"] = torch.zeros(3)
    return Scenario(params, plain_grads(params), tamper)


def state_fp64(mode, gen):
    params = standard(gen)
    return Scenario(params, plain_grads(params), replace_state(lambda t: t.double()))


def state_integer(mode, gen):
    params = standard(gen)
    return Scenario(params, plain_grads(params), replace_state(lambda t: t.to(torch.int32)))


def state_wrong_size(mode, gen):
    params = standard(gen)
    return Scenario(params, plain_grads(params), replace_state(lambda t: torch.zeros(t.numel() + 1, dtype=t.dtype)))


def state_strided(mode, gen):
    params = standard(gen)
    return Scenario(params, plain_grads(params),
                    replace_state(lambda t: t.t().contiguous().t() if t.dim() == 2 else t))


def buffer_fp64(mode, gen):
    params = standard(gen)

    def tamper(opt, step):
        state = opt.state[params[0]]
        if step == 1 and "compensation" in state:
            state["compensation"] = state["compensation"].double()
    return Scenario(params, plain_grads(params), tamper)


def coded_int8(mode, gen):
    """Block-scaled int8 states (every state of every elementwise optimizer can hold them)."""
    params = standard(gen)
    return Scenario(params, plain_grads(params),
                    options=dict(coded_min_numel=0, state_dtype=torch.int8, state_block=32))


def coded_fp8(mode, gen):
    params = standard(gen)
    return Scenario(params, plain_grads(params),
                    options=dict(coded_min_numel=0, state_dtype=torch.float8_e4m3fn, state_block=32))


def _coded_tamper(change: Callable[[dict, str], None]) -> Callable[[Any, int], None]:
    """Before step 1: ``change(state, name)`` for the first coded state of the first parameter."""
    def tamper(opt, step: int) -> None:
        state = opt.state[opt.param_groups[0]["params"][0]]
        coded = [n for n in state_names(opt) if f"{n}_scale" in state]
        if step == 1 and coded:
            change(state, coded[0])
    return tamper


def coded_noncontiguous(mode, gen):
    """The codes and scales of a 2-d parameter as transposed copies: the same values, strided."""
    params = standard(gen)

    def change(state, name):
        for key in (name, f"{name}_scale"):
            t = state[key]
            if t.dim() == 2 and min(t.shape) > 1:
                state[key] = t.t().contiguous().t()
    return Scenario(params, plain_grads(params), _coded_tamper(change),
                    options=dict(coded_min_numel=0, state_dtype=torch.int8, state_block=32))


def coded_scales_missing(mode, gen):
    params = standard(gen)
    return Scenario(params, plain_grads(params), _coded_tamper(lambda state, name: state.pop(f"{name}_scale")),
                    options=dict(coded_min_numel=0, state_dtype=torch.int8, state_block=32))


def coded_scales_fp64(mode, gen):
    params = standard(gen)

    def change(state, name):
        state[f"{name}_scale"] = state[f"{name}_scale"].double()
    return Scenario(params, plain_grads(params), _coded_tamper(change),
                    options=dict(coded_min_numel=0, state_dtype=torch.int8, state_block=32))


def coded_codes_short(mode, gen):
    params = standard(gen)

    def change(state, name):
        state[name] = state[name].reshape(-1)[:-1].clone()
    return Scenario(params, plain_grads(params), _coded_tamper(change),
                    options=dict(coded_min_numel=0, state_dtype=torch.int8, state_block=32))


def param_twice(mode, gen):
    """The same tensor twice: one step would update it twice (torch only warns)."""
    a = bf16((300,), gen)
    return Scenario([a, a, bf16((16,), gen)],
                    lambda step: [torch.ones(300).bfloat16()] * 2 + [torch.ones(16).bfloat16()])


def grad_aliases_weight(mode, gen):
    """The second parameter's gradient is a view of the first weight, which the step writes."""
    params = standard(gen)
    inner = plain_grads(params)

    def grads(step):
        out = inner(step)
        out[1] = params[0].detach().view(-1)[:300]
        return out
    return Scenario(params, grads, reference=False)


def nan_grads_unchecked(mode, gen):
    params = standard(gen)
    inner = plain_grads(params)

    def grads(step):
        out = inner(step)
        out[0].view(-1)[5 + step] = float("nan")
        out[1][7] = float("inf")
        return out
    return Scenario(params, grads, options=dict(nonfinite="off"), steps=3)


def subclass_param(mode, gen):
    from torch.testing._internal.two_tensor import TwoTensor

    a = bf16((16,), gen)
    params = [TwoTensor(a, a.clone()), bf16((8,), gen)]
    return Scenario(params, lambda step: [TwoTensor(torch.ones(16).bfloat16(), torch.ones(16).bfloat16()),
                                          torch.ones(8).bfloat16()])


def dtensor_param(mode, gen):
    """A DTensor parameter, as under FSDP2's ``fully_shard`` (its ``data_ptr()`` is 0), on a
    one-process gloo group."""
    import tempfile

    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    if not dist.is_initialized():
        store = tempfile.NamedTemporaryFile(prefix="lowp-gloo-", delete=False).name
        dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    mesh = init_device_mesh("cpu", (1,))
    params = [torch.nn.Parameter(distribute_tensor(bf16((64, 8), gen), mesh, [Shard(0)])), bf16((16,), gen)]
    return Scenario(params, lambda step: [distribute_tensor(torch.ones(64, 8).bfloat16(), mesh, [Shard(0)]),
                                          torch.ones(16).bfloat16()])


def dtensor_param_unchecked(mode, gen):
    """The same without the non-finite check (the reference check of the compiled backend
    cannot stack DTensors with plain tensors)."""
    scenario = dtensor_param(mode, gen)
    scenario.options = dict(nonfinite="off")
    return scenario


CASES: dict[str, Callable[[str, torch.Generator], Scenario]] = {f.__name__: f for f in [
    offset_views, transposed, expanded_grad, expanded_param, empty_and_single, shared_storage,
    grad_views_of_one_buffer, grad_fp32, grad_fp64, grad_smaller, grad_reshaped, grad_strided, grad_negative_view,
    grad_storage_freed, grad_storage_freed_unchecked, param_storage_freed, param_misaligned, param_fp64,
    buffer_deleted, mode_switched, state_missing, state_extra, state_fp64, state_integer, state_wrong_size,
    state_strided, buffer_fp64, nan_grads_unchecked, subclass_param, dtensor_param, dtensor_param_unchecked,
    coded_int8, coded_fp8, coded_noncontiguous, coded_scales_missing, coded_scales_fp64, coded_codes_short,
    param_twice, grad_aliases_weight]}


# ---- running and comparing ---------------------------------------------------------------------
def tensors_of(params, opt) -> list[torch.Tensor]:
    """Every weight and state tensor, in a fixed order."""
    out = []
    for p in params:
        out.append(p)
        state = opt.state.get(p, {})
        out += [state[k] for k in sorted(state) if isinstance(state[k], torch.Tensor)]
    return out


def readable(t: torch.Tensor) -> bool:
    """A plain tensor whose memory is there to compare (not freed, not a subclass)."""
    return type(t) in (torch.Tensor, torch.nn.Parameter) and (t.numel() == 0 or t.untyped_storage().nbytes() > 0)


def untouched(before: dict[int, tuple[torch.Tensor, torch.Tensor | None]], after: list[torch.Tensor]) -> bool:
    """The tensors that existed before a failed step hold the same bits, and the ones it created
    (states of a first step) are still zero."""
    for t in after:
        if id(t) in before:
            kept = before[id(t)][1]
            if kept is not None and not same_bits(t, kept):
                return False
        elif readable(t) and t.is_floating_point() and bool(t.detach().ne(0).any()):
            return False
    return True


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if not a.is_floating_point():
        return torch.equal(a, b)
    nan = a.isnan()
    return torch.equal(nan, b.isnan()) and torch.equal(a[~nan], b[~nan])


def within_rounding(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Floating-point values two units of their dtype's last place apart, relative to the largest
    value of the tensor (a Kahan buffer holds what the weight could not: a weight one ulp off moves
    it by about that much); remainders within 256 fp32 ulps (int8 ones: one unit, 256 ulps); other
    tensors bit for bit."""
    if a.dtype != b.dtype or a.shape != b.shape:
        return False
    if a.dtype == torch.int16:   # an exact-mode remainder: the low 16 bits of the fp32 master weight
        return bool(((a.int() - b.int()).abs() <= 256).all())
    if a.dtype == torch.int8:    # an exact8-mode remainder: bits 8 to 15 of the pair
        return bool(((a.int() - b.int()).abs() <= 1).all())
    if not a.is_floating_point():
        return same_bits(a, b)
    scale = float(b.double().abs().nan_to_num(posinf=0, neginf=0).max()) if b.numel() else 0.0
    return bool(torch.isclose(a.double(), b.double(), rtol=0, atol=2 * torch.finfo(a.dtype).eps * scale,
                              equal_nan=True).all())


def within_one_ulp(a: torch.Tensor, b: torch.Tensor) -> bool:
    """bf16 values one step apart at most (stochastic rounding picks either neighbour)."""
    if a.dtype != torch.bfloat16:
        return same_bits(a, b)
    nan = a.isnan()
    if a.shape != b.shape or not torch.equal(nan, b.isnan()):
        return False
    ia, ib = a[~nan].view(torch.int16).int(), b[~nan].view(torch.int16).int()
    return bool(((ia - ib).abs() <= 1).all())


def run(optimizer: str, mode: str, case: str, backend: str) -> tuple[str, Any]:
    """``("worked", tensors)`` or ``("raised", (exception, tensors untouched?))``."""
    opt_class, kw = OPTIMIZERS[optimizer]
    scenario = CASES[case](mode, torch.Generator().manual_seed(3))
    # stochastic rounding draws other bits on each backend: the steps before the last round to
    # nearest, so the last one starts from the same weights and lands within one ulp
    before = {id(t): (t, t.detach().clone() if readable(t) else None) for t in scenario.params}
    try:   # the constructor may refuse what no step could write (an expanded parameter)
        opt = opt_class(scenario.params, backend=backend, mode="nearest" if mode == "stochastic" else mode, seed=1,
                        state_rounding="nearest", **{**kw, **scenario.options})
    except (TypeError, ValueError) as e:
        return "raised", (e, untouched(before, list(scenario.params)))
    for step in range(scenario.steps):
        for p, g in zip(scenario.params, scenario.grads(step)):
            set_grad(p, g)
        if step == scenario.steps - 1:
            opt.param_groups[0]["mode"] = mode
        scenario.tamper(opt, step)
        before = {id(t): (t, t.detach().clone() if readable(t) else None) for t in tensors_of(scenario.params, opt)}
        try:
            opt.step()
        except Exception as e:  # noqa: BLE001 - every error is judged by the caller
            return "raised", (e, untouched(before, tensors_of(scenario.params, opt)))
    return "worked", [t.detach().clone() if readable(t) else t for t in tensors_of(scenario.params, opt)]


def judge(optimizer: str, mode: str, case: str, backend: str) -> str:
    """The outcome of one case on ``backend`` against the reference; AssertionError when wrong."""
    outcome, value = run(optimizer, mode, case, backend)
    if outcome == "raised":
        error, unchanged = value
        message = f"{type(error).__name__}: {error}"
        assert any(re.search(rf"\b{name}\b", str(error)) for name in ARGUMENTS), f"names no argument: {message}"
        assert unchanged, f"tensors changed before {message}"
        return f"raised {message.splitlines()[0][:150]}"
    scenario = CASES[case](mode, torch.Generator().manual_seed(3))
    assert scenario.reference, "worked on input the reference cannot read"
    ref_outcome, ref = run(optimizer, mode, case, "foreach")
    assert ref_outcome == "worked", f"the reference raised {ref[0]!r} where {backend} worked"
    assert len(ref) == len(value), "different state entries"
    # StableAdamW's RMS clip takes an fp64 sum in the kernel and torch's fp32 mean in the
    # reference: its learning rate may differ in the last bits (docs/fused.md)
    compare = within_one_ulp if mode == "stochastic" else within_rounding if optimizer == "StableAdamW" else same_bits
    for i, (a, b) in enumerate(zip(value, ref)):
        if readable(a):
            assert compare(a, b), f"tensor {i} differs from the reference"
    return "worked"


def main(ids: list[str]) -> None:
    for ident in ids:
        backend, optimizer, mode, case = ident.split(":")
        print("CASE", ident, flush=True)
        try:
            print("DONE", ident, judge(optimizer, mode, case, backend), flush=True)
        except Exception as e:  # noqa: BLE001 - reported to the parent
            print("FAIL", ident, f"{type(e).__name__}: {e}".replace("\n", " | ")[:600], flush=True)
            traceback.print_exc()


if __name__ == "__main__":
    torch.set_num_threads(2)
    os.environ.setdefault("LOWP_FUSED", "0")
    main(sys.argv[1:])
