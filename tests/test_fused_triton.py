"""The multi-tensor Triton kernel (every elementwise rule), checked on CPU through the Triton interpreter
(``TRITON_INTERPRET=1``, which must be set before triton is imported, hence a subprocess), and on
a real GPU by the ``gpu``-marked test.

Interpreter checks: bit-identical to the reference pipeline (with a correctly rounded sqrt) for
nearest/kahan/exact, and stochastic rounding drawing exactly the compiled backend's bits."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")

HERE = Path(__file__).parent


def _interpret(case: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=os.pathsep.join([str(HERE.parent), str(HERE)]))
    done = subprocess.run([sys.executable, str(Path(__file__)), case], env=env, capture_output=True, text=True,
                          timeout=540)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "OK" in done.stdout


@pytest.mark.parametrize("case", ["adamw-kahan", "adam-nearest", "adamw-exact", "amsgrad-kahan", "sgd-kahan",
                                  "sgd-exact", "lion-nearest", "radam-kahan", "radam-exact"])
def test_triton_bit_identical_to_reference(case):
    _interpret(case)


@pytest.mark.parametrize("case", ["adamw-stochastic", "sgd-stochastic"])
def test_triton_stochastic_same_bits_as_compiled(case):
    _interpret(case)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("mode", ["nearest", "kahan", "stochastic", "exact"])
@pytest.mark.parametrize("name", ["AdamW", "SGD", "Lion", "RAdam"])
def test_triton_on_gpu_matches_compiled(name, mode):
    """On CUDA both backends use tl.fma / correctly rounded sqrt and the same random hash."""
    import lowp.optim as lo

    kw = {"AdamW": dict(lr=1e-2, weight_decay=0.1), "SGD": dict(lr=0.05, momentum=0.9, nesterov=True),
          "Lion": dict(lr=1e-3, weight_decay=0.1), "RAdam": dict(lr=1e-2)}[name]

    def run(backend):
        params = [torch.randn(n, device="cuda").bfloat16() for n in (5000, 37, 1 << 20)]
        opt = getattr(lo, name)(params, backend=backend, mode=mode, seed=1, **kw)
        for t in range(3):
            gen = torch.Generator(device="cuda").manual_seed(t)
            for p in params:
                p.grad = torch.randn(p.shape, device="cuda", generator=gen).bfloat16()
            opt.step()
        return params

    for a, b in zip(run("triton"), run("compiled")):
        diff = (a.float() - b.float()).abs()
        assert (diff > 0).float().mean() < 1e-3  # identical up to the compilers' own contractions


def _main(case: str) -> None:
    import lowp.optim as lo
    from fused_helpers import assert_same_run, correctly_rounded_sqrt, train

    name, mode = case.split("-")
    opt_class, kw = {
        "adamw": (lo.AdamW, dict(lr=1e-2, weight_decay=0.1)),
        "adam": (lo.Adam, dict(lr=1e-2, weight_decay=0.1)),
        "amsgrad": (lo.AdamW, dict(lr=1e-2, amsgrad=True, maximize=True)),
        "sgd": (lo.SGD, dict(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01)),
        "lion": (lo.Lion, dict(lr=1e-3, weight_decay=0.1)),
        "radam": (lo.RAdam, dict(lr=1e-2, weight_decay=0.1)),
    }[name]
    kw = dict(kw, steps=8)  # RAdam rectifies from step 6
    backend = "triton"
    from lowp.optim.kernels.triton_backend import TritonBackend
    launches = []
    launch = TritonBackend.launch
    TritonBackend.launch = lambda self, *a: launches.append(a[0].name) or launch(self, *a)
    if mode == "stochastic":
        fused = train(opt_class, backend, mode, **kw)
        assert fused[1].backend.name == backend
        assert_same_run(fused, train(opt_class, "compiled", mode, **kw))
    else:
        kw["state_dtype"] = torch.float32
        fused = train(opt_class, backend, mode, **kw)
        with correctly_rounded_sqrt():
            assert_same_run(fused, train(opt_class, "foreach", mode, **kw))
    assert launches, "the Triton kernel did not run"  # not the compiled fallback
    print("OK")


if __name__ == "__main__":
    _main(sys.argv[1])
