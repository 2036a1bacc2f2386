"""Odd inputs never reach the fused kernels as bad pointers (lowp/optim/kernels/checks.py).

A fuzz matrix (tests/safety_cases.py) feeds the native backend, and the compiled backend for a
few cases, views at storage offsets, transposed and expanded tensors, empty and one-element
tensors, parameters sharing memory, gradients of other dtypes, shapes and layouts, freed
storages, missing, extra and mistyped states, a missing compensation buffer, unchecked NaN
gradients, a ``__torch_dispatch__`` subclass and a DTensor. Each batch runs in a child process
that names every case before running it, so a crash (a signal) is attributed; each case must
either work and agree with the reference ``backend="foreach"`` or raise an error naming the
argument with every weight and state bit-unchanged.

Plus direct tests of the admission functions and of the native launch guard, in this process
where they cannot crash it.
"""
from __future__ import annotations

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

import lowp.optim as lo
from lowp.optim.slices import ParamSlice, StepContext
from lowp.optim.kernels import checks
from lowp.optim.kernels.native.kernel import NativeKernel, slice_dtypes, variant_for
from lowp.optim.kernels.native.build import native_available
from lowp.optim.writeback import MODES
from safety_cases import CASES, OPTIMIZERS

ROOT = Path(__file__).resolve().parents[1]
native = pytest.mark.skipif(not native_available(),
                            reason="the native kernel needs x86-64 with AVX2 and a C++ compiler")

#: each write-back mode and each optimizer at least once (Lion + kahan: the NaN case of the sign); an
#: optimizer of the registry not named here runs in kahan mode
DEFAULT = [("AdamW", "kahan"), ("SGD", "exact"), ("Lion", "kahan"), ("Lion", "stochastic"), ("SGD", "nearest"),
           ("Adam", "exact"), ("RAdam", "stochastic"), ("StableAdamW", "kahan"), ("Adafactor", "kahan"),
           ("AdamW", "exact8"), ("Adan", "kahan")]
DEFAULT += [(name, "kahan") for name in OPTIMIZERS if name not in {optimizer for optimizer, _ in DEFAULT}]
#: the reference backends on the same odd inputs (they must not crash either, and must be atomic)
REFERENCE = [("AdamW", "stochastic"), ("Adafactor", "exact"), ("SGD", "kahan")]
#: compiled-backend cases refused before anything compiles (torch.compile takes 10-40 s a variant)
COMPILED_QUICK = ["grad_smaller", "grad_reshaped", "expanded_param", "grad_fp64"]
#: the compiled backend's cases that compile (slow)
COMPILED_SLOW = ["offset_views", "transposed", "expanded_grad", "empty_and_single", "shared_storage", "grad_strided",
                 "param_misaligned", "buffer_deleted", "state_wrong_size", "state_strided", "dtensor_param_unchecked"]


def run_cases(ids: list[str], timeout: int = 600) -> None:
    """Run ``ids`` (``backend:optimizer:mode:case``) in one child process; fail naming the case
    that crashed it or went wrong."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), str(ROOT / "tests")]))
    result = subprocess.run([sys.executable, str(ROOT / "tests" / "safety_cases.py"), *ids], env=env,
                            capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    lines = result.stdout.splitlines()
    started = [line.split()[1] for line in lines if line.startswith("CASE ")]
    finished = {line.split()[1] for line in lines if line.startswith(("DONE ", "FAIL "))}
    if result.returncode != 0:
        crashed = [i for i in started if i not in finished]
        how = f"signal {-result.returncode}" if result.returncode < 0 else f"exit status {result.returncode}"
        pytest.fail(f"the child died ({how}) in case {crashed[-1] if crashed else '(before any case)'}:\n"
                    f"{result.stderr[-3000:]}")
    failures = [line for line in lines if line.startswith("FAIL ")]
    assert not failures, "\n".join(failures) + "\n" + result.stderr[-3000:]
    assert started == ids and finished == set(ids), result.stdout[-3000:]


def matrix(backend: str, combos, cases) -> list[str]:
    return [f"{backend}:{optimizer}:{mode}:{case}" for optimizer, mode in combos for case in cases]


@native
def test_fuzz_native_and_compiled_in_one_child():
    """Every case for five optimizer x mode pairs on the native backend, and the compiled
    backend's cases that are refused before anything compiles: one child process."""
    run_cases(matrix("native", DEFAULT, CASES) + matrix("compiled", [("AdamW", "kahan")], COMPILED_QUICK)
              + matrix("eager", REFERENCE, CASES))


@native
@pytest.mark.slow
@pytest.mark.parametrize("optimizer", list(OPTIMIZERS))
def test_fuzz_full_matrix(optimizer):
    """Every optimizer x mode x CPU backend without compilation x case."""
    combos = [(optimizer, mode) for mode in MODES]
    run_cases(matrix("native", combos, CASES) + matrix("foreach", combos, CASES) + matrix("eager", combos, CASES))


@pytest.mark.slow
def test_fuzz_compiled():
    run_cases(matrix("compiled", [("AdamW", "kahan")], COMPILED_SLOW), timeout=1800)


# ---- the admission functions, directly ----------------------------------------------------------
def quantized() -> torch.Tensor:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # quantized tensors are deprecated: still a layout to refuse
        return torch.quantize_per_tensor(torch.zeros(8), 0.1, 0, torch.qint8)


def test_kernel_memory_accepts_plain_contiguous_aligned_tensors_only():
    ok = (torch.float32, torch.bfloat16)
    base = torch.zeros(64, dtype=torch.bfloat16)
    assert checks.kernel_memory(base, ok) and checks.kernel_memory(base[5:20], ok)
    assert checks.kernel_memory(torch.nn.Parameter(base), ok)
    raw = torch.frombuffer(bytearray(130), dtype=torch.bfloat16, offset=1, count=64)
    freed = torch.zeros(64, dtype=torch.bfloat16)
    freed.untyped_storage().resize_(0)
    refused = {
        "wrong dtype": base.double(), "empty": base[:0], "transposed": base.view(8, 8).t(),
        "expanded": base[:1].expand(8), "negative view": torch._neg_view(base), "sparse": base.to_sparse(),
        "meta": torch.zeros(8, device="meta", dtype=torch.bfloat16), "misaligned": raw, "freed": freed,
        "quantized": quantized(),
    }
    for name, t in refused.items():
        assert not checks.kernel_memory(t, ok), name
    from torch.testing._internal.two_tensor import TwoTensor
    assert not checks.kernel_memory(TwoTensor(base, base.clone()), ok)


def test_kernel_grad_copies_strided_and_misaligned_gradients_only():
    base = torch.randn(64).bfloat16()
    assert checks.kernel_grad(base) is base and checks.kernel_grad(base[3:40]).data_ptr() == base[3:40].data_ptr()
    raw = torch.frombuffer(bytearray(130), dtype=torch.bfloat16, offset=1, count=64)
    raw.copy_(base)
    for t in (raw, base.view(8, 8).t(), base[::2]):
        copy = checks.kernel_grad(t)
        assert copy.is_contiguous() and copy.data_ptr() % 2 == 0 and torch.equal(copy, t)
        assert copy.untyped_storage().data_ptr() != t.untyped_storage().data_ptr()


@native
def test_a_misaligned_gradient_reaches_the_kernel_aligned(monkeypatch):
    """A contiguous gradient at an odd address (a view of a byte buffer) is stepped by the native
    kernel (not sent elsewhere) from an aligned copy: every gradient pointer the C++ entry
    receives is a multiple of its element size, and the step equals the reference's bits."""
    from lowp.optim.kernels.native import kernel as native_kernel
    seen: list[int] = []
    real = native_kernel.step_function

    def entry_of(source):
        entry = real(source)

        def checked(n, table, *rest):
            seen.extend(table[n + j] for j in range(n))
            return entry(n, table, *rest)
        return checked
    monkeypatch.setattr(native_kernel, "step_function", entry_of)
    values = torch.randn(64, generator=torch.Generator().manual_seed(3)).bfloat16()
    grad = torch.frombuffer(bytearray(130), dtype=torch.bfloat16, offset=1, count=64)
    grad.copy_(values)
    assert grad.data_ptr() % 2 == 1
    weights = torch.randn(64, generator=torch.Generator().manual_seed(4)).bfloat16()
    out = {}
    for fused in (True, False):
        p = torch.nn.Parameter(weights.clone())
        p.grad = grad
        opt = lo.AdamW([p], lr=1e-2, fused=fused)
        opt.step()
        out[fused] = p.detach().clone()
        if fused:
            assert opt.backend.fused_elements == 64 and opt.backend.reference_elements == 0
    assert seen and all(ptr % 2 == 0 for ptr in seen), seen
    assert torch.equal(out[True].view(torch.int16), out[False].view(torch.int16))


def test_overlapping_finds_shared_written_memory_only():
    ctx = _slice_ctx("nearest")
    flat = torch.zeros(300)
    a, b, c = flat[:100], flat[100:200], flat[50:150]
    grads = torch.zeros(400)

    kept = []  # the slices stay alive, as in a step: a freed state's memory would be reused

    def spans(*pairs) -> list:
        out: list = []
        for p, g in pairs:
            kept.append(ParamSlice(p, g, {"exp_avg": torch.zeros_like(p)}))
            checks.check_slice(ctx, kept[-1], spans=out)
        return out

    assert not checks.overlapping(spans((a, grads[:100]), (b, grads[100:200])))  # adjacent views
    assert not checks.overlapping(spans((a, grads[:100]), (b, grads[:100])))  # gradients may be shared
    assert checks.overlapping(spans((a, grads[:100]), (c, grads[100:200])))  # weights overlap
    assert checks.overlapping(spans((a, grads[:100]), (b, a)))  # a gradient is another slice's weight


def _slice_ctx(mode="kahan"):
    opt = lo.AdamW([torch.zeros(4, dtype=torch.bfloat16)], mode=mode)
    return StepContext(opt.param_groups[0], MODES[mode], 1, None, seed=0, count=True)


def test_check_slice_errors_name_the_argument():
    ctx = _slice_ctx()
    p = torch.zeros(8, dtype=torch.bfloat16)
    states = {"exp_avg": torch.zeros(8, dtype=torch.bfloat16), "exp_avg_sq": torch.zeros(8, dtype=torch.bfloat16)}
    buf = torch.zeros(8, dtype=torch.bfloat16)
    cases = [
        (ParamSlice(p, torch.zeros(4, dtype=torch.bfloat16), states, buf), ValueError, r"^grad: .*\(4,\).*\(8,\)"),
        (ParamSlice(p, torch.zeros(8, device="meta"), states, buf), ValueError, "^grad: .*device"),
        (ParamSlice(p, torch.zeros(8), states, None), ValueError, "^compensation: "),
        (ParamSlice(p, torch.zeros(8), {**states, "exp_avg": torch.zeros(9)}, buf), ValueError, "^exp_avg: "),
        (ParamSlice(p, torch.zeros(8), states, torch.zeros(8, dtype=torch.int16)), TypeError, "^compensation: "),
    ]
    for s, error, message in cases:
        with pytest.raises(error, match=message):
            checks.check_slice(ctx, s)


@native
def test_native_launch_guard_raises_instead_of_passing_a_bad_pointer():
    """Called with a slice the admission would have refused (a gradient smaller than its
    weight, a missing buffer, a DTensor-like subclass), the launch raises; nothing is written."""
    from torch.testing._internal.two_tensor import TwoTensor

    ctx = _slice_ctx()
    spec = lo.AdamW.spec
    p = torch.ones(64, dtype=torch.bfloat16)
    states = {"exp_avg": torch.zeros(64, dtype=torch.bfloat16), "exp_avg_sq": torch.zeros(64, dtype=torch.bfloat16)}
    buf = torch.zeros(64, dtype=torch.bfloat16)
    good = ParamSlice(p, torch.ones(64, dtype=torch.bfloat16), states, buf)
    variant = variant_for(spec, ctx, slice_dtypes(good))
    numbers = spec.numbers(ctx.group, 1)
    bad = [ParamSlice(p, torch.ones(16, dtype=torch.bfloat16), states, buf),
           ParamSlice(p, torch.ones(64, dtype=torch.bfloat16), states, None),
           ParamSlice(TwoTensor(p, p.clone()), torch.ones(64, dtype=torch.bfloat16), states, buf),
           ParamSlice(p, torch.ones(64, dtype=torch.bfloat16), {"exp_avg": states["exp_avg"]}, buf)]
    for s in bad:
        with pytest.raises(RuntimeError, match="kernel call"):
            NativeKernel.launch(spec, variant, [s], numbers, 0, 1, 1.0)
    assert torch.equal(p, torch.ones(64, dtype=torch.bfloat16)) and not buf.any()
    assert NativeKernel.launch(spec, variant, [good], numbers, 0, 1, 1.0) >= 0  # the guard passes good input
