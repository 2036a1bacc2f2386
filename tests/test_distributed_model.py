"""The error model (lowp.distributed.model) against Monte Carlo and against the simulator."""
import math

import pytest
import torch

from lowp.distributed.model import (expected_ulp_sq, premultiply_bias, reduction_error_std, sampling_noise,
                                    stagnation_terms, ulp_constant, underflow_fraction)
from lowp.distributed.simulator import GaussianGrads, ReduceConfig, measure_error, reduce
from lowp.ulp import ulp

SEED_WORLD_SIZES = [2**i for i in range(1, 11)]
SEED_SIGMAS = [2.0**-i for i in range(8, 3, -1)]


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("fmt, std, mean", [("bf16", 0.01, 0.0), ("fp16", 1e-6, 0.0), ("fp8_e4m3fn", 0.3, 0.2)])
def test_expected_ulp_sq_matches_monte_carlo(fmt, std, mean):
    s = mean + std * torch.randn(400000, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    mc = float((ulp(s, fmt) ** 2).mean())
    assert expected_ulp_sq(std, fmt, mean) == pytest.approx(mc, rel=0.01)


def test_ulp_constant_is_near_log_uniform_value():
    """Mantissas of a Gaussian are close to log-uniform: E[1/f**2] = (1/2 - 1/8) / ln 2."""
    for std in (1.0, 0.01, 3e-3):
        assert ulp_constant("bf16", std) == pytest.approx(0.375 / math.log(2), rel=0.01)


@pytest.mark.parametrize("algorithm", ["ring", "tree", "alltoall"])
def test_simulator_agrees_with_model_within_15_percent_on_seed_grid(algorithm):
    worst = 0.0
    for R in SEED_WORLD_SIZES:
        # a 2**k change of sigma scales every value exactly, so two powers of two and 0.01 cover the grid
        for sigma in (SEED_SIGMAS[0], SEED_SIGMAS[-1], 0.01) if R <= 64 else (0.01,):
            # short rings have few, discrete-valued errors: more elements keep the estimate's noise ~2 %
            elements = 16384 if R <= 8 else 4096
            sim = measure_error(R, elements, GaussianGrads(sigma), ReduceConfig(algorithm), seed=R).std
            model = reduction_error_std(algorithm, R, sigma, "bf16")
            worst = max(worst, abs(sim / model - 1))
    assert worst < 0.15


@pytest.mark.parametrize("algorithm, R, sigma", [("ring", 3, 0.01), ("ring", 100, 0.003), ("tree", 6, 0.02),
                                                 ("alltoall", 96, 0.01)])
def test_model_covers_division_rounding_for_non_power_of_two(algorithm, R, sigma):
    sim = measure_error(R, 8192, GaussianGrads(sigma), ReduceConfig(algorithm)).std
    assert sim == pytest.approx(reduction_error_std(algorithm, R, sigma, "bf16"), rel=0.15)


def test_ring_error_is_flat_in_r_and_exceeds_noise_only_slowly():
    sigma = 2**-6
    flat = [reduction_error_std("ring", R, sigma) / sigma for R in (16, 256, 4096)]
    assert max(flat) / min(flat) < 1.1
    assert flat[-1] == pytest.approx(math.sqrt(ulp_constant("bf16", sigma) / 24) * 2**-7, rel=0.02)
    ratio = reduction_error_std("ring", 1024, sigma) / sampling_noise(1024, sigma)
    assert 0.02 < ratio < 0.06


def test_stagnation_point_matches_simulated_sum_of_equal_terms():
    for fmt in ("bf16", "fp16"):
        n = stagnation_terms(fmt)
        x = torch.ones(4 * n, 1)
        got = float(reduce(x, ReduceConfig("ring", fmt, average="sum"))[0])
        assert got == n          # 1.0 addends stop at 2**p exactly (ties to even)


@pytest.mark.parametrize("threshold, fmt_zero, R, sigma", [("zero", True, 64, 1e-4), ("subnormal", False, 8, 1e-3)])
def test_underflow_fraction_matches_simulated_division(threshold, fmt_zero, R, sigma):
    x = GaussianGrads(sigma, fmt="fp16").sample(1, 1 << 20, torch.Generator().manual_seed(1))[0]
    y = reduce((x / R)[None, :], ReduceConfig("exact", average="sum"))
    from lowp.rounding import quantize
    q = quantize(y, "fp16")
    hit = (q == 0) if fmt_zero else (q.abs() < 2.0**-14)
    predicted = underflow_fraction(R, sigma, "fp16", threshold=threshold)
    assert 0.005 < predicted < 0.5
    assert float(hit.double().mean()) == pytest.approx(predicted, rel=0.1)


def test_premultiply_bias_values():
    assert premultiply_bias(4, "bf16") == 0.0
    assert premultiply_bias(3, "bf16") == pytest.approx(3 * 0.333984375 - 1)
    assert premultiply_bias(3, "fp8_e5m2") == pytest.approx(3 * 0.3125 - 1)
    assert abs(premultiply_bias(1000, "fp8_e4m3fn")) > 0.02


def test_model_rejects_bad_arguments():
    with pytest.raises(ValueError, match="algorithm"):
        reduction_error_std("ringg", 4, 1.0)
    with pytest.raises(ValueError, match="world_size"):
        reduction_error_std("ring", 0, 1.0)
    with pytest.raises(ValueError, match="sigma"):
        sampling_noise(4, -1.0)
    with pytest.raises(ValueError, match="average"):
        reduction_error_std("ring", 4, 1.0, average="premultiply")
    with pytest.raises(ValueError, match="threshold"):
        underflow_fraction(4, 1.0, threshold="tiny")
