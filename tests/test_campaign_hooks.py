"""Robustness campaign for DDP comm hooks (lowp.distributed.hooks) and gradient release
(lowp.optim.release): bad inputs as a new user or an attacker would pass them.

Every case is a code snippet with an expected outcome: ``"ok"`` (it works like the reference,
which the snippet asserts) or an exception type and a regex of its message (an error that names
the argument or object at fault and what was expected). An atomic case must leave every object
its setup made unchanged when it raises: weights, optimizer state dicts and counters, release
handles, hook states, GradScalers, the hooks on parameters. A failure inside a stepping backward
pass under release cannot be atomic (the parameters reached before it have been stepped and their
gradients freed; docs/optimizers.md): those cases check instead what must hold (the parameters
not reached are unchanged, the handle works on the next pass).

The cases run in child processes (tests/campaign_hooks_worker.py) that name each case before
running it, so a process death (a signal, an abort inside gloo) or a hang is attributed to its
case; after one, the cases not yet started run in a fresh child. Kinds: ``local`` (no process
group), ``group1`` (a one-rank gloo group), ``ddp`` (two gloo ranks on 127.0.0.1 launched by
:func:`lowp.distributed.launch.run_local_group`, as tests/test_ddp.py does; per-rank
expectations are a list). ``alone`` cases leave a process group unusable (a rank raising while the
other waits in a collective) and get a launch of their own.

A case with ``known=`` still fails for want of a change outside lowp/distributed/hooks.py and
lowp/optim/release.py (the reason says which); it must keep failing until then, like a strict
xfail. The default run covers a sample (``sample=True``) in one child process; ``-m slow`` runs all.
``python tests/test_campaign_hooks.py [NAME...]`` prints each case's outcome.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any, NamedTuple

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "campaign_hooks_worker.py"
#: process-group timeout of the two-rank launches
GROUP_TIMEOUT_S = 30.0
OK = "ok"


class Case(NamedTuple):
    """One probe (module docstring). ``expect``: ``"ok"``, ``(exception type, regex)``, or for
    ``ddp`` a list of those by rank; ``after`` runs whatever the outcome, ``error`` bound.
    ``known``: why the case still fails (a change outside the two modules probed); it must fail
    until then, like a strict xfail."""

    name: str
    kind: str
    setup: str
    action: str
    expect: Any = OK
    after: str = ""
    atomic: bool = True
    sample: bool = False
    alone: bool = False
    known: str = ""


# ---- gradient release ----------------------------------------------------------------------------
NET = "net, opt = make()"
REF = "net, opt = make(); ref = make()"


def _arg(name: str, call: str, error: type, pattern: str, sample: bool = False, setup: str = NET) -> Case:
    return Case(name, "local", setup, call, (error, pattern), sample=sample)


STEPS = r"^accumulation_steps: expected an int >= 1, got "
RELEASE_ARGS = [
    _arg("optimizer_none", "release_gradients(None)", TypeError, r"^optimizer: expected a lowp optimizer", True),
    _arg("optimizer_torch_sgd", "release_gradients(torch.optim.SGD(net.parameters(), lr=0.1))", TypeError,
         r"^optimizer: .*got SGD"),
    _arg("optimizer_string", "release_gradients('adamw')", TypeError, r"^optimizer: .*got str"),
    _arg("optimizer_module", "release_gradients(net)", TypeError, r"^optimizer: .*got Sequential"),
    _arg("optimizer_class", "release_gradients(lo.AdamW)", TypeError, r"^optimizer: "),
    _arg("steps_none", "release_gradients(opt, accumulation_steps=None)", ValueError, STEPS + "None"),
    _arg("steps_bool", "release_gradients(opt, accumulation_steps=True)", ValueError, STEPS + "True", True),
    _arg("steps_zero", "release_gradients(opt, accumulation_steps=0)", ValueError, STEPS + "0"),
    _arg("steps_negative", "release_gradients(opt, accumulation_steps=-3)", ValueError, STEPS + "-3"),
    _arg("steps_float", "release_gradients(opt, accumulation_steps=2.0)", ValueError, STEPS + "2.0"),
    _arg("steps_nan", "release_gradients(opt, accumulation_steps=float('nan'))", ValueError, STEPS + "nan"),
    _arg("steps_inf", "release_gradients(opt, accumulation_steps=float('inf'))", ValueError, STEPS + "inf"),
    _arg("steps_string", "release_gradients(opt, accumulation_steps='2')", ValueError, STEPS + "'2'"),
    _arg("steps_float_tensor", "release_gradients(opt, accumulation_steps=torch.tensor(2.0))", ValueError, STEPS),
    _arg("scaler_object", "release_gradients(opt, scaler=object())", TypeError,
         r"^scaler: expected a torch.amp.GradScaler or None, got object", True),
    _arg("scaler_string", "release_gradients(opt, scaler='cpu')", TypeError, r"^scaler: .*got str"),
    _arg("local_gradients_none", "release_gradients(opt, local_gradients=None)", TypeError,
         r"^local_gradients: expected a bool, got NoneType"),
    _arg("local_gradients_int", "release_gradients(opt, local_gradients=1)", TypeError, r"^local_gradients: .*int"),
    _arg("local_gradients_string", "release_gradients(opt, local_gradients='yes')", TypeError,
         r"^local_gradients: .*str"),
    _arg("unknown_keyword", "release_gradients(opt, steps=2)", TypeError, r"unexpected keyword argument 'steps'"),
    _arg("constructor_direct", "GradientRelease(opt, 0)", ValueError, STEPS + "0"),
    _arg("nonfinite_skip_step", "release_gradients(opt)", ValueError, r"^nonfinite: 'skip_step' cannot",
         setup="net, opt = make(nonfinite='skip_step')"),
    _arg("all_frozen_at_registration", "release_gradients(opt)", ValueError,
         r"^optimizer: none of its parameters requires grad", True, setup=NET + "\nnet.requires_grad_(False)"),
    _arg("meta_parameters", "release_gradients(opt)", ValueError, r"^params\[0\]: on the meta device",
         setup="net = torch.nn.Linear(4, 2, device='meta'); opt = lo.AdamW(net.parameters(), lr=1e-2)"),
    _arg("released_twice", "release_gradients(opt)", RuntimeError, r"^optimizer: its gradients are released already",
         True, setup=NET + "\nh = release_gradients(opt)"),
]

RELEASE_RUNS = [
    Case("steps_numpy_int", "local", REF, """
h = release_gradients(opt, accumulation_steps=np.int64(2))
assert h.accumulation_steps == 2 and type(h.accumulation_steps) is int
train(net, opt, 2, k=2); h.remove(); train(*ref, 2, k=2); same((net, opt), ref)"""),
    Case("steps_huge", "local", REF, """
h = release_gradients(opt, accumulation_steps=2**70)
for t in range(3):
    loss(net, t).backward()
assert all(p not in opt.state for p in net.parameters())
h.remove(); opt.step()
train(*ref, 1, k=3); same((net, opt), ref)"""),
    Case("scaler_disabled", "local", REF + "\nscaler = torch.amp.GradScaler('cpu', enabled=False)", """
h = release_gradients(opt, scaler=scaler)
for t in range(2):
    scaler.scale(loss(net, t)).backward(); scaler.step(opt); scaler.update(); opt.zero_grad()
h.remove(); train(*ref, 2); same((net, opt), ref)""", sample=True),
    Case("scaler_never_scaled", "local", NET + "\nscaler = torch.amp.GradScaler('cpu')\n"
         "h = release_gradients(opt, scaler=scaler)",
         "loss(net).backward()", (ValueError, r"^scaler: it has not scaled a loss yet"), sample=True),
    Case("scaler_nan_scale", "local", NET + "\nscaler = torch.amp.GradScaler('cpu')\nscaler.scale(torch.ones(()))\n"
         "scaler.update(new_scale=float('nan'))\nh = release_gradients(opt, scaler=scaler)",
         "scaler.scale(loss(net)).backward()", (ValueError, r"^scaler: its scale is nan; expected a finite")),
    Case("scaler_zero_scale", "local", NET + "\nscaler = torch.amp.GradScaler('cpu')\nscaler.scale(torch.ones(()))\n"
         "scaler.update(new_scale=0.0)\nh = release_gradients(opt, scaler=scaler)",
         "scaler.scale(loss(net)).backward()", (ValueError, r"^scaler: its scale is 0.0; expected a finite")),
    Case("released_twice_first_still_steps_once", "local", REF + "\nh = release_gradients(opt)", """
try:
    release_gradients(opt)
except RuntimeError:
    pass
train(net, opt, 2); train(*ref, 2); same((net, opt), ref)"""),
    Case("remove_twice", "local", REF, """
h = release_gradients(opt); train(net, opt, 1); h.remove(); h.remove()
assert not h.active and opt._released_by is None
train(net, opt, 1, start=1); train(*ref, 2); same((net, opt), ref)"""),
    Case("stale_handle_remove_keeps_new_one", "local", REF, """
h1 = release_gradients(opt); h1.remove(); h2 = release_gradients(opt); h1.remove()
assert h2.active
train(net, opt, 2); h2.remove(); train(*ref, 2); same((net, opt), ref)"""),
    Case("context_manager_exception", "local", NET, """
with release_gradients(opt) as h:
    raise KeyError('inside the block')""", (KeyError, "inside the block"),
         after="assert not h.active and opt._released_by is None"),
    Case("frozen_mid_training", "local", REF, """
h = release_gradients(opt)
for n, o in ((net, opt), ref):
    train(n, o, 1); n[0].weight.requires_grad_(False); train(n, o, 2)
h.remove(); same((net, opt), ref)"""),
    Case("unfrozen_mid_training", "local", REF + "\nnet[0].weight.requires_grad_(False)", """
h = release_gradients(opt)
ref[0][0].weight.requires_grad_(False)
for n, o in ((net, opt), ref):
    train(n, o, 1); n[0].weight.requires_grad_(True); train(n, o, 2)
h.remove(); same((net, opt), ref)"""),
    Case("params_not_in_optimizer", "local", """
torch.manual_seed(0)
a = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2)); b = copy.deepcopy(a)
oa = lo.AdamW(a[2].parameters(), lr=1e-2, seed=5); ob = lo.AdamW(b[2].parameters(), lr=1e-2, seed=5)""", """
h = release_gradients(oa)
train(a, oa, 2); train(b, ob, 2); h.remove()
assert_nested_equal(a.state_dict(), b.state_dict()); assert_nested_equal(oa.state_dict(), ob.state_dict())
assert torch.equal(a[0].weight.grad, b[0].weight.grad)"""),
    Case("backward_outside_the_optimizer", "local", NET + "\nother = make()", """
h = release_gradients(opt)
loss(other[0]).backward()
assert h.backward_passes == 0 and not opt.state"""),
    Case("param_removed_from_optimizer", "local", REF, """
h = release_gradients(opt)
for o in (opt, ref[1]):
    o.param_groups[0]['params'].pop(0)
train(net, opt, 2); train(*ref, 2); h.remove(); same((net, opt), ref)
assert torch.equal(net[0].weight.grad, ref[0][0].weight.grad)"""),
    Case("step_and_zero_grad_while_released", "local", REF + "\nh = release_gradients(opt)", """
loss(net).backward(); opt.step(); opt.step(); opt.zero_grad(); opt.step()
train(*ref, 1); same((net, opt), ref)"""),
    Case("scaler_not_given_to_release", "local", NET + "\nscaler = torch.amp.GradScaler('cpu')\n"
         "h = release_gradients(opt)",
         "scaler.scale(loss(net)).backward(); scaler.step(opt); scaler.update()",
         (ValueError, r"^scaler: "), atomic=False),
    Case("step_closure_raises", "local", NET + "\nh = release_gradients(opt)\n"
         "def closure():\n    raise ValueError('closure failed')",
         "opt.step(closure)", (ValueError, "closure failed")),
    Case("state_dict_while_released", "local", REF + "\nh = release_gradients(opt)", """
train(net, opt, 2); train(*ref, 2)
assert_nested_equal(opt.state_dict(), ref[1].state_dict())"""),
    Case("load_state_dict_while_released", "local", REF + "\nh = release_gradients(opt)", """
train(*ref, 2)
net.load_state_dict(ref[0].state_dict()); opt.load_state_dict(copy.deepcopy(ref[1].state_dict()))
train(net, opt, 2, start=2); train(*ref, 2, start=2); same((net, opt), ref)"""),
    Case("load_bad_state_dict_while_released", "local", NET + "\nh = release_gradients(opt)\ntrain(net, opt, 1)",
         "opt.load_state_dict({'state': {}, 'param_groups': []})", (ValueError, r"^state_dict: ")),
    Case("loss_raises_in_backward", "local", NET + "\nh = release_gradients(opt)",
         "boom(loss(net)).backward()", (ValueError, "boom in backward"),
         after="train(net, opt, 1); ref = make(); train(*ref, 1); same((net, opt), ref)"),
    Case("user_hook_raises_mid_backward", "local", NET + "\nh = release_gradients(opt)\n"
         "def fail(grad):\n    raise ValueError('user hook failed')",
         "staged(net, 0, fail).backward()", (ValueError, "user hook failed"), atomic=False, sample=True, after="""
assert steps_of(opt, net[2].weight) == 1 and steps_of(opt, net[0].weight) == 0 and net[0].weight.grad is None
assert h.backward_passes == 0
train(net, opt, 1)
assert h.backward_passes == 1 and steps_of(opt, net[0].weight) == 1 and steps_of(opt, net[2].weight) == 2"""),
    Case("keyboard_interrupt_mid_backward", "local", NET + "\nh = release_gradients(opt, accumulation_steps=2)\n"
         "def interrupt(grad):\n    raise KeyboardInterrupt", "staged(net, 0, interrupt).backward()",
         (KeyboardInterrupt, ""), atomic=False, after="""
assert h.backward_passes == 0 and not opt.state
train(net, opt, 1, k=2)
assert h.backward_passes == 2 and all(steps_of(opt, p) == 1 for p in net.parameters())"""),
    Case("sigint_mid_backward", "local", NET + "\nimport signal\n"
         "signal.signal(signal.SIGINT, signal.default_int_handler)\nh = release_gradients(opt)\n"
         "def interrupt(grad):\n    signal.raise_signal(signal.SIGINT)",
         "staged(net, 0, interrupt).backward()", (KeyboardInterrupt, ""), atomic=False, after="""
assert steps_of(opt, net[2].weight) == 1 and steps_of(opt, net[0].weight) == 0
train(net, opt, 1)
assert h.backward_passes == 1 and steps_of(opt, net[0].weight) == 1"""),
    Case("sparse_gradient", "local", "emb = torch.nn.Embedding(5, 3, sparse=True)\n"
         "opt = lo.AdamW(emb.parameters(), lr=1e-2)\nh = release_gradients(opt)",
         "emb(torch.tensor([1, 2])).sum().backward()", (TypeError, r"^grad of params\[0\]: sparse gradients"),
         after="assert h.backward_passes == 0"),
    Case("zero_element_parameter", "local", """
def build():
    net, opt = make(); z = torch.nn.Parameter(torch.zeros(0, 3)); opt.add_param_group({'params': [z]})
    return net, opt, z
a, b = build(), build()""", """
h = release_gradients(a[1])
for t in range(2):
    for n, o, z in (a, b):
        (loss(n, t) + z.sum()).backward(); o.step(); o.zero_grad()
h.remove(); same(a[:2], b[:2])"""),
    Case("only_zero_element_parameter", "local", """
z = torch.nn.Parameter(torch.zeros(0)); opt = lo.AdamW([z], lr=1e-2)
h = release_gradients(opt)""", """
z.sum().backward(); opt.step()
assert z.grad is None and steps_of(opt, z) == 1 and h.backward_passes == 1"""),
    Case("transposed_parameter", "local", """
def build():
    torch.manual_seed(0); w = torch.nn.Parameter(torch.randn(4, 3).t()); return w, lo.AdamW([w], lr=1e-2, seed=5)
a, b = build(), build()
assert not a[0].is_contiguous()""", """
h = release_gradients(a[1])
for t in range(2):
    for w, o in (a, b):
        (w @ batch(t).t()).square().mean().backward(); o.step(); o.zero_grad()
h.remove()
assert torch.equal(a[0], b[0]) and a[0].stride() == b[0].stride()
assert_nested_equal(a[1].state_dict(), b[1].state_dict())"""),
    Case("non_contiguous_gradient_from_a_hook", "local", REF, """
h = release_gradients(opt)
for n, o in ((net, opt), ref):
    n[0].weight.register_hook(lambda g: g.t().contiguous().t())
    train(n, o, 2)
h.remove(); same((net, opt), ref)"""),
    Case("overlapping_gradient_set_by_hand", "local", NET + "\nh = release_gradients(opt)\n"
         "net[0].bias.grad = torch.zeros(1).expand(8)", "loss(net).backward()",
         (ValueError, r"^grad of params\[1\]: its elements overlap in memory")),
    Case("sparse_gradient_with_accumulation", "local", """
emb = torch.nn.Embedding(5, 4, sparse=True); lin = torch.nn.Linear(4, 2)
opt = lo.AdamW([*emb.parameters(), *lin.parameters()], lr=1e-2)
h = release_gradients(opt, accumulation_steps=2)
lin(emb(torch.tensor([1, 2]))).sum().backward()""", "lin(emb(torch.tensor([1, 3]))).sum().backward()",
         (TypeError, r"^grad of params\[0\]: sparse gradients are not supported"), sample=True),
    Case("bf16_stochastic_and_nan_gradient", "local", """
def build():
    net, opt = make(torch.bfloat16, mode='stochastic'); return net, opt
a, b = build(), build()""", """
h = release_gradients(a[1])
for n, o in (a, b):
    train(n, o, 1)
    n[2].weight.register_hook(lambda g: g * float('nan'))
    train(n, o, 1, start=1)
h.remove(); same(a, b)
assert a[1].skipped_params == b[1].skipped_params == 1"""),
    # hooks that step every 2nd pass under a loop that steps every 3rd: refused at the loop's first
    # step (it would otherwise drop a pass's gradient at each zero_grad), the hooks' step kept
    Case("accumulation_mismatch_with_the_loop", "local", NET, """
h = release_gradients(opt, accumulation_steps=2)
for t in range(3):
    loss(net, t).backward()
opt.step()""", (ValueError, r"^accumulation_steps: optimizer.step\(\) came after 3 backward passes since "
                r"release_gradients, but the hooks were registered with accumulation_steps=2"), atomic=False),
    Case("retain_graph_two_passes", "local", REF, """
h = release_gradients(opt, accumulation_steps=2)
for n in (net, ref[0]):
    l = loss(n); l.backward(retain_graph=True); l.backward()
ref[1].step(); same((net, opt), ref)"""),
    Case("autograd_grad_does_not_step", "local", NET + "\nh = release_gradients(opt)", """
torch.autograd.grad(loss(net), list(net.parameters()))
assert h.backward_passes == 0 and not opt.state"""),
    Case("remove_inside_backward", "local", REF, """
h = release_gradients(opt)
net[0].weight.register_hook(lambda g: h.remove())
loss(net).backward(); opt.step(); opt.zero_grad()
train(*ref, 1); same((net, opt), ref)"""),
    Case("create_graph_backward", "local", REF, """
h = release_gradients(opt)
for n, o in ((net, opt), ref):
    loss(n).backward(create_graph=True); o.step(); o.zero_grad(set_to_none=True)
same((net, opt), ref)"""),
]

# ---- DDP comm hooks: the state and the bucket ----------------------------------------------------
RS = "from lowp.distributed.hooks import *\nfrom lowp.distributed import hooks"


def _state(name: str, kw: str, error: type | None, pattern: str = "", sample: bool = False) -> Case:
    return Case(name, "local", RS, f"state = ReduceState({kw})", OK if error is None else (error, pattern),
                sample=sample)


DTYPES = r"expected torch.bfloat16, torch.float16 or torch.float32"
STATE_ARGS = [
    _state("wire_dtype_string", "wire_dtype='bf16'", ValueError, r"^wire_dtype: " + DTYPES + ", got bf16", True),
    _state("wire_dtype_none", "wire_dtype=None", ValueError, r"^wire_dtype: " + DTYPES + ", got None"),
    _state("wire_dtype_int8", "wire_dtype=torch.int8", ValueError, r"^wire_dtype: .*got torch.int8"),
    _state("wire_dtype_float64", "wire_dtype=torch.float64", ValueError, r"^wire_dtype: .*got torch.float64"),
    _state("gather_dtype_string", "gather_dtype='fp32'", ValueError, r"^gather_dtype: .*got fp32"),
    _state("gather_dtype_int32", "gather_dtype=torch.int32", ValueError, r"^gather_dtype: .*got torch.int32"),
    _state("seed_none", "seed=None", ValueError, r"^seed: expected an int, got None", True),
    _state("seed_float", "seed=1.5", ValueError, r"^seed: expected an int, got 1.5"),
    _state("seed_nan", "seed=float('nan')", ValueError, r"^seed: expected an int, got nan"),
    _state("seed_bool", "seed=True", ValueError, r"^seed: expected an int, got True"),
    _state("seed_string", "seed='3'", ValueError, r"^seed: expected an int, got '3'"),
    _state("seed_negative", "seed=-1", None),
    _state("seed_huge", "seed=2**100", None),
    _state("seed_numpy", "seed=np.int64(3)", None),
    _state("calls_negative", "calls=-1", ValueError, r"^calls: expected an int >= 0, got -1"),
    _state("calls_none", "calls=None", ValueError, r"^calls: expected an int >= 0, got None"),
    _state("calls_float", "calls=2.5", ValueError, r"^calls: expected an int >= 0, got 2.5"),
    _state("calls_bool", "calls=True", ValueError, r"^calls: expected an int >= 0, got True"),
    _state("collect_stats_string", "collect_stats='yes'", ValueError, r"^collect_stats: expected True or False"),
    _state("collect_stats_none", "collect_stats=None", ValueError, r"^collect_stats: expected True or False"),
    _state("stats_none", "stats=None", TypeError, r"^stats: expected a dict, got NoneType"),
    _state("stats_list", "stats=[]", TypeError, r"^stats: expected a dict, got list"),
    _state("process_group_string", "process_group='world'", TypeError,
           r"^process_group: expected a torch.distributed.ProcessGroup or None, got str", True),
    _state("process_group_int", "process_group=0", TypeError, r"^process_group: .*got int"),
    Case("hook_without_a_process_group", "local", RS + "\nstate = ReduceState()",
         "fp32_reduce_hook(state, FakeBucket(torch.ones(3)))",
         (RuntimeError, r"^process_group: None means torch.distributed's default group, which is not initialized"),
         sample=True),
]

G1 = RS + "\nx = torch.arange(-8, 8, dtype=torch.float32) * 0.25"
#: a module whose only parameter has no elements, and one pass of every hook over it
EMPTY = """
class Empty(torch.nn.Module):
    def __init__(self):
        super().__init__(); self.w = torch.nn.Parameter(torch.zeros(0))
    def forward(self, x):
        return x + self.w.sum()"""
EMPTY_STEP = """
for name, hook in HOOKS.items():
    state = ReduceState(collect_stats=True)
    got = ddp_grads(Empty(), torch.ones(2, requires_grad=True), hook, state)
    assert got[0].shape == (0,) and state.stats == {}"""


def _bucket(name: str, buffer: str, error: type | None, pattern: str = "", check: str = "",
            sample: bool = False, hook_names: str = "HOOKS") -> Case:
    loop = (f"for name, hook in {hook_names}.items():\n"
            f"    state = ReduceState(collect_stats=True)\n"
            f"    out = hook(state, FakeBucket({buffer})).wait()\n")
    action = loop + "".join(f"    {line}\n" for line in check.strip().splitlines())
    return Case(name, "group1", G1, action, OK if error is None else (error, pattern), sample=sample)


BUCKETS = [
    Case("state_none", "group1", G1, "ddp_grads(torch.nn.Linear(4, 2), torch.ones(3, 4), fp32_reduce_hook, None)",
         (TypeError, r"^state: expected a lowp.distributed.hooks.ReduceState, got NoneType"), sample=True),
    Case("state_object", "group1", G1, "fp32_reduce_hook(object(), FakeBucket(x))",
         (TypeError, r"^state: expected a lowp.distributed.hooks.ReduceState, got object")),
    Case("state_dict_instead", "group1", G1, "alltoall_fp32_hook({'wire_dtype': torch.bfloat16}, FakeBucket(x))",
         (TypeError, r"^state: .*got dict")),
    Case("state_seed_changed_later", "group1", G1 + "\nstate = ReduceState()\nstate.seed = 'x'",
         "ddp_grads(torch.nn.Linear(4, 2), torch.ones(3, 4), stochastic_rounding_hook, state)",
         (ValueError, r"^state.seed: expected an int, got 'x'"), sample=True),
    Case("state_wire_dtype_changed_later", "group1", G1 + "\nstate = ReduceState()\nstate.wire_dtype = torch.int8",
         "alltoall_fp32_hook(state, FakeBucket(x))", (ValueError, r"^state.wire_dtype: .*got torch.int8")),
    Case("state_calls_changed_later", "group1", G1 + "\nstate = ReduceState()\nstate.calls = -5",
         "stochastic_rounding_hook(state, FakeBucket(x))", (ValueError, r"^state.calls: expected an int >= 0")),
    Case("state_stats_changed_later", "group1", G1 + "\nstate = ReduceState(collect_stats=True)\nstate.stats = None",
         "fp32_reduce_hook(state, FakeBucket(x))", (TypeError, r"^state.stats: expected a dict")),
    Case("bucket_tensor", "group1", G1, "fp32_reduce_hook(ReduceState(), x)",
         (TypeError, r"^bucket: expected a torch.distributed.GradBucket .*got Tensor"), sample=True),
    Case("bucket_none", "group1", G1, "sum_then_divide_hook(ReduceState(), None)",
         (TypeError, r"^bucket: .*got NoneType")),
    Case("bucket_buffer_not_a_tensor", "group1", G1, "alltoall_fp32_hook(ReduceState(), FakeBucket([1.0, 2.0]))",
         (TypeError, r"^bucket: its buffer\(\) is a list, expected a tensor")),
    _bucket("bucket_int32", "x.int()", TypeError,
            r"^bucket: gradients of dtype torch.int32; \w+ reduces torch.bfloat16, torch.float16, torch.float32"),
    _bucket("bucket_bool", "x > 0", TypeError, r"^bucket: gradients of dtype torch.bool"),
    _bucket("bucket_complex", "x.to(torch.complex64)", TypeError, r"^bucket: gradients of dtype torch.complex64"),
    _bucket("bucket_meta", "x.to('meta')", TypeError, r"^bucket: on the meta device"),
    _bucket("bucket_sparse_alltoall", "x.to_sparse()", TypeError, r"^bucket: a sparse gradient",
            hook_names="{'a': alltoall_fp32_hook, 's': stochastic_rounding_hook}"),
    _bucket("bucket_two_dimensional", "x.view(4, 4)", None, check="assert torch.equal(out, x.view(4, 4)), name"),
    _bucket("bucket_non_contiguous", "x.view(4, 4).t()", None,
            check="assert torch.equal(out, x.view(4, 4).t()), name"),
    _bucket("bucket_empty_with_stats", "x[:0]", None, sample=True,
            check="assert out.shape == (0,) and state.stats == {} and state.calls == 1, name"),
    _bucket("bucket_float16", "x.half()", None,
            check="assert out.dtype == torch.float16 and torch.equal(out, x.half()), name"),
    _bucket("bucket_bfloat16", "x.bfloat16()", None, check="assert torch.equal(out, x.bfloat16()), name"),
    _bucket("bucket_float64_exact_values", "x.double()", None, check="assert torch.equal(out, x.double()), name"),
    Case("bucket_float64_fp32_hook_keeps_fp64", "group1", G1 + "\ny = x.double() + 1e-12",
         "out = fp32_reduce_hook(ReduceState(), FakeBucket(y)).wait()\nassert torch.equal(out, y)", sample=True),
    _bucket("bucket_nonfinite", "torch.tensor([float('nan'), float('inf'), -float('inf'), 1.0])", None, check="""
assert torch.equal(out.isnan(), torch.tensor([True, False, False, False])), name
assert out[1] == float('inf') and out[2] == -float('inf') and out[3] == 1.0, name
assert math.isnan(state.stats[0].mean_rms), name"""),
    _bucket("bucket_huge_values", "torch.full((4,), 3e38)", None,
            check="assert out.dtype == torch.float32 and not out.isnan().any(), name"),
    Case("calls_past_2_to_40", "group1", G1 + "\nstate = ReduceState(calls=2**40 + 5)",
         "out = stochastic_rounding_hook(state, FakeBucket(x)).wait()\n"
         "assert torch.equal(out, x) and state.calls == 2**40 + 6"),
    Case("non_ddp_module", "group1", G1, "torch.nn.Linear(2, 2).register_comm_hook(ReduceState(), fp32_reduce_hook)",
         (AttributeError, r"'Linear' object has no attribute 'register_comm_hook'")),
    Case("register_twice", "group1", G1 + "\nfrom torch.nn.parallel import DistributedDataParallel as DDP\n"
         "ddp = DDP(torch.nn.Linear(4, 2))\nddp.register_comm_hook(ReduceState(), fp32_reduce_hook)",
         "ddp.register_comm_hook(ReduceState(), alltoall_fp32_hook)", (RuntimeError, r"can only be called once")),
    Case("ddp_world1_every_hook_and_dtype", "group1", G1, """
for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
    for name, hook in HOOKS.items():
        torch.manual_seed(0); m = torch.nn.Linear(4, 3).to(dtype); ref = copy.deepcopy(m)
        inp = (torch.arange(12.).view(3, 4) / 4).to(dtype)
        got = ddp_grads(m, inp, hook, ReduceState(collect_stats=True))
        want = ddp_grads(ref, inp)
        for g, w in zip(got, want):
            assert g.dtype == w.dtype, (name, dtype)
            exact = name == 'fp32' or dtype in (torch.bfloat16, torch.float16)
            assert torch.equal(g, w) if exact else torch.equal(g, w.to(torch.bfloat16).to(dtype)), (name, dtype)"""),
    Case("ddp_world1_sparse_embedding", "group1", G1, """
for name, hook in (('fp32', fp32_reduce_hook), ('sum_then_divide', sum_then_divide_hook)):
    for stats in (False, True):
        torch.manual_seed(0); e = torch.nn.Embedding(5, 3, sparse=True); ref = copy.deepcopy(e)
        got = ddp_grads(e, torch.tensor([1, 2, 2]), hook, ReduceState(collect_stats=stats))
        want = ddp_grads(ref, torch.tensor([1, 2, 2]))
        assert torch.equal(got[0].to_dense(), want[0].to_dense()), (name, stats)"""),
    Case("ddp_world1_sparse_embedding_alltoall", "group1", G1,
         "ddp_grads(torch.nn.Embedding(5, 3, sparse=True), torch.tensor([1, 2]), alltoall_fp32_hook, ReduceState())",
         (TypeError, r"^bucket: a sparse gradient")),
    Case("ddp_world1_empty_parameter", "group1", G1 + EMPTY, EMPTY_STEP + ", name"),
]

# ---- DDP comm hooks on two ranks -----------------------------------------------------------------
D2 = RS + """
def reduced(name, dtype=torch.float32, poison=None, stats=True, wire=torch.bfloat16, **ddp_kw):
    '''(grads with the hook, grads of default DDP, exact fp64 mean of the ranks' local grads).'''
    torch.manual_seed(0); m = torch.nn.Sequential(torch.nn.Linear(4, 6), torch.nn.Tanh(), torch.nn.Linear(6, 3))
    m = m.to(dtype); ref = copy.deepcopy(m); local = copy.deepcopy(m)
    inp = (torch.randn(5, 4, generator=torch.Generator().manual_seed(rank)) + rank).to(dtype)
    if poison is not None and rank == 1:
        inp[0, 0] = poison
    local(inp).float().sum().backward()
    flat = torch.cat([p.grad.double().flatten() for p in local.parameters()])
    every = [torch.empty_like(flat) for _ in range(world)]
    dist.all_gather(every, flat)
    got = ddp_grads(m, inp, HOOKS[name], ReduceState(collect_stats=stats, wire_dtype=wire), **ddp_kw)
    want = ddp_grads(ref, inp, **ddp_kw)
    return torch.cat([g.double().flatten() for g in got]), torch.cat([g.double().flatten() for g in want]), \\
        torch.stack(every).mean(0)
"""


def _ddp_each_dtype(hook: str, sample: bool = False) -> Case:
    return Case(f"ddp2_{hook}_every_dtype", "ddp", D2, f"""
for dtype in (torch.bfloat16, torch.float16, torch.float32, torch.float64):
    got, want, exact = reduced({hook!r}, dtype)
    every = [torch.empty_like(got) for _ in range(world)]
    dist.all_gather(every, got)
    assert all(torch.equal(e, got) for e in every), ('replicas differ', dtype)
    if {hook!r} == 'fp32' and dtype in (torch.float32, torch.float64):
        tol = 4 * torch.finfo(dtype).eps
    else:
        tol = 2.0 ** -6
    assert ((got - exact).abs() <= tol * (exact.abs() + want.abs()) + 1e-30).all(), dtype""", sample=sample)


DDP_CASES = [
    _ddp_each_dtype("fp32"), _ddp_each_dtype("alltoall", sample=True), _ddp_each_dtype("stochastic"),
    _ddp_each_dtype("sum_then_divide"),
    Case("ddp2_nonfinite_on_one_rank", "ddp", D2, """
for name in HOOKS:
    for poison in (float('nan'), float('inf')):
        got, want, exact = reduced(name, poison=poison)
        assert torch.equal(got.isnan(), want.isnan()) and torch.equal(got.isinf(), want.isinf()), (name, poison)""",
         sample=True),
    Case("ddp2_world1_subgroups", "ddp", D2 + "\nsub, _ = dist.new_subgroups(group_size=1)", """
for name, hook in HOOKS.items():
    torch.manual_seed(0); m = torch.nn.Linear(4, 3); ref = copy.deepcopy(m)
    inp = torch.arange(12.).view(3, 4) / 4 + rank
    state = ReduceState(process_group=sub)
    got = ddp_grads(m, inp, hook, state, process_group=sub)
    want = ddp_grads(ref, inp, process_group=sub)
    for g, w in zip(got, want):
        assert torch.equal(g, w if name == 'fp32' else w.bfloat16().float()), name
    assert state.world_size == 1"""),
    Case("ddp2_empty_parameter", "ddp", D2 + EMPTY, EMPTY_STEP + " and state.calls == 1, name", sample=True),
    Case("ddp2_sparse_embedding", "ddp", D2, """
for name in ('fp32', 'sum_then_divide'):
    torch.manual_seed(0); e = torch.nn.Embedding(5, 3, sparse=True); ref = copy.deepcopy(e)
    idx = torch.tensor([1, 2 + rank])
    got = ddp_grads(e, idx, HOOKS[name], ReduceState(collect_stats=True, wire_dtype=torch.float32))
    want = ddp_grads(ref, idx)
    assert torch.allclose(got[0].to_dense(), want[0].to_dense()), name"""),
    Case("ddp2_sparse_embedding_alltoall", "ddp", D2,
         "ddp_grads(torch.nn.Embedding(5, 3, sparse=True), torch.tensor([1, 2]), alltoall_fp32_hook, ReduceState())",
         [(TypeError, r"^bucket: a sparse gradient")] * 2),
    Case("ddp2_invalid_state_on_every_rank", "ddp", D2 + "\nstate = ReduceState()\nstate.seed = None",
         "ddp_grads(torch.nn.Linear(4, 2), torch.ones(3, 4), stochastic_rounding_hook, state)",
         [(ValueError, r"^state.seed: expected an int, got None")] * 2),
    Case("ddp2_ranks_disagree_on_wire_dtype", "ddp", D2,
         "state = ReduceState(wire_dtype=torch.bfloat16 if rank == 0 else torch.float32)\n"
         "ddp_grads(torch.nn.Linear(4, 3), torch.ones(2, 4), alltoall_fp32_hook, state)",
         [(ValueError, r"^state.wire_dtype: the ranks disagree .*rank 0: torch.bfloat16, rank 1: torch.float32")] * 2,
         sample=True),
    Case("ddp2_ranks_disagree_on_hook", "ddp", D2,
         "ddp_grads(torch.nn.Linear(4, 3), torch.ones(2, 4), fp32_reduce_hook if rank == 0 else alltoall_fp32_hook, "
         "ReduceState())",
         [(ValueError, r"^hook: the ranks disagree .*rank 0: fp32_reduce_hook, rank 1: alltoall_fp32_hook")] * 2),
    Case("ddp2_ranks_disagree_on_collect_stats", "ddp", D2,
         "ddp_grads(torch.nn.Linear(4, 3), torch.ones(2, 4), fp32_reduce_hook, ReduceState(collect_stats=rank == 1))",
         [(ValueError, r"^state.collect_stats: the ranks disagree")] * 2),
    Case("ddp2_ranks_disagree_on_gather_dtype", "ddp", D2,
         "state = ReduceState(gather_dtype=torch.float32 if rank else None)\n"
         "ddp_grads(torch.nn.Linear(4, 3), torch.ones(2, 4), alltoall_fp32_hook, state)",
         [(ValueError, r"^state.gather_dtype: the ranks disagree")] * 2),
    Case("ddp2_group_without_this_rank", "ddp", D2 + "\ng = dist.new_group([0])",
         "state = ReduceState(process_group=g)",
         [OK, (TypeError, r"^process_group: expected a torch.distributed.ProcessGroup or None, got int")]),
    Case("ddp2_rank_raises_before_backward", "ddp", D2, """
from torch.nn.parallel import DistributedDataParallel as DDP
ddp = DDP(torch.nn.Linear(4, 3)); ddp.register_comm_hook(ReduceState(), fp32_reduce_hook)
out = ddp(torch.ones(2, 4)).sum()
if rank == 1:
    raise ValueError('rank 1 failed in its loss')
out.backward()""", [(RuntimeError, r"^fp32_reduce_hook: .* of bucket 0 .*failed"), (ValueError, "rank 1 failed")],
         alone=True),
    Case("ddp2_rank_raises_inside_the_hook", "ddp", D2 + "\nstate = ReduceState()\nif rank == 1:\n    state.calls = -1",
         "ddp_grads(torch.nn.Linear(4, 3), torch.ones(2, 4), stochastic_rounding_hook, state)",
         [(RuntimeError, r"^stochastic_rounding_hook: .* of bucket 0 .*failed"), (ValueError, r"^state.calls: ")],
         alone=True),
]

CASES: list[Case] = RELEASE_ARGS + RELEASE_RUNS + STATE_ARGS + BUCKETS + DDP_CASES
BY_NAME = {c.name: c for c in CASES}
KIND_ORDER = {"local": 0, "group1": 1, "ddp": 2}


# ---- running them --------------------------------------------------------------------------------
def _ranks(case: Case) -> list[str]:
    return ["0", "1"] if case.kind == "ddp" else ["-"]


_decoder = json.JSONDecoder()


def _execute(names: list[str], timeout: float) -> tuple[dict[str, dict[str, str]], set[tuple[str, str]], str]:
    """One worker process over ``names``: per case and rank its ``DONE``/``FAIL`` report, the
    (case, rank) pairs started, and how the process ended."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    proc = subprocess.Popen([sys.executable, str(WORKER), *names], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=env, cwd=str(ROOT), start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        ended = "ok" if proc.returncode == 0 else (f"signal {-proc.returncode}" if proc.returncode < 0
                                                   else f"exit status {proc.returncode}")
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)   # the worker and the ranks it spawned, all started here
        out, err = proc.communicate()
        ended = f"hang (killed after {timeout:.0f} s)"
    reports: dict[str, dict[str, str]] = {}
    started: set[tuple[str, str]] = set()
    for line in out.splitlines():
        parts = line.split(" ", 3)
        if parts[0] == "CASE" and len(parts) == 3:
            started.add((parts[2], parts[1]))
        elif parts[0] == "DONE" and len(parts) == 3:
            reports.setdefault(parts[2], {})[parts[1]] = "ok"
        elif parts[0] == "FAIL" and len(parts) == 4:
            reports.setdefault(parts[2], {})[parts[1]] = _decoder.raw_decode(parts[3])[0]
        elif parts[0] == "GROUP":
            ended += " / " + _decoder.raw_decode(line[6:])[0][:1500]
    return reports, started, ended + ("\n" + err[-2000:] if ended != "ok" else "")


def run_cases(names: list[str], timeout: float = 600) -> dict[str, str]:
    """Case name -> ``"ok"`` or what went wrong (``silent``, ``unnamed``, ``changed``, ``error``,
    ``wrong``, ``after``, ``setup``, ``crash``, ``hang`` first). Cases not started when a child dies
    run again in a fresh one."""
    todo = sorted(names, key=lambda n: (KIND_ORDER[BY_NAME[n].kind], BY_NAME[n].alone))
    results: dict[str, str] = {}
    while todo:
        reports, started, ended = _execute(todo, timeout)
        for name in todo:
            ranks = _ranks(BY_NAME[name])
            if not all((name, r) in started for r in ranks):
                continue            # not started (on every rank): what one rank did is collateral
            reported = reports.get(name, {})
            how = "hang" if ended.startswith("hang") else "crash"
            failures = [reported.get(r, f"{how}: the process ended ({ended}) in this case") for r in ranks]
            failures = [why if r == "-" else f"rank {r}: {why}" for r, why in zip(ranks, failures) if why != "ok"]
            results[name] = "\n".join(failures) if failures else "ok"
        left = [n for n in todo if n not in results]
        if len(left) == len(todo):
            for name in left:
                results[name] = f"crash: not run ({ended})"
            break
        todo = left
    return results


def _assert_all_ok(results: dict[str, str]) -> None:
    bad = {name: why for name, why in results.items() if (why != "ok") != bool(BY_NAME[name].known)}
    assert not bad, "\n\n".join(f"{name}: {why if why != 'ok' else 'passes: drop its known='}"
                                  for name, why in bad.items())


def test_the_table_is_well_formed():
    assert len(BY_NAME) == len(CASES)
    assert all(c.kind in KIND_ORDER for c in CASES)
    assert all(not isinstance(c.expect, list) or (c.kind == "ddp" and len(c.expect) == 2) for c in CASES)
    assert {c.kind for c in CASES if c.sample} == set(KIND_ORDER)
    assert not any(c.alone and c.sample for c in CASES)


@pytest.mark.timeout(240)
def test_campaign_sample():
    """A sample of every kind in one child process (a few seconds plus one two-rank launch)."""
    _assert_all_ok(run_cases([c.name for c in CASES if c.sample], timeout=200))


@pytest.mark.slow
@pytest.mark.timeout(1800)
def test_campaign_all():
    _assert_all_ok(run_cases([c.name for c in CASES], timeout=1500))


if __name__ == "__main__":
    chosen = sys.argv[1:] or [c.name for c in CASES]
    outcome = run_cases(chosen)
    for case_name in chosen:
        print(f"{case_name}: {outcome[case_name]}")
    counts: dict[str, int] = {}
    for why in outcome.values():
        key = why.removeprefix("rank 0: ").removeprefix("rank 1: ").split(":", 1)[0]
        counts[key] = counts.get(key, 0) + 1
    print(json.dumps(counts))
