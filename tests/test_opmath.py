import pytest
import torch

from lowp.arith import Arith
from lowp.audit.opmath import opmath, opmath_dtype, opmath_ops
from lowp.codec import all_values
from lowp.rounding import quantize


def test_opmath_dtype_maps_low_precision_to_fp32_and_keeps_others():
    assert opmath_dtype(torch.float16) == torch.float32
    assert opmath_dtype(torch.bfloat16) == torch.float32
    assert opmath_dtype(torch.float8_e4m3fn) == torch.float32
    assert opmath_dtype(torch.float32) == torch.float32
    assert opmath_dtype(torch.float64) == torch.float64
    assert opmath_dtype(torch.int32) == torch.int32
    assert opmath_dtype("dlfloat16") == torch.float32
    assert opmath_dtype("fp8_e5m2") == torch.float32
    assert opmath_dtype("fp64") == torch.float64
    with pytest.raises(TypeError, match="dtype"):
        opmath_dtype(3)


def test_decorated_product_is_correctly_rounded_exhaustive_row():
    # fp32 holds the exact product of two fp16 values, so one rounding is the correct rounding
    a = all_values("fp16")
    b = torch.full_like(a, 1.3330078125)  # an fp16 value with many mantissa bits

    @opmath
    def mul(x, y):
        return x * y

    got = mul(a.half(), b.half())
    assert got.dtype == torch.float16
    want = quantize(a * b, "fp16", native=False)
    assert torch.equal(got.double(), want)


def test_decorator_fixes_fp16_sum_stagnation():
    x = torch.ones(3000, dtype=torch.float16)

    def running_sum(v):
        acc = torch.zeros((), dtype=v.dtype)
        for item in v:
            acc = acc + item
        return acc

    assert running_sum(x).item() == 2048.0  # fp16 stagnates: 2048 + 1 rounds back to 2048
    assert float(Arith("fp16").sum(x.float())) == 2048.0
    fixed = opmath(running_sum)(x)
    assert fixed.dtype == torch.float16 and fixed.item() == 3000.0


def test_decorator_fixes_exp_overflow_in_softmax():
    x = torch.tensor([12.0, 11.0, 10.0], dtype=torch.float16)

    def softmax(v):
        e = torch.exp(v)  # exp(12) = 162755 overflows fp16
        return e / e.sum()

    assert torch.isnan(softmax(x)).any()
    got = opmath(softmax)(x)
    exact = torch.softmax(x.double(), 0)
    assert torch.equal(got.double(), quantize(exact, "fp16", native=False))


def test_context_manager_rounds_once_per_op():
    x = torch.linspace(-10, 10, 1001).half()
    with opmath_ops():
        y = torch.exp(x)
        s = x.sum()
        running = torch.zeros((), dtype=torch.float16)
        for item in torch.ones(3000, dtype=torch.float16):
            running = running + item
    assert y.dtype == torch.float16 and s.dtype == torch.float16
    assert torch.equal(y, torch.exp(x.float()).half())
    assert s.item() == x.float().sum().half().item()
    assert running.item() == 2048.0  # per-op rounding cannot fix a sequential fp16 accumulator


def test_context_manager_leaves_mixed_and_data_movement_alone():
    a = torch.ones(3, dtype=torch.float16)
    b = torch.ones(3, dtype=torch.float32)
    with opmath_ops():
        assert (a + b).dtype == torch.float32
        assert a.to(torch.float32).dtype == torch.float32
        assert a[1:].dtype == torch.float16


def test_emulated_format_outputs_are_rounded_to_it():
    x = torch.linspace(0.1, 3.0, 50)
    with opmath_ops("fp8_e4m3fn"):
        y = torch.exp(x)
        tie = torch.tensor([1.0]) + torch.tensor([0.0625])  # operators are ops too: 1.0625 ties to 1.0
        acc = torch.tensor([1.0])
        acc += torch.tensor([0.0625])  # in-place ops pass through unrounded
    assert torch.equal(y, quantize(torch.exp(x), "fp8_e4m3fn"))
    assert tie.item() == 1.0 and acc.item() == 1.0625

    @opmath(format="fp8_e5m2")
    def f(v):
        return torch.exp(v) * 3

    assert torch.equal(f(x), quantize(torch.exp(x) * 3, "fp8_e5m2"))


def test_opmath_rejects_non_callable():
    with pytest.raises(TypeError, match="fn"):
        opmath(42)


def test_decorator_on_float8_storage_rounds_back_to_float8():
    x = torch.tensor([0.5, 1.0, 2.0, 3.0]).to(torch.float8_e4m3fn)

    @opmath
    def softplus(v):
        return torch.log1p(torch.exp(v))

    got = softplus(x)
    assert got.dtype == torch.float8_e4m3fn
    want = quantize(torch.log1p(torch.exp(x.double())), "fp8_e4m3fn", native=False)
    assert torch.equal(got.double(), want)
