"""The reduction simulator against element-by-element references built from torch's own casts."""
import math

import pytest
import torch

from lowp.distributed.simulator import (GaussianGrads, ReduceConfig, Rounder, accumulate, exact_reduce, measure_error,
                                        reduce)
from lowp.rounding import quantize


pytestmark = pytest.mark.usefixtures("one_thread")


def _bf16_grads(R, N, sigma=2**-6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.normal(0.0, sigma, (R, N), generator=g).bfloat16()


@pytest.mark.parametrize("fmt", ["bf16", "fp16", "fp8_e4m3fn", "fp8_e5m2", "fp32"])
def test_hop_in_container_is_correctly_rounded(fmt):
    """fl(a + b) via the wide container equals the emulated single rounding of the fp64 sum."""
    rnd = Rounder(fmt)
    g = torch.Generator().manual_seed(1)
    a = rnd(torch.randn(20000, generator=g, dtype=torch.float64).to(rnd.container) * 3)
    b = rnd(torch.randn(20000, generator=g, dtype=torch.float64).to(rnd.container)
            * 2.0 ** torch.randint(-12, 4, (20000,), generator=g))
    got = rnd(a + b).double()                     # the simulator's hop, in its container arithmetic
    want = quantize(a.double() + b.double(), fmt, native=False)
    assert torch.equal(rnd(a / 3).double(), quantize(a.double() / 3, fmt, native=False))
    assert torch.equal(got, want)


def test_float64_inputs_are_rounded_once():
    """torch's float64 -> bf16 cast double-rounds through fp32; the simulator must not."""
    x = torch.tensor([[1 + 2**-8 + 2**-40], [0.0]], dtype=torch.float64)
    assert x[0].to(torch.bfloat16).item() == 1.0               # the torch behaviour worked around
    assert reduce(x, ReduceConfig("ring", "bf16", average="sum")).item() == 1 + 2**-7
    assert reduce(x, ReduceConfig("tree", "fp16", average="sum")).item() == 1 + 2**-8


def test_ring_matches_elementwise_reference_with_nccl_chunk_order():
    R, N = 5, 23
    w = _bf16_grads(R, N)
    got = reduce(w.float(), ReduceConfig("ring", "bf16", average="sum"))
    for j in range(N):
        start = (j * R) // N + 1
        acc = w[start % R, j]
        for k in range(1, R):
            acc = acc + w[(start + k) % R, j]      # bf16 + bf16 in torch: correctly rounded
        assert got[j].item() == acc.item(), j


def test_tree_matches_pairwise_reference_for_odd_world_size():
    R, N = 7, 50
    w = _bf16_grads(R, N)
    got = reduce(w.float(), ReduceConfig("tree", "bf16", average="sum"))
    rows = list(w)
    while len(rows) > 1:
        rows = [rows[i] + rows[i + 1] for i in range(0, len(rows) - 1, 2)] + ([rows[-1]] if len(rows) % 2 else [])
    assert torch.equal(got, rows[0].double())


def test_seed_003_sequential_sum_is_reproduced_bit_exactly():
    """Seed 003: o_bf16 = sum(v for v in w / R) is a left-to-right bf16 sum."""
    for R in (2, 8, 64):
        w = _bf16_grads(R, 4096, seed=R)
        seed_result = sum(v for v in w / R)
        assert torch.equal(accumulate(w.float(), "bf16", average=True), seed_result.double())


def test_chunked_processing_equals_one_pass():
    """Column pieces with offset/total keep NCCL's chunk order, so the result is bit-identical."""
    grads = GaussianGrads(2**-5)
    x = grads.sample(64, 3000, torch.Generator().manual_seed(5))
    one = reduce(x, ReduceConfig("ring"))
    parts = torch.cat([reduce(x[:, o:o + 700], ReduceConfig("ring"), offset=o, total=3000)
                       for o in range(0, 3000, 700)])
    assert torch.equal(one, parts)
    whole = measure_error(64, 3000, grads, ReduceConfig("ring"), seed=3)
    pieces = measure_error(64, 3000, grads, ReduceConfig("ring"), seed=3, chunk_budget=64 * 7)
    assert whole.std == pytest.approx(pieces.std, rel=0.1)     # same distribution, different draws


def test_alltoall_fp32_accumulation_rounds_only_once():
    w = _bf16_grads(16, 2048).float()
    got = reduce(w, ReduceConfig("alltoall", "bf16", average="post_divide"))
    want = quantize(w.sum(0) / 16, "bf16").double()
    assert torch.equal(got, want)


def test_fp32_accumulator_is_near_exact_and_exact_reference_has_no_rounding():
    x = GaussianGrads(0.01, fmt="fp32").sample(256, 1000, torch.Generator().manual_seed(0))
    ring = reduce(x, ReduceConfig("ring", "fp32"))
    exact = exact_reduce(x)
    assert torch.equal(reduce(x, ReduceConfig("exact")), exact)
    assert (ring - exact).abs().max() < 256 * 2**-24 * x.abs().max() / 256


@pytest.mark.parametrize("R", [3, 6, 12])
def test_premultiply_scales_by_r_times_rounded_reciprocal(R):
    """NCCL-style averaging in bf16: results are scaled by R * fl(1/R) (3 * fl(1/3) = 1.001953125)."""
    from lowp.distributed.model import premultiply_bias

    x = GaussianGrads(0.1, mean=1.0).sample(R, 20000, torch.Generator().manual_seed(R))
    got = reduce(x, ReduceConfig("alltoall", "bf16", average="premultiply"))
    exact = exact_reduce(x)
    slope = float((got * exact).sum() / (exact * exact).sum())
    assert slope - 1 == pytest.approx(premultiply_bias(R, "bf16"), abs=2e-4)
    assert premultiply_bias(3, "bf16") == pytest.approx(0.001953125)
    fair = reduce(x, ReduceConfig("alltoall", "bf16", average="post_divide"))
    assert abs(float((fair * exact).sum() / (exact * exact).sum()) - 1) < 2e-4


def test_stochastic_rounding_removes_stagnation_bias():
    """R = 1024 identical addends: nearest rounding stalls at 2**8 terms; SR stays unbiased."""
    x = torch.full((1024, 256), 0.75)
    nearest = reduce(x, ReduceConfig("ring", "bf16", average="pre_divide"))
    sr = reduce(x, ReduceConfig("ring", "bf16", rounding="stochastic", average="pre_divide", seed=7))
    assert float(nearest.mean()) < 0.5 * 0.75
    assert float(sr.mean()) == pytest.approx(0.75, rel=0.01)
    again = reduce(x[:, :64], ReduceConfig("ring", "bf16", rounding="stochastic", seed=7))
    assert torch.equal(again, reduce(x[:, :64], ReduceConfig("ring", "bf16", rounding="stochastic", seed=7)))


def test_microbatch_accumulation_in_bf16_loses_small_terms():
    g = torch.full((512, 100), 1.0)
    assert float(accumulate(g, "bf16", average=False)[0]) == 256.0          # stalls at 2**8
    assert float(accumulate(g, "fp32", average=False)[0]) == 512.0


def test_seed_finding_ring_error_flat_tree_error_shrinks():
    ring = [measure_error(R, 4096, GaussianGrads(2**-6), ReduceConfig("ring")).std for R in (8, 128, 1024)]
    tree = [measure_error(R, 4096, GaussianGrads(2**-6), ReduceConfig("tree")).std for R in (8, 128, 1024)]
    assert max(ring) / min(ring) < 1.3
    assert tree[0] / tree[-1] > 4


def test_fp16_pre_divide_underflows_small_gradients():
    stats = measure_error(1024, 4096, GaussianGrads(1e-5, fmt="fp16"), ReduceConfig("ring", "fp16"))
    assert stats.zero_fraction > 0.01
    assert stats.error_to_noise > 0.5      # bf16 at the same R: 0.04


@pytest.mark.parametrize("kwargs, match", [
    (dict(algorithm="butterfly"), "algorithm"),
    (dict(average="mean"), "average"),
    (dict(rounding="up"), "rounding"),
    (dict(fmt="fp13"), "fp13"),
])
def test_bad_config_is_rejected(kwargs, match):
    with pytest.raises(ValueError, match=match):
        ReduceConfig(**kwargs)


def test_bad_inputs_are_rejected():
    with pytest.raises(ValueError, match="x: expected shape"):
        reduce(torch.zeros(5))
    with pytest.raises(TypeError, match="x: expected a floating"):
        reduce(torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="world_size"):
        measure_error(0, 10, GaussianGrads(1.0))
    with pytest.raises(ValueError, match="average"):
        exact_reduce(torch.zeros(2, 2), "avg")
    assert math.isfinite(measure_error(2, 10, GaussianGrads(1.0)).std)


def test_bf16_stochastic_rounding_bit_trick_is_unbiased_and_exact_on_grid():
    rnd = Rounder("bf16", "stochastic", torch.Generator().manual_seed(0))
    x = torch.full((200000,), 1.0 + 2**-9, dtype=torch.float32)      # a quarter of the way to 1 + 2**-7
    out = rnd(x)
    assert set(out.unique().tolist()) == {1.0, 1.0 + 2**-7}
    assert float((out == 1.0 + 2**-7).double().mean()) == pytest.approx(0.25, abs=0.005)
    assert float(rnd(-x).mean()) == pytest.approx(-float(x[0]), rel=1e-4)
    grid = quantize(torch.randn(1000), "bf16")
    assert torch.equal(rnd(grid), grid)


def test_fp8_stochastic_rounding_ring_is_unbiased():
    """Generic (emulated) stochastic rounding: 64 equal addends in e4m3 stall under nearest
    rounding (2**4 = 16 terms) but stay unbiased with SR."""
    x = torch.full((64, 512), 0.5)
    nearest = reduce(x, ReduceConfig("ring", "fp8_e4m3fn", average="sum"))
    sr = reduce(x, ReduceConfig("ring", "fp8_e4m3fn", rounding="stochastic", average="sum", seed=2))
    assert float(nearest[0]) < 0.5 * 32
    assert float(sr.mean()) == pytest.approx(32.0, rel=0.03)
    assert set(sr.unique().tolist()) <= set(quantize(sr, "fp8_e4m3fn").tolist())


@pytest.mark.parametrize("kwargs, name", [({"offset": -1}, "offset"), ({"offset": 1.5}, "offset"),
                                          ({"offset": 4, "total": 6}, "total"), ({"total": 2}, "total")])
def test_reduce_rejects_bad_offset_and_total(kwargs, name):
    with pytest.raises(ValueError, match=name):
        reduce(torch.ones(3, 4), ReduceConfig(), **kwargs)


@pytest.mark.parametrize("kwargs,name", [
    (dict(sigma=float("nan")), "sigma"), (dict(sigma=-1.0), "sigma"), (dict(sigma=1.0, mean=float("inf")), "mean"),
    (dict(sigma=1.0, outlier_scale=float("nan")), "outlier_scale"), (dict(sigma="1"), "sigma"),
])
def test_gaussian_grads_reject_non_finite_numbers(kwargs, name):
    with pytest.raises((ValueError, TypeError), match=name):
        GaussianGrads(**kwargs)


def test_sizes_beyond_the_documented_limits_are_refused_before_any_work():
    """World sizes above MAX_WORLD_SIZE and simulations above MAX_SIMULATED_VALUES are refused at
    once (they used to run for tens of minutes), naming the argument."""
    import time

    from lowp.distributed import experiments
    from lowp.distributed.simulator import MAX_SIMULATED_VALUES, MAX_WORLD_SIZE

    start = time.perf_counter()
    with pytest.raises(ValueError, match="world_size"):
        measure_error(MAX_WORLD_SIZE + 1, 1, GaussianGrads(1.0))
    with pytest.raises(ValueError, match="elements"):
        measure_error(2, MAX_SIMULATED_VALUES // 2 + 1, GaussianGrads(1.0))
    with pytest.raises(ValueError, match="world_size"):
        measure_error(2.5, 10, GaussianGrads(1.0))
    with pytest.raises(ValueError, match="world_size"):
        experiments.seed_grid([2, 2 * MAX_WORLD_SIZE])
    with pytest.raises(ValueError, match="elements"):
        experiments.seed_grid([MAX_WORLD_SIZE], elements=MAX_SIMULATED_VALUES // MAX_WORLD_SIZE)  # x 5 sigmas
    with pytest.raises(ValueError, match="elements"):
        experiments.outlier_table(elements=0)
    assert time.perf_counter() - start < 5


def test_experiments_report_progress_per_row():
    from lowp.distributed import experiments

    ticks = []
    headers, rows = experiments.outlier_table(world_sizes=(4, 8), scales=(1.0,), elements=16,
                                              progress=lambda: ticks.append(1))
    assert len(ticks) == len(rows) == 2
