"""Fused optimizer steps (lowp.optim.kernels): the compiled backend against the reference
pipeline bit by bit (stochastic rounding included, across 2**32 too), no recompilation across
steps / LR changes / groups / sizes, backend selection and fallbacks.

Compiling one variant takes 10-40 s on a 2-core CPU, so the default suite compiles two
(AdamW + kahan, AdamW + stochastic); the whole optimizer x mode matrix is marked slow."""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import lowp.optim as lo
from lowp.optim import backends, kernels
from lowp.optim.kernels.compiled.kernel import CHUNK
from lowp.optim.kernels.kernel import stream_count
from lowp.optim.kernels.compiled.step import _stream_bits, chunk_keys, nearest, stochastic_bf16
from lowp.optim.randomness import ElementIndex, Stream, stream_keys
from fused_helpers import SHAPES, assert_fused, assert_same_run, run_at_index, same_bits_or_nan, train

FP32_STATES = dict(state_dtype=torch.float32)
ADAMW = dict(lr=1e-2, weight_decay=0.1, **FP32_STATES)
# one parameter larger than a chunk: whole chunks take the static-shape kernel, the rest the dynamic one
WITH_LARGE = [*SHAPES, (CHUNK + 37,)]


def slice_keys_of(param_id: int) -> list[int]:
    return stream_keys(1, 1, param_id, stream_count(3))


def test_adamw_kahan_bit_identical_to_reference():
    fused = train(lo.AdamW, "compiled", "kahan", shapes=WITH_LARGE, **ADAMW)
    reference = train(lo.AdamW, "foreach", "kahan", shapes=WITH_LARGE, **ADAMW)
    assert_same_run(fused, reference)
    assert fused[1].diagnostics()[0]["stalled_fraction"] > 0  # the count is live, not a constant 0


def test_no_recompilation_across_steps_lr_changes_groups_and_sizes():
    params, opt = train(lo.AdamW, "compiled", "kahan", steps=1, shapes=WITH_LARGE, **ADAMW)
    graphs = counters["stats"]["unique_graphs"]
    extra = torch.randn(123, 7).bfloat16()
    opt.add_param_group({"params": [extra], "lr": 3e-3})
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda t: 0.5 ** t)
    before = extra.clone()
    for _ in range(3):
        for p in [*params, extra]:
            p.grad = torch.randn(p.shape).bfloat16()
        opt.step()
        sched.step()
    assert counters["stats"]["unique_graphs"] == graphs
    assert_fused(opt, 4 * sum(p.numel() for p in params) + 3 * extra.numel())
    assert not torch.equal(extra, before)


def test_stochastic_bit_identical_to_reference_and_unbiased():
    kw = dict(lr=1e-3)  # bf16 states with stochastic state rounding (the defaults)
    a = train(lo.AdamW, "compiled", "stochastic", **kw)
    assert_same_run(a, train(lo.AdamW, "foreach", "stochastic", **kw))
    nearest = train(lo.AdamW, "foreach", "nearest", **kw)[0]
    assert any(not torch.equal(x, y) for x, y in zip(a[0], nearest))

    # The rounding itself: x a quarter of the way from 1 to the next bf16 rounds up 25% of the time.
    n = 1 << 16
    x = torch.full((n,), 1.0 + 2.0 ** -7 / 4)
    j = torch.arange(n, dtype=torch.int32)
    keys = chunk_keys(slice_keys_of(5), 0, n, x.device)
    for stream in (Stream.WEIGHT, Stream.COMPENSATION, Stream.STATE):
        up = stochastic_bf16(x, _stream_bits(j, j < keys[1], keys, stream)).float() > 1
        assert abs(up.float().mean().item() - 0.25) < 4 * (0.25 * 0.75 / n) ** 0.5


def test_chunks_across_two_to_the_32_equal_the_reference():
    """A parameter larger than a chunk whose global indices start 1000 below 2**32: the static
    chunk switches to the next fold of the high bits inside, the dynamic remainder lies beyond."""
    index = ElementIndex(offset=(1 << 32) - 1000)
    fused = run_at_index("compiled", "kahan", index, n=CHUNK + 37, **FP32_STATES)
    for x, y in zip(fused, run_at_index("foreach", "kahan", index, n=CHUNK + 37, **FP32_STATES)):
        assert torch.equal(x, y)


def test_vector_bitcasts_exact_and_scoped():
    """The whole-vector bitcasts emitted under ``vector_bitcasts`` give the eager bits (signs,
    subnormals, inf, NaN payloads) in a 16-wide bf16 loop, and Inductor's own codegen is restored."""
    from torch._inductor.codegen.cpp import CppVecOverrides

    original = CppVecOverrides.__dict__["to_dtype_bitcast"]

    def fn(x, b):
        bits = (x * 3).view(torch.int32) ^ 0x5A5A
        return (bits.view(torch.float32) + b.float()).to(torch.bfloat16), bits

    special = torch.tensor([0.0, -0.0, 1e-40, -1e-45, float("inf"), -float("inf"), float("nan"), 3.4e38])
    x = torch.cat([special, torch.randn(4096 - len(special)) * 1e3])
    b = torch.randn(4096).bfloat16()
    compiled = torch.compile(fn, fullgraph=True, dynamic=False)
    with kernels.compiled.bitcast.vector_bitcasts():
        got = compiled(x, b)
    want = fn(x, b)
    assert torch.equal(got[1], want[1])
    assert torch.equal(got[0].view(torch.int16), want[0].view(torch.int16))
    assert CppVecOverrides.__dict__["to_dtype_bitcast"] is original


def test_nearest_bf16_survives_inductor_dropping_round_trips():
    """Inductor drops ``x.to(bf16).float()`` when it does not emulate precision casts (always on
    CPU before torch 2.13): here with the option off, the cast's round trip is lost while
    ``nearest`` keeps every bit of torch's cast (ties, subnormals, overflow to inf) but a NaN's
    (torch's own vectorized and scalar casts give different NaNs)."""
    def cast(w, v):
        return (w + v).to(torch.bfloat16).float() - w

    def integer(w, v):
        rounded, value = nearest(w + v, torch.bfloat16)
        return value - w, rounded

    ties = torch.tensor([1 + 2.0 ** -8, 1 + 3 * 2.0 ** -8, -(1 + 2.0 ** -8), 3.3895e38, -3.3895e38, 1e-40,
                         -1e-40, float("nan"), float("inf"), -float("inf"), 0.0, -0.0])
    bits = torch.randint(-2 ** 31, 2 ** 31 - 1, (4096,), dtype=torch.int32)
    w = torch.cat([ties, bits.view(torch.float32), torch.randn(4096)])
    v = torch.cat([torch.zeros(len(ties)), torch.zeros(4096), torch.randn(4096) * 1e-3])
    options = {"emulate_precision_casts": False}
    dropped = torch.compile(cast, fullgraph=True, dynamic=False, options=options)(w, v)
    assert not torch.equal(dropped.nan_to_num(), cast(w, v).nan_to_num())  # the pitfall is real here
    got, rounded = torch.compile(integer, fullgraph=True, dynamic=False, options=options)(w, v)
    assert same_bits_or_nan(rounded, (w + v).to(torch.bfloat16))
    assert same_bits_or_nan(got, cast(w, v))


@pytest.mark.parametrize("mode", ["kahan", "stochastic"])
def test_the_compiled_cpu_step_is_a_vector_loop(monkeypatch, mode):
    """Inductor vectorizes a CPU loop only when it vectorizes every dtype in it, and int16 is not
    one of them (torch 2.11-2.13): the bf16 patterns must not pass through int16, or the whole
    step is a scalar loop. Here the generated code of a fresh compile has vector loads and no loop
    that steps one element at a time (a static-shape chunk: no tail)."""
    from torch._inductor.utils import run_and_get_code
    from lowp.optim.kernels.compiled import kernel as compiled_kernel

    monkeypatch.setattr(compiled_kernel, "_FUNCTIONS", {})
    monkeypatch.setattr(compiled_kernel, "CHUNK", 4096)
    p = torch.nn.Parameter(torch.randn(4096).bfloat16())
    p.grad = torch.randn(4096).bfloat16()
    opt = lo.AdamW([p], backend="compiled", mode=mode)
    with torch._inductor.config.patch(force_disable_caches=True):
        _, sources = run_and_get_code(opt.step)
    code = "\n".join(sources)
    assert "at::vec::Vectorized<float>::loadu" in code or "at::vec::Vectorized<at::BFloat16>::loadu" in code, code
    assert "x0+=static_cast<int64_t>(1L)" not in code, "a scalar loop"
    assert (opt.backend.fused_elements, opt.backend.reference_elements) == (4096, 0)


def test_fallbacks_match_reference_without_compiling():
    graphs = counters["stats"]["unique_graphs"]
    """Every element of these runs takes the reference pipeline (``train(..., expect_fused=False)``
    checks the backend's counts), with the reference's results and no compilation."""
    for opt_class in (lo.StableAdamW, lo.Adafactor):  # no elementwise rule
        assert_same_run(train(opt_class, "compiled", "kahan", steps=2, expect_fused=False),
                        train(opt_class, "foreach", "kahan", steps=2))
    one_element = [(1,), (1, 1)]  # shapes that would specialize; fp64 weights are not fused
    assert_same_run(train(lo.AdamW, "compiled", "kahan", steps=2, shapes=one_element, expect_fused=False),
                    train(lo.AdamW, "foreach", "kahan", steps=2, shapes=one_element))
    assert_same_run(train(lo.SGD, "compiled", "nearest", steps=2, dtype=torch.float64, expect_fused=False),
                    train(lo.SGD, "foreach", "nearest", steps=2, dtype=torch.float64))
    # fp16 weights with kahan: the compensation is rounded stochastically to fp16 (native kernel only)
    assert_same_run(train(lo.AdamW, "compiled", "kahan", steps=2, dtype=torch.float16, expect_fused=False, **ADAMW),
                    train(lo.AdamW, "foreach", "kahan", steps=2, dtype=torch.float16, **ADAMW))
    assert counters["stats"]["unique_graphs"] == graphs


def test_helpers_fail_when_the_kernel_is_refused(monkeypatch):
    """The proof that the fused tests prove something: with the fusing predicate refusing every
    slice, the steps silently take the reference pipeline, bit-identical to it, and only the
    backend's element counts tell; the shared helpers then fail. Nothing compiles here."""
    monkeypatch.setattr(kernels.CompiledKernel, "admits", lambda *a, **k: False)
    with pytest.raises(AssertionError, match="elements"):
        train(lo.AdamW, "compiled", "kahan", steps=1, **ADAMW)
    with pytest.raises(AssertionError, match="elements"):
        run_at_index("compiled", "kahan", ElementIndex(), n=100, steps=1, **FP32_STATES)
    refused = train(lo.AdamW, "compiled", "kahan", steps=1, expect_fused=False, **ADAMW)
    assert_same_run(refused, train(lo.AdamW, "foreach", "kahan", steps=1, **ADAMW))


def test_fused_option_selects_backend(monkeypatch):
    small = [torch.zeros(10, dtype=torch.bfloat16)]
    medium = [torch.zeros(backends.AUTO_MIN_NUMEL_NATIVE, dtype=torch.bfloat16)]
    big = [torch.zeros(backends.AUTO_MIN_NUMEL, dtype=torch.bfloat16)]
    native = kernels.native_available()
    assert lo.AdamW(small).backend.name == "foreach"
    assert lo.AdamW(small, fused=False, foreach=False).backend.name == "eager"
    assert lo.AdamW(small, fused=True).backend.name == ("native" if native else "compiled")
    assert lo.AdamW(medium).backend.name == ("native" if native else "foreach")
    assert lo.AdamW(medium, foreach=False).backend.name == "eager"
    monkeypatch.setattr(backends, "native_available", lambda: False)  # e.g. an ARM machine
    assert lo.AdamW(small, fused=True).backend.name == "compiled"
    assert lo.AdamW(medium).backend.name == "foreach"
    assert lo.AdamW(big).backend.name == "compiled"
    monkeypatch.setenv("LOWP_FUSED", "0")
    assert lo.AdamW(big).backend.name == "foreach"
    monkeypatch.delenv("LOWP_FUSED")
    monkeypatch.setattr(backends, "compiler_available", lambda: False)
    assert lo.AdamW(big).backend.name == "foreach"
    with pytest.raises(RuntimeError, match="fused=True"):
        lo.AdamW(small, fused=True)


def test_fused_option_errors():
    p = [torch.zeros(3)]
    with pytest.raises(ValueError, match="fused"):
        lo.AdamW(p, fused="yes")
    with pytest.raises(ValueError, match="fused"):
        lo.AdamW(p, fused=True, backend="eager")
