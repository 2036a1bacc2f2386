"""The cached step plan on the Triton backend (:mod:`lowp.optim.cached_step`,
:class:`~lowp.optim.kernels.triton.kernel.TritonLaunch`) and its non-finite check kernel
(:mod:`lowp.optim.kernels.triton.finite`): the same bits as the ``foreach`` reference on the CPU
through every step, whether a step took the plan or not, NaN and infinite gradients under both
skip policies, a learning-rate schedule, block-scaled states and parameters of two dtypes in one
group. On CPU through Triton's interpreter (``TRITON_INTERPRET=1`` must be set before triton is
imported: a subprocess); on a GPU by the ``gpu``-marked tests."""
from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

from interpreted import run_interpreted
from lowp.optim.randomness import stream_key_table, stream_keys

EIGHT_BIT = {"exp_avg": torch.int8, "exp_avg_sq": torch.uint8}
#: per configuration: the options, and how many of its 6 steps take the plan (the NaN of step 3
#: and the infinity of step 5 each end a plan under skip_param; a skipped step keeps it)
CONFIGS = [({}, 3), ({"nonfinite": "skip_step"}, 5),
           ({"mode": "exact8", "state_dtype": EIGHT_BIT, "coded_min_numel": 0}, 3),
           ({"state_rounding": "nearest", "diagnostics": False}, 3), ({"mode": "stochastic"}, 3)]


def test_stream_key_table_is_stream_keys():
    """The host's vectorized keys (what a Triton launch sends) are the reference's, bit for bit,
    over seeds, steps and parameter ids at the edges of 64 bits."""
    ids = np.array([0, 1, 7, 2**32 - 1, 2**32, 2**63, 2**64 - 1], dtype=np.uint64)
    for seed in (0, 1, 2**63 + 5, 2**64 - 1):
        for step in (1, 2, 1000, 2**40):
            table = stream_key_table(seed, step, ids, 5)
            assert table.dtype == np.uint64 and table.shape == (len(ids), 5)
            assert [[int(k) for k in row] for row in table] == [stream_keys(seed, step, int(i), 5) for i in ids]


@pytest.mark.parametrize("case", ["cached-defaults", pytest.param("cached", marks=pytest.mark.slow), "finite"])
def test_through_the_interpreter(case):
    """``cached``: :func:`check_cached` on CPU tensors (``cached-defaults``: its first
    configuration, the defaults; the others in the slow suite); ``finite``: :func:`check_finite_flags`."""
    pytest.importorskip("triton")
    assert "OK" in run_interpreted(__file__, case)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cached_plan_on_gpu():
    check_cached("cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_finite_check_kernel_on_gpu():
    check_finite_flags("cuda")


def _run(device: str, backend: str, options: dict, steps: int = 6):
    """AdamW over bf16 tensors (and one fp32 tensor) of odd sizes for ``steps`` steps, the
    learning rate decayed every step, a NaN in step 3's gradient of the second tensor and an
    infinity in step 5's of the first."""
    import lowp.optim as lo

    gen = torch.Generator().manual_seed(0)
    shapes = [(300,), (37,), (5, 9), (1030,)]
    start = [torch.randn(s, generator=gen).bfloat16() for s in shapes] + [torch.randn(70, generator=gen)]
    grads = [[torch.randn(p.shape, generator=gen).to(p.dtype) for p in start] for _ in range(steps)]
    grads[2][1][4] = math.nan
    grads[4][0][299] = -math.inf
    params = [p.clone().to(device) for p in start]
    opt = lo.AdamW(params, lr=1e-2, weight_decay=0.1, backend=backend, seed=3, **options)
    for step_grads in grads:
        for p, g in zip(params, step_grads):
            p.grad = g.to(device)
        opt.step()
        for group in opt.param_groups:
            group["lr"] *= 0.9
    return params, opt


def check_cached(device: str, configs: int = len(CONFIGS)) -> None:
    """The first ``configs`` configurations of :data:`CONFIGS` (default all) on the Triton
    backend against the ``foreach`` reference on the CPU: weights, states, step counts, skips and
    stalled counts equal, every element fused, and the planned number of steps taken from the
    cached plan."""
    for options, cached in CONFIGS[:configs]:
        fused, opt = _run(device, "triton", options)
        reference, ref_opt = _run("cpu", "foreach", options)
        assert opt._plans.cached_steps == cached, (options, opt._plans.cached_steps)
        assert opt.backend.reference_elements == 0, options
        assert (opt.skipped_params, opt.skipped_steps) == (ref_opt.skipped_params, ref_opt.skipped_steps), options
        for p, q in zip(fused, reference):
            assert torch.equal(p.cpu(), q), options
            for key, value in ref_opt.state[q].items():
                got = opt.state[p][key]
                assert torch.equal(got.cpu(), value) if torch.is_tensor(value) else got == value, (options, key)
        assert [d["stalled_fraction"] for d in opt.diagnostics()] == \
            [d["stalled_fraction"] for d in ref_opt.diagnostics()], options


def check_finite_flags(device: str) -> None:
    """The check kernel's flags equal ``torch.isfinite(g).all()`` per gradient, for NaN, +-inf
    and the largest finite values at the first, a middle and the last element of tensors of 1
    to 2,000 elements (blocks of 512) in fp32, bf16 and fp16 mixed in one call; strided and
    empty gradients are left to the generic check (``None``) or pass (no element)."""
    from lowp.optim.kernels.triton.kernel import TritonKernel

    kernel = TritonKernel()
    gen = torch.Generator().manual_seed(1)
    grads = []
    sizes = (1, 2, 511, 512, 513, 2000)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        big = torch.finfo(dtype).max
        for n in sizes:
            for at in sorted({0, n // 2, n - 1}):
                for value in (math.nan, math.inf, -math.inf, big, -big):
                    g = torch.randn(n, generator=gen).to(dtype)
                    g[at] = value
                    grads.append(g.to(device))
            grads.append(torch.randn(n, generator=gen).to(dtype).to(device))
    grads.append(torch.zeros(0, device=device))
    strided = torch.randn(8, 4, generator=gen).to(device).t()
    flags = kernel.finite_flags([*grads, strided])
    assert flags[:-1] == [bool(torch.isfinite(g).all()) for g in grads]
    assert flags[-1] is None
    places = sum(len({0, n // 2, n - 1}) for n in sizes)
    assert flags.count(False) == 3 * places * 3   # dtypes x places x (NaN, inf, -inf)


if __name__ == "__main__":
    import interpreter_fma
    interpreter_fma.install()  # Triton < 3.9 rounds the interpreter's fma twice
    {"cached": check_cached, "cached-defaults": lambda device: check_cached(device, 1),
     "finite": check_finite_flags}[sys.argv[1]]("cpu")
    print("OK")
