"""Generic tests generated from the registry of optimizers (lowp/optim/registry.py), as torch's
``optim_db``: every optimizer x its example keyword sets x write-back mode x backend x dtype
(part of the product in the slow suite: :func:`_native_product`).

Every fused case asserts that its kernel really ran (the backend's per-kernel element counts,
``fused_helpers.assert_fused``); :func:`test_a_disabled_kernel_fails_its_cases` proves that these
tests fail when a kernel is switched off. The native kernel runs everything here; the Triton
kernel runs through its interpreter in a subprocess per optimizer; torch.compile, which takes
10-40 s per variant, runs one case by default and the whole matrix under ``-m slow``.
"""
from __future__ import annotations

import platform
import shutil
import sys

import pytest
import torch

import lowp.optim as lo
from lowp.optim.registry import optimizers
from lowp.optim.writeback import MODES
from interpreted import run_interpreted
from fused_helpers import SHAPES, assert_same_run, train

#: awkward sizes: a 1-element tensor, a block of exactly 16, tails of 1 and 15, one across two work units
SHAPES_NATIVE = [*SHAPES, (1,), (16,), (17,), (31,), (40000,)]
STEPS = 7  # RAdam takes its rectified step from step 6 on (beta2 = 0.999)


def _fused(cls) -> bool:
    """Optimizers whose kernels must equal the reference bit for bit: an elementwise rule."""
    return cls.spec is not None and cls.spec.rule is not None and cls.spec.elementwise


def _native(cls) -> bool:
    """Optimizers the native kernel must run bit for bit like the reference: any rule, those with a
    per-tensor reduction too (StableAdamW's RMS, summed in lowp.optim.ordered_sum's order)."""
    return cls.spec is not None and cls.spec.rule is not None


FUSED = [cls for cls in optimizers() if _fused(cls)]
CASES = [(cls, kw) for cls in FUSED for kw in cls.examples]
NATIVE = [cls for cls in optimizers() if _native(cls)]
NATIVE_CASES = [(cls, kw) for cls in NATIVE for kw in cls.examples]


def _id(value) -> str:
    return value.__name__ if isinstance(value, type) else ",".join(f"{k}={v}" for k, v in value.items()) or "defaults"


def native_here() -> bool:
    return platform.machine() in ("x86_64", "AMD64") and shutil.which("g++") is not None


def reference(cls, mode, **kw):
    return train(cls, "foreach", mode, **kw)


def test_registry_lists_every_optimizer():
    names = {cls.__name__ for cls in optimizers()}
    assert {"SGD", "Adam", "AdamW", "Lion", "RAdam", "StableAdamW", "Adafactor", "Adan"} <= names
    assert all(name in lo.__all__ for name in names)
    assert {cls.__name__ for cls in FUSED} >= {"SGD", "Adam", "AdamW", "Lion", "RAdam", "Adan"}


def _native_product() -> list:
    """Every optimizer example x write-back mode: by default every example in ``kahan`` and every
    mode with each optimizer's first example; the rest of the product in the slow suite (about 40
    more kernel variants, a second each to build on a fresh machine; the native fuzz of
    test_native_safety.py also runs each mode and each optimizer against the reference)."""
    return [pytest.param(cls, kw, mode, id=f"{_id(cls)}-{_id(kw)}-{mode}",
                         marks=[pytest.mark.slow] if mode != "kahan" and kw is not cls.examples[0] else [])
            for cls, kw in NATIVE_CASES for mode in MODES]


@pytest.mark.skipif(not native_here(), reason="the native kernel needs x86-64 with AVX2 and g++")
@pytest.mark.parametrize("cls,kw,mode", _native_product())
def test_native_bit_identical(cls, kw, mode):
    """bf16 weights, default (bf16, stochastically rounded) states."""
    kw = dict(kw, steps=STEPS, shapes=SHAPES_NATIVE)
    assert_same_run(train(cls, "native", mode, **kw), reference(cls, mode, **kw))


@pytest.mark.skipif(not native_here(), reason="the native kernel needs x86-64 with AVX2 and g++")
@pytest.mark.parametrize("dtype,mode,extra", [
    (torch.float16, "kahan", {}),                                       # fp16 weights, bf16 states
    (torch.float16, "stochastic", dict(state_dtype=torch.float16)),     # fp16 stochastic rounding everywhere
    (torch.float32, "nearest", {}),                                     # fp32 weights and states
    (torch.bfloat16, "kahan", dict(state_dtype=torch.float32, state_rounding="nearest")),
], ids=str)
@pytest.mark.parametrize("cls", NATIVE, ids=_id)
def test_native_dtypes_bit_identical(cls, dtype, mode, extra):
    kw = dict(cls.examples[0], steps=4, dtype=dtype, **extra)
    assert_same_run(train(cls, "native", mode, **kw), reference(cls, mode, **kw))


def test_optimizers_without_a_rule_run_the_reference_on_fused_backends():
    """Adafactor (factored moments) has no elementwise rule: a fused backend runs it whole on its
    fallback, and says so in its counts."""
    for cls in optimizers():
        if not _fused(cls) and (cls.spec is None or cls.spec.rule is None):
            params, opt = train(cls, "compiled", "kahan", steps=2, expect_fused=False, **cls.examples[0])
            assert_same_run((params, opt), train(cls, "foreach", "kahan", steps=2, **cls.examples[0]))


def test_subclass_with_its_own_update_is_never_fused():
    """A user subclass that replaces ``update`` keeps its own math (the stock rule would differ)."""

    class Scaled(lo.AdamW):
        def update(self, group, weights, grads, states, step):
            return torch._foreach_mul(super().update(group, weights, grads, states, step), 0.5)

    assert Scaled([torch.zeros(2)]).kernel_spec() is None
    params, opt = train(Scaled, "compiled", "kahan", steps=2, expect_fused=False, lr=1e-2)
    assert opt.backend.reference_elements > 0


#: the optimizers whose interpreted Triton cases run by default (10-17 s each on 2 cores): AdamW;
#: the others are slow
TRITON_DEFAULT = {"AdamW"}


@pytest.mark.parametrize("cls", [c if c.__name__ in TRITON_DEFAULT else pytest.param(c, marks=pytest.mark.slow)
                                 for c in FUSED], ids=_id)
def test_triton_bit_identical_through_the_interpreter(cls):
    """Every mode and example of one optimizer through the generated Triton kernel (interpreted
    on CPU, in a subprocess: TRITON_INTERPRET must be set before triton is imported)."""
    pytest.importorskip("triton")
    assert run_interpreted(__file__, cls.__name__).count("OK") == len(cls.examples) * len(MODES)


def _compiled_case(cls, kw, mode):
    kw = dict(kw, steps=STEPS, state_dtype=torch.float32)
    assert_same_run(train(cls, "compiled", mode, **kw), reference(cls, mode, **kw))


def test_compiled_bit_identical_adan():
    """torch.compile on the newest optimizer (one variant: 10-40 s); the matrix is slow."""
    _compiled_case(lo.Adan, lo.Adan.examples[0], "kahan")


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["nearest", "kahan", "exact", "exact8"])
@pytest.mark.parametrize("cls,kw", CASES, ids=_id)
def test_compiled_bit_identical(cls, kw, mode):
    _compiled_case(cls, kw, mode)


@pytest.mark.parametrize("backend", ["native", "compiled", "triton"])
def test_a_disabled_kernel_fails_its_cases(backend, monkeypatch):
    """With a kernel that supports no spec, every step silently takes the reference pipeline,
    bit-identical to it by design: only the element counts tell, and the generic cases fail."""
    from lowp.optim import kernels

    if backend == "native" and not native_here():
        pytest.skip("the native kernel needs x86-64 with AVX2 and g++")
    if backend == "triton":
        pytest.importorskip("triton")
    kernel = {"native": kernels.NativeKernel, "compiled": kernels.CompiledKernel, "triton": kernels.TritonKernel}
    monkeypatch.setattr(kernel[backend], "supports", lambda self, spec: False)
    if backend == "triton":  # its fallback is the compiled kernel: off too, so nothing compiles here
        monkeypatch.setattr(kernels.CompiledKernel, "supports", lambda self, spec: False)
    for cls in FUSED:
        for mode in ("kahan", "exact8"):
            with pytest.raises(AssertionError, match="elements"):
                train(cls, backend, mode, steps=1, **cls.examples[0])


def _interpreted(name: str) -> None:
    """Every example x mode of optimizer ``name`` on the Triton kernel against the reference."""
    cls = getattr(lo, name)
    for kw in cls.examples:
        for mode in MODES:
            kw_run = dict(kw, steps=STEPS, shapes=[(37, 11), (1500,)])  # 1 and 2 Triton blocks
            assert_same_run(train(cls, "triton", mode, **kw_run), reference(cls, mode, **kw_run))
            print("OK", name, kw, mode, flush=True)


if __name__ == "__main__":
    import interpreter_fma
    interpreter_fma.install()  # Triton < 3.9 rounds the interpreter's fma twice
    _interpreted(sys.argv[1])
