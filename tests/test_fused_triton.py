"""The generated Triton kernels beyond the generic cases of test_registry.py: a tensor whose global
element indices cross 2**32 (through the interpreter, ``TRITON_INTERPRET=1``, which must be set
before triton is imported, hence a subprocess), and a real GPU by the ``gpu``-marked test."""
from __future__ import annotations

import math
import sys

import pytest
import torch

from interpreted import run_interpreted

pytest.importorskip("triton")


@pytest.mark.parametrize("case", ["index-kahan", "index-stochastic", "index-exact8",   # the coded ones 14-27 s:
                                  *(pytest.param(c, marks=pytest.mark.slow)            # test_optim_codes has one
                                    for c in ("coded-stochastic", "coded-nearest"))])
def test_triton_stochastic_rounding_bit_identical_to_reference(case):
    """The ``index`` cases also check that the shared helpers fail when the fusing predicate
    refuses every slice (:func:`_assert_helpers_fail_when_refused`; no kernel runs there)."""
    assert "OK" in run_interpreted(__file__, case)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["nearest", "kahan", "stochastic", "exact", "exact8"])
@pytest.mark.parametrize("name", ["AdamW", "SGD", "Lion", "RAdam"])
def test_triton_on_gpu_matches_reference(name, mode):
    """On CUDA the Triton kernel takes the steps of the definition, the ``foreach`` reference on
    the CPU, bit for bit (weights, states, buffers and the stalled counts): correctly rounded sqrt
    and division, no contraction beyond the rule's own fused multiply-adds, the same random bits."""
    import lowp.optim as lo

    kw = {"AdamW": dict(lr=1e-2, weight_decay=0.1), "SGD": dict(lr=0.05, momentum=0.9, nesterov=True),
          "Lion": dict(lr=1e-3, weight_decay=0.1), "RAdam": dict(lr=1e-2)}[name]
    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(n, generator=gen).bfloat16() for n in (5000, 37, 1 << 20)]
    grads = [[torch.randn(p.shape, generator=gen).bfloat16() for p in start] for _ in range(3)]

    def run(backend, device):
        params = [p.to(device) for p in start]
        opt = getattr(lo, name)(params, backend=backend, mode=mode, seed=1, **kw)
        for step_grads in grads:
            for p, g in zip(params, step_grads):
                p.grad = g.to(device)
            opt.step()
        return params, opt

    fused, opt = run("triton", "cuda")
    assert opt.backend.fused_elements == 3 * sum(p.numel() for p in fused)  # every element took the kernel
    reference, ref_opt = run("foreach", "cpu")
    for a, b in zip(fused, reference):
        assert torch.equal(a.cpu(), b), f"{(a.cpu() != b).float().mean().item():.2e} of the weights differ"
    for p, q in zip(fused, reference):
        for key, value in ref_opt.state[q].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(opt.state[p][key].cpu(), value), key
    assert [d["stalled_fraction"] for d in opt.diagnostics()] == [d["stalled_fraction"] for d in ref_opt.diagnostics()]


def _assert_helpers_fail_when_refused(mode: str) -> None:
    """With the Triton and compiled kernels refusing every slice, the steps take the reference
    pipeline (bit-identical by design) and the helpers' element counts fail them."""
    import lowp.optim as lo
    from fused_helpers import run_at_index, train
    from lowp.optim.kernels.kernel import Kernel
    from lowp.optim.randomness import ElementIndex

    original = Kernel.admits
    Kernel.admits = lambda *a, **k: False
    try:
        for run in (lambda: train(lo.AdamW, "triton", mode, steps=1, shapes=[(40,), (3, 5)]),
                    lambda: run_at_index("triton", mode, ElementIndex(), n=100, steps=1)):
            try:
                run()
            except AssertionError as e:
                assert "elements" in str(e), e
            else:
                raise AssertionError("a refused kernel went unnoticed")
    finally:
        Kernel.admits = original


def _main(case: str) -> None:
    from fused_helpers import run_at_index
    from lowp.optim.kernels.triton.kernel import TritonLaunch
    from lowp.optim.randomness import ElementIndex

    launches = []
    stage = TritonLaunch.stage   # every launch is staged, then run
    TritonLaunch.stage = lambda *a, **k: launches.append(1) or stage(*a, **k)
    name, mode = case.split("-")
    if name == "index":  # one slice of 1000 elements from global index 2**32 - 100 on
        index = ElementIndex(offset=(1 << 32) - 100)
        for x, y in zip(run_at_index("triton", mode, index), run_at_index("foreach", mode, index)):
            assert torch.equal(x, y)
        assert launches, "the Triton kernel did not run"
        _assert_helpers_fail_when_refused(mode)
        print("OK")
        return
    if name == "coded":
        _coded(mode)
        assert launches, "the Triton kernel did not run"
        print("OK")
        return
    raise ValueError(f"unknown case {case!r}")


#: block-scaled states of every code, some states left plain
CODED = [{"exp_avg": torch.int8, "exp_avg_sq": torch.uint8},
         {"exp_avg": torch.float8_e4m3fn, "exp_avg_sq": torch.float8_e4m3fn},
         {"exp_avg": torch.float8_e5m2, "exp_avg_sq": torch.uint4},  # type: ignore[attr-defined]
         {"exp_avg": torch.int8}]


def _coded(rounding: str) -> None:
    """AdamW with block-scaled states through the Triton kernel (decode and encode inside it)
    against the ``foreach`` reference: weights, codes and scales bit for bit, every element fused.
    Odd sizes leave a short last block and half a byte of 4-bit codes; two more runs put block
    scales of 0, 1e-39, 1e-34 and NaN and a NaN gradient in the second step."""
    from fused_helpers import same_bits_or_nan
    from lowp.optim.codes import CODES, decode
    import lowp.optim as lo

    gen = torch.Generator().manual_seed(0)
    start = [torch.randn(n, generator=gen).bfloat16() for n in (3000, 37, 1027)]
    # the last tensor's gradients are so small that its blocks' reciprocal scales overflow: they divide
    grads = [[(torch.randn(p.shape, generator=gen) * (1e-36 if i == 2 else 1.0)).bfloat16()
              for i, p in enumerate(start)] for _ in range(3)]
    extra = {} if rounding == "stochastic" else {"state_block": 32, "state_scale_dtype": torch.float16}

    def run(backend, states, odd=False):
        """``odd``: after the first step, block scales of 0, 1e-39, 1e-34 (its reciprocal is finite,
        times 2**16 it is not) and NaN, and a NaN gradient in the second step."""
        params = [p.clone() for p in start]
        opt = lo.AdamW(params, lr=1e-2, weight_decay=0.1, backend=backend, seed=1, state_dtype=states,
                       coded_min_numel=0, state_rounding=rounding, **extra)
        for step, step_grads in enumerate(grads):
            for p, g in zip(params, step_grads):
                p.grad = g.clone()
            if odd and step == 1:
                params[0].grad[2000] = math.nan
                for p in params:
                    for name, v in opt.state[p].items():
                        if name.endswith("_scale"):
                            for k, value in enumerate((0.0, 1e-39, 1e-34, math.nan)):
                                v.view(-1)[k::7] = value
            opt.step()
        return params, opt

    if not extra:  # bf16 scales hold the tiny ones (fp16's smallest is 2**-24)
        tiny = list(run("foreach", CODED[0])[1].state.values())
        scales = [v["exp_avg_scale"].float() for v in tiny]
        assert not torch.isfinite(1.0 / scales[2]).all() and torch.isfinite(1.0 / scales[0]).all()  # the divide path
        assert decode(tiny[2]["exp_avg"], scales[2], CODES[torch.int8], 64, 1027).abs().max() > 0
    for states, odd in [(states, False) for states in CODED] + [(CODED[1], True), (CODED[2], True)]:
        fused, opt = run("triton", states, odd)
        steps = 3 - odd * (3000 / sum(p.numel() for p in start))   # the NaN gradient skips a parameter once
        assert opt.backend.fused_elements == round(steps * sum(p.numel() for p in start)), states
        assert opt.backend.reference_elements == 0
        reference, ref_opt = run("foreach", states, odd)
        assert any(q.isnan().any() for q in reference) == odd
        for p, q in zip(fused, reference):
            assert same_bits_or_nan(p, q), states
            for key, value in ref_opt.state[q].items():
                if isinstance(value, torch.Tensor):
                    assert same_bits_or_nan(opt.state[p][key], value), (states, key)


if __name__ == "__main__":
    import interpreter_fma
    interpreter_fma.install()  # Triton < 3.9 rounds the interpreter's fma twice
    _main(sys.argv[1])
