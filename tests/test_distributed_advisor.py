"""The advisor's predictions against the simulator, and its warnings for risky set-ups."""
import functools

import pytest
import torch

from lowp.cli import main
from lowp.distributed.advisor import (FSDP_REDUCES_IN_PARAM_DTYPE, BucketStats, advise, advise_buckets,
                                      check_reduce_dtype, fsdp_reduce_dtype)
from lowp.distributed.simulator import GaussianGrads, ReduceConfig, measure_error


pytestmark = pytest.mark.usefixtures("one_thread")


def test_bf16_ring_zero_mean_is_fine_and_prediction_matches_simulation():
    R, sigma = 256, 0.01
    advice = advise(BucketStats(numel=4096, world_size=R, mean_rms=0.0, spread_rms=sigma), "bf16", "ring")
    sim = measure_error(R, 4096, GaussianGrads(sigma), ReduceConfig("ring", "bf16"))
    assert advice.ok, advice.warnings
    assert advice.error_to_noise == pytest.approx(sim.error_to_noise, rel=0.15)
    assert advice.error_to_noise < 0.05


def test_bf16_ring_with_consistent_sign_flags_stagnation():
    advice = advise(BucketStats(4096, 1024, mean_rms=0.01, spread_rms=0.01), "bf16", "ring")
    assert advice.stagnation_bias < -0.1
    assert any("stagnation" in w for w in advice.warnings)
    fixed = advise(BucketStats(4096, 1024, mean_rms=0.01, spread_rms=0.01), "bf16", "alltoall")
    assert fixed.stagnation_bias == 0.0 and not any("stagnation" in w for w in fixed.warnings)


def test_fp16_without_loss_scaling_and_underflow_are_flagged():
    advice = advise(BucketStats(4096, 1024, mean_rms=0.0, spread_rms=1e-5), "fp16", "ring")
    assert advice.underflow_fraction > 0.9
    assert any("loss scaling" in w for w in advice.warnings)
    assert any("underflow" in w for w in advice.warnings)
    scaled = advise(BucketStats(4096, 8, mean_rms=0.0, spread_rms=1e-2), "fp16", "alltoall", loss_scale=1024.0)
    assert scaled.ok, scaled.warnings


def test_fp8_averaging_at_large_r_and_premultiply_bias_are_flagged():
    fp8 = advise(BucketStats(2048, 64, mean_rms=0.0, spread_rms=0.5), "fp8_e4m3fn", "ring")
    assert any("fp8" in w for w in fp8.warnings)
    assert fp8.error_to_noise > 0.1
    pre = advise(BucketStats(2048, 6, mean_rms=0.0, spread_rms=0.5), "fp8_e5m2", "alltoall", average="premultiply")
    assert pre.premultiply_bias == pytest.approx(-0.0625)
    assert any("premultiply" in w for w in pre.warnings)


def test_advise_buckets_covers_every_recorded_bucket():
    stats = {1: BucketStats(100, 1024, 0.01, 0.01), 0: BucketStats(100, 1024, 0.0, 0.01)}
    advice = advise_buckets(stats, "bf16", "ring")
    assert list(advice) == [0, 1]
    assert advice[0].ok and not advice[1].ok


@pytest.mark.parametrize("legacy", [True, False])
def test_reduce_dtype_fallback_is_flagged(legacy):
    """torch < 2.15 (legacy) falls back to param_dtype, later torch to the parameter's grad_dtype."""
    bf16, fp16, fp32 = torch.bfloat16, torch.float16, torch.float32
    # (requested, compute dtype, grad dtype) -> reduced in, before 2.15 and from 2.15
    table = {(None, bf16, fp32): (bf16, fp32), (None, bf16, bf16): (bf16, bf16), (None, fp32, fp32): (fp32, fp32),
             (None, bf16, None): (bf16, bf16), (None, fp16, fp32): (fp16, fp32), (fp32, bf16, bf16): (fp32, fp32),
             (bf16, fp32, fp32): (bf16, bf16)}
    for (requested, compute, grad), expected in table.items():
        assert fsdp_reduce_dtype(requested, compute, grad, falls_back_to_param_dtype=legacy) == expected[not legacy]
    check = functools.partial(check_reduce_dtype, falls_back_to_param_dtype=legacy)
    assert bool(check(None, bf16)) == legacy                      # fp32 parameters, param_dtype=bf16
    assert "reduced in torch.bfloat16" in check(None, None, bf16)[0]  # bf16 parameters: bf16 either way
    assert "16 bits at every hop" in check(bf16, bf16)[0]
    assert check(fp32, bf16) == [] and check(None, fp32) == [] and check(fp32, None, bf16) == []


def test_reduce_dtype_fallback_follows_this_torch():
    release = tuple(int(part) for part in torch.__version__.split(".")[:2])
    assert FSDP_REDUCES_IN_PARAM_DTYPE == (release < (2, 15))


def test_advisor_rejects_bad_input():
    with pytest.raises(TypeError, match="stats"):
        advise({"numel": 3}, "bf16")
    with pytest.raises(ValueError, match="stats"):
        advise(BucketStats(0, 4, 0.0, 1.0))
    with pytest.raises(ValueError, match="algorithm"):
        advise(BucketStats(10, 4, 0.0, 1.0), "bf16", "mesh")


def test_reduce_sim_command_writes_tables_and_plots(tmp_path, capsys):
    assert main(["reduce-sim", "--out", str(tmp_path), "--only", "seed", "--only", "premultiply",
                 "--max-world-size", "16", "--elements", "512"]) == 0
    out = capsys.readouterr().out
    assert "Why reduction precision matters" in out and "premultiply" in out
    assert (tmp_path / "seed003_error_vs_R.png").stat().st_size > 10_000
    lines = (tmp_path / "seed.csv").read_text().splitlines()
    assert len(lines) == 1 + 4 * 5          # R = 2, 4, 8, 16 x five sigmas


@pytest.mark.parametrize("args, option", [
    (["--elements", "0"], "--elements"),
    (["--elements", "many"], "--elements"),
    (["--elements", "2.5"], "--elements"),
    (["--max-world-size", "1"], "--max-world-size"),
    (["--max-world-size", "1e"], "--max-world-size"),
    (["--only", "everything"], "--only"),
    (["--out", "FILE"], "--out"),
    (["--out", "FILE/sub"], "--out"),
])
def test_reduce_sim_bad_arguments_are_usage_errors(args, option, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("not a folder")
    args = [str(afile) if a == "FILE" else str(afile / "sub") if a == "FILE/sub" else a for a in args]
    with pytest.raises(SystemExit) as info:
        main(["reduce-sim", "--no-plots", *args])
    assert info.value.code == 2
    err = capsys.readouterr().err
    assert f"lowp reduce-sim: error: argument {option}" in err and "Traceback" not in err
    assert afile.read_text() == "not a folder"


def test_advisor_rejects_unknown_average_and_rounding():
    # mean_rms = 0 skips the simulation, which used to be the only place these were checked
    with pytest.raises(ValueError, match="average"):
        advise(BucketStats(10, 4, 0.0, 1.0), "bf16", "ring", average="median")
    with pytest.raises(ValueError, match="rounding"):
        advise(BucketStats(10, 4, 0.0, 1.0), "bf16", "ring", rounding="up")


@pytest.mark.parametrize("field,value", [
    ("mean_rms", float("nan")), ("mean_rms", float("inf")), ("mean_rms", -1.0), ("spread_rms", float("nan")),
    ("spread_rms", -0.5), ("absmax", float("inf")), ("underflow_fraction", float("nan")),
    ("underflow_fraction", 1.5), ("world_size", 10**6), ("world_size", 0), ("numel", 2.5), ("world_size", True),
])
def test_advise_rejects_non_finite_or_out_of_range_stats(field, value):
    """A NaN mean used to answer ok=True; every number is checked, the error names the field."""
    stats = dict(numel=4096, world_size=8, mean_rms=0.01, spread_rms=0.1)
    stats[field] = value
    with pytest.raises(ValueError, match=f"stats.{field}"):
        advise(BucketStats(**stats))


@pytest.mark.parametrize("loss_scale", [float("nan"), float("inf"), 0.0, -8.0])
def test_advise_rejects_bad_loss_scale(loss_scale):
    with pytest.raises(ValueError, match="loss_scale"):
        advise(BucketStats(4096, 8, 0.0, 0.1), "fp16", loss_scale=loss_scale)
