"""Advice on a gradient-reduction set-up from cheap per-bucket statistics.

Input: :class:`BucketStats` (what :mod:`lowp.distributed.hooks` records with
``collect_stats=True``, or numbers you know), the world size, the reduction dtype, the
algorithm and the averaging scheme. Output: an :class:`Advice` with the predicted error
(from :mod:`lowp.distributed.model`), its ratio to the gradient's own sampling noise
``spread / sqrt(R)`` (what decides whether training notices), the stagnation bias (from a small
simulation with the bucket's mean and spread, since it is not Gaussian), the underflow fraction
and warnings for risky set-ups.

:func:`advise_wire` recommends a wire format for :mod:`lowp.distributed.compressed` and
:mod:`lowp.distributed.compressed_fsdp` (fp8 e4m3 or int8 with error feedback, or bf16) from the
same statistics.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from lowp.distributed import model
from lowp.distributed.simulator import AVERAGING, MAX_WORLD_SIZE, ROUNDINGS, check_number
from lowp.distributed.stats import BucketStats
from lowp.formats import get_format

if TYPE_CHECKING:
    from lowp.distributed.wire import WireFormat

__all__ = ["BucketStats", "Advice", "advise", "advise_buckets", "check_reduce_dtype", "fsdp_reduce_dtype",
           "FSDP_REDUCES_IN_PARAM_DTYPE", "advise_fsdp", "WireAdvice", "advise_wire", "WIRE_NOISE_RATIO"]

NOISE_RATIO_WARN = 0.1     # error above 10 % of the sampling noise is worth a look
BIAS_WARN = 0.01           # 1 % systematic shrinkage of the mean gradient
#: largest error / sampling noise of one 8-bit reduction that :func:`advise_wire` accepts
WIRE_NOISE_RATIO = 0.25


@dataclass
class Advice:
    """Predicted behaviour of one reduction set-up; ``warnings`` lists what to change.

    Built by :func:`advise`; every error is on the scale of the averaged gradient.

    Args:
        algorithm: ``"ring"``, ``"tree"`` or ``"alltoall"``.
        dtype: name of the reduction format (e.g. ``"bf16"``).
        world_size: R.
        error_std: predicted standard deviation of the reduction error of the mean, in gradient
            units (:func:`lowp.distributed.model.reduction_error_std`).
        sampling_noise: the gradient's own sampling noise ``spread_rms / sqrt(R)`` (0 when the
            ranks agree).
        stagnation_bias: simulated relative shrinkage of the mean gradient (``-0.19`` is 19 %
            too small; 0 for all-to-all or a zero mean).
        underflow_fraction: fraction of ``g / R`` values that flush to zero in ``dtype``.
        premultiply_bias: relative scale error of multiplying by ``fl(1/R)`` (0 unless averaging
            by pre-multiplication).
        warnings: one sentence per risky aspect with the remedy (default: none).
    """

    algorithm: str
    dtype: str
    world_size: int
    error_std: float
    sampling_noise: float
    stagnation_bias: float
    underflow_fraction: float
    premultiply_bias: float
    warnings: list[str] = field(default_factory=list)

    @property
    def error_to_noise(self) -> float:
        """``error_std / sampling_noise`` (``inf`` when there is no sampling noise)."""
        return self.error_std / self.sampling_noise if self.sampling_noise > 0 else math.inf

    @property
    def ok(self) -> bool:
        """``True`` when there is no warning."""
        return not self.warnings


def _stagnation_bias(stats: BucketStats, fmt: str, algorithm: str, average: str, rounding: str) -> float:
    """Relative shrinkage of the mean: simulate 2048 elements with the bucket's mean and spread."""
    from lowp.distributed.simulator import GaussianGrads, ReduceConfig, measure_error

    if stats.mean_rms == 0 or algorithm == "alltoall":
        return 0.0
    grads = GaussianGrads(stats.spread_rms, mean=stats.mean_rms, fmt="fp32")
    result = measure_error(stats.world_size, 2048, grads, ReduceConfig(algorithm, fmt, rounding, average))
    return result.relative_bias


def _torch_release() -> tuple[int, int]:
    major, minor = torch.__version__.split(".")[:2]
    return int(major), int(minor)


#: Whether this torch's FSDP2 falls back to ``param_dtype`` for ``reduce_dtype=None`` (before 2.15);
#: from 2.15 on it reduces in the parameter's ``grad_dtype`` (its own dtype unless set), so fp32
#: parameters computed in bf16 are reduced in fp32 (``MixedPrecisionPolicy``'s documentation,
#: "versionchanged:: 2.15").
FSDP_REDUCES_IN_PARAM_DTYPE = _torch_release() < (2, 15)

_SIXTEEN_BITS = (torch.bfloat16, torch.float16)


def fsdp_reduce_dtype(requested: torch.dtype | None, compute_dtype: torch.dtype, grad_dtype: torch.dtype | None,
                      *, falls_back_to_param_dtype: bool = FSDP_REDUCES_IN_PARAM_DTYPE) -> torch.dtype:
    """The dtype in which FSDP2 reduce-scatters a parameter's gradient.

    ``requested``: ``MixedPrecisionPolicy.reduce_dtype``; ``compute_dtype``: the dtype the
    gradient is computed in (``param_dtype``, or the parameter's own dtype without one);
    ``grad_dtype``: the parameter's ``grad_dtype`` (its own dtype unless set; ``None``: whatever
    dtype the gradients come in). An explicit ``reduce_dtype`` wins; without one, torch before 2.15
    reduces in ``compute_dtype``, torch 2.15 and later in ``grad_dtype`` (``compute_dtype`` where
    that is ``None``)."""
    if requested is not None:
        return requested
    if falls_back_to_param_dtype or grad_dtype is None:
        return compute_dtype
    return grad_dtype


def _sixteen_bit_messages(requested: torch.dtype | None, reduced_in: torch.dtype) -> list[str]:
    if reduced_in not in _SIXTEEN_BITS:
        return []
    if requested is None:
        return [f"reduce_dtype is None, so gradients are reduced in {reduced_in}; "
                "set MixedPrecisionPolicy(reduce_dtype=torch.float32) or use an fp32-accumulating hook"]
    return [f"reduce_dtype={requested} sums gradients in 16 bits at every hop; "
            "use reduce_dtype=torch.float32 or lowp.distributed.fsdp.set_fp32_reduce_scatter"]


def check_reduce_dtype(requested: torch.dtype | None, param_dtype: torch.dtype | None,
                       orig_dtype: torch.dtype = torch.float32, *,
                       falls_back_to_param_dtype: bool = FSDP_REDUCES_IN_PARAM_DTYPE) -> list[str]:
    """Warnings when FSDP2 would reduce the gradients of parameters of dtype ``orig_dtype``
    (computed in ``param_dtype``, ``None``: their own dtype) in 16 bits under ``reduce_dtype=
    requested``: silently with ``None`` (:func:`fsdp_reduce_dtype`: before torch 2.15 ``None``
    falls back to ``param_dtype``, bf16 with the usual policy; from 2.15 to the parameters' own
    dtype, so 16-bit parameters still reduce in 16 bits), or explicitly. Empty when the reduction
    is wider."""
    compute = param_dtype or orig_dtype
    reduced_in = fsdp_reduce_dtype(requested, compute, orig_dtype, falls_back_to_param_dtype=falls_back_to_param_dtype)
    return _sixteen_bit_messages(requested, reduced_in)


def _check_stats(stats: BucketStats) -> None:
    """ValueError naming the field of ``stats`` that is not a finite number in its range."""
    for name in ("numel", "world_size"):
        value = getattr(stats, name)
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"stats.{name}: expected a positive int, got {value!r}")
    if stats.world_size > MAX_WORLD_SIZE:
        raise ValueError(f"stats.world_size: expected at most {MAX_WORLD_SIZE} (the stagnation estimate simulates "
                         f"every rank), got {stats.world_size}")
    for name in ("mean_rms", "spread_rms", "absmax"):
        check_number(f"stats.{name}", getattr(stats, name), 0.0)
    check_number("stats.underflow_fraction", stats.underflow_fraction, 0.0, 1.0)


def advise(stats: BucketStats, dtype: "str | torch.dtype" = "bf16", algorithm: str = "ring",
           average: str = "pre_divide", rounding: str = "nearest", loss_scale: float | None = None) -> Advice:
    """Predict the error of reducing a bucket with these statistics and flag risky set-ups.

    ``loss_scale``: the loss scale in use (``None`` = no loss scaling); only consulted for fp16.
    """
    if not isinstance(stats, BucketStats):
        raise TypeError(f"stats: expected BucketStats, got {type(stats).__name__}")
    _check_stats(stats)
    if loss_scale is not None:
        check_number("loss_scale", loss_scale, 0.0, low_open=True)
    if average not in AVERAGING:
        raise ValueError(f"average: expected one of {AVERAGING}, got {average!r}")
    if rounding not in ROUNDINGS:
        raise ValueError(f"rounding: expected one of {ROUNDINGS}, got {rounding!r}")
    fmt = get_format(dtype)
    R, sigma, mu = stats.world_size, stats.spread_rms, stats.mean_rms
    model_average = "sum" if average == "sum" else "pre_divide"
    error = model.reduction_error_std(algorithm, R, sigma, fmt, 0.0, model_average)
    if average == "sum":
        error /= R          # compare on the scale of the mean
    noise = model.sampling_noise(R, sigma) if sigma > 0 else 0.0
    pre_bias = model.premultiply_bias(R, fmt) if average == "premultiply" else 0.0
    underflow = stats.underflow_fraction or (model.underflow_fraction(R, sigma, fmt, mu)
                                             if average in ("pre_divide", "premultiply") and sigma > 0 else 0.0)
    bias = _stagnation_bias(stats, fmt.name, algorithm, average if average != "post_divide" else "sum", rounding)
    advice = Advice(algorithm, fmt.name, R, error, noise, bias, underflow, pre_bias)
    w = advice.warnings
    if fmt.precision < 24 and advice.error_to_noise > NOISE_RATIO_WARN:
        w.append(f"{algorithm} reduction in {fmt.name}: error is {advice.error_to_noise:.2f} x the sampling noise "
                 f"at R={R}; accumulate in fp32 (alltoall_fp32_hook or reduce_dtype=float32)")
    if abs(bias) > BIAS_WARN:
        w.append(f"stagnation: the mean gradient comes out {100 * bias:+.1f} % off (ranks agree in sign and "
                 f"{fmt.name} drops addends below half an ulp of the running sum); use fp32 accumulation or "
                 "stochastic rounding")
    if fmt.name == "fp16" and loss_scale is None:
        w.append("fp16 reduction without loss scaling: small gradients lose precision or flush to zero "
                 "after dividing by R; use a loss scale, sum_then_divide_hook, or bf16/fp32")
    if underflow > 0.01:
        w.append(f"{100 * underflow:.1f} % of g/R underflow to zero in {fmt.name}; divide after the sum in fp32")
    if abs(pre_bias) > BIAS_WARN:
        w.append(f"premultiply by fl(1/{R}) in {fmt.name} scales every gradient by {1 + pre_bias:.5f}; "
                 "divide after the sum in fp32")
    if fmt.bits <= 8 and average in ("pre_divide", "premultiply", "post_divide") and R >= 16:
        w.append(f"fp8 ({fmt.name}) averaging at R={R}: per-hop rounding with {fmt.precision} significant bits; "
                 "send fp8 but accumulate and average in fp32")
    if fmt.name == "fp16" and stats.absmax * R > fmt.max / 2 and average in ("sum", "post_divide"):
        w.append(f"fp16 sum may overflow: sum of |g| reaches {stats.absmax * R:.3g} (max {fmt.max:g})")
    return advice


def advise_buckets(stats: dict[int, BucketStats], dtype: "str | torch.dtype" = "bf16", algorithm: str = "ring",
                   average: str = "pre_divide", rounding: str = "nearest",
                   loss_scale: float | None = None) -> dict[int, Advice]:
    """:func:`advise` for every bucket a hook recorded (``ReduceState.stats``), by bucket index."""
    return {index: advise(s, dtype, algorithm, average, rounding, loss_scale) for index, s in sorted(stats.items())}


def advise_fsdp(model: torch.nn.Module) -> list[str]:
    """Warnings for the gradient reduction of an FSDP2 model (``fully_shard``), for each sharded
    module whose gradients are reduce-scattered in 16 bits (:func:`fsdp_reduce_dtype` of each of
    its parameters: ``MixedPrecisionPolicy(reduce_dtype=None)`` with 16-bit parameters, or before
    torch 2.15 with a bf16/fp16 ``param_dtype``, or an explicit 16-bit ``reduce_dtype``), unless
    the module's reduce-scatter accumulates in fp32
    (:class:`lowp.distributed.fsdp.FP32ReduceScatter`). Empty when nothing is to be changed."""
    from lowp.distributed.fsdp import fsdp_modules, param_groups
    warnings = []
    names = {m: n or "<root>" for n, m in model.named_modules()}
    for module in fsdp_modules(model):
        module_policy = module._get_fsdp_state()._mp_policy
        messages: list[str] = []
        for group in param_groups(module):
            if getattr(getattr(group, "_reduce_scatter_comm", None), "accumulates_in_fp32", False):
                continue
            for param in group.fsdp_params:
                # torch 2.15 resolves a policy per parameter and adds grad_dtype (sharded_grad_dtype)
                policy = getattr(param, "mp_policy", None) or module_policy
                own = param.sharded_param.dtype
                reduced_in = fsdp_reduce_dtype(policy.reduce_dtype, policy.param_dtype or own,
                                               getattr(param, "sharded_grad_dtype", own))
                messages += [m for m in _sixteen_bit_messages(policy.reduce_dtype, reduced_in) if m not in messages]
        warnings += [f"{names[module]}: {m}" for m in messages]
    return warnings


@dataclass
class WireAdvice:
    """The wire format :func:`advise_wire` recommends, with the measurements behind it.

    Args:
        wire: the recommended :class:`~lowp.distributed.wire.WireFormat`.
        error_feedback: whether to keep residuals (True for the 8-bit formats).
        error_to_noise: candidate (``"fp8_e4m3"``, ``"int8"``) -> simulated rms error of one
            reduction over the sampling noise ``spread_rms / sqrt(R)`` (empty without noise).
        reason: one sentence on why.
    """

    wire: "WireFormat"
    error_feedback: bool
    error_to_noise: dict[str, float]
    reason: str


#: simulated ranks and values of :func:`advise_wire` (beyond, the ratio is scaled as if correlated)
_WIRE_SIM_RANKS = 1024
_WIRE_SIM_VALUES = 1 << 18


def advise_wire(stats: BucketStats, block: int = 32, scale: str = "e8m0", threshold: float = WIRE_NOISE_RATIO,
                seed: int = 0) -> WireAdvice:
    """Recommend a wire format for gradients with these statistics.

    The rule: **fp8 e4m3 with error feedback** when one reduction's compression error, simulated,
    is at most ``threshold`` (default :data:`WIRE_NOISE_RATIO` = 0.25) of the sampling noise
    ``spread_rms / sqrt(R)``; else **int8 with error feedback** under the same test; else
    **bf16** (to nearest, no residual). Reasoning:

    - What decides whether training notices is the error next to the gradient's own noise (see
      :mod:`lowp.distributed.experiments`). An independent error of 0.25 x the noise adds in
      quadrature: the noise grows by ``sqrt(1 + 0.25**2) - 1`` = 3 %, like a 6 % smaller batch.
    - Error feedback keeps that error from accumulating: the sum of the reduced gradients over T
      steps is off by the last residual only, so the T-step average error falls as 1/T
      (``lowp reduce-sim --only wire``). It costs one residual per gradient element, and makes the
      one-step error the only thing to test.
    - e4m3 is tried first: a float element keeps about 3 significant bits wherever a value sits
      below its block's largest, so a block with an outlier hurts it only once its smaller values
      fall below e4m3's subnormals (``2**-9 x max / 448``). int8 is more precise for well-behaved
      blocks (about 4x for Gaussian data) but its step is ``max / 127`` for every element of the
      block, so heavy tails make it worse; it is the fallback.
    - The error of one reduction is simulated with :func:`lowp.distributed.simulator.wire_reduce`:
      ``min(R, 1024)`` ranks of ``mean_rms + spread_rms * z`` with one element per block of each
      rank set to ``+-absmax`` (every block's scale set by the bucket's largest value: the worst
      case); the error is measured on the other elements. When ranks agree much more than an
      element's precision, their rounding errors are correlated and do not average out across
      ranks; the simulation sees that at its R, and for ``R > 1024`` the ratio is scaled by
      ``sqrt(R / 1024)`` (fully correlated: conservative).
    - Without sampling noise (``spread_rms == 0``: the ranks agree) there is no noise to hide the
      error in: bf16.
    """
    from lowp.distributed.simulator import GaussianGrads, exact_reduce, wire_reduce
    from lowp.distributed.wire import WireFormat

    if not isinstance(stats, BucketStats):
        raise TypeError(f"stats: expected BucketStats, got {type(stats).__name__}")
    _check_stats(stats)
    check_number("threshold", threshold, 0.0, low_open=True)
    WireFormat(block=block, scale=scale)          # ValueError naming block / scale
    bf16 = WireFormat("bf16")
    R, sigma = stats.world_size, stats.spread_rms
    if sigma == 0:
        return WireAdvice(bf16, False, {}, "the ranks agree (spread_rms = 0): no sampling noise hides an 8-bit "
                                            "wire's error; bf16")
    ranks = min(R, _WIRE_SIM_RANKS)
    elements = max(4 * block, _WIRE_SIM_VALUES // ranks // block * block)
    gen = torch.Generator().manual_seed(seed)
    x = GaussianGrads(sigma, mean=stats.mean_rms, fmt="fp32").sample(ranks, elements, gen)
    if stats.absmax > 0:
        signs = torch.where(torch.rand(ranks, elements // block, generator=gen) < 0.5, -1.0, 1.0)
        x.view(ranks, -1, block)[:, :, 0] = signs * stats.absmax
    exact = exact_reduce(x)
    typical = torch.ones(elements // block, block, dtype=torch.bool)
    typical[:, 0] = stats.absmax == 0          # the planted maxima: their own rounding is not the question
    typical = typical.reshape(-1)
    noise = sigma / math.sqrt(ranks)
    ratios = {}
    for element in ("fp8_e4m3", "int8"):
        got, _ = wire_reduce(x, WireFormat(element, block, scale))
        err = (got - exact)[typical]
        ratios[element] = float(err.pow(2).mean().sqrt()) / noise * math.sqrt(R / ranks)
    for element in ("fp8_e4m3", "int8"):
        if ratios[element] <= threshold:
            return WireAdvice(WireFormat(element, block, scale), True, ratios,
                              f"{element} with {block}-element {scale} blocks: one reduction's error is "
                              f"{ratios[element]:.3g} x the sampling noise (<= {threshold:g}); error feedback keeps "
                              "it from accumulating")
    reason = (f"8-bit wire errors are {ratios['fp8_e4m3']:.3g} (fp8_e4m3) and {ratios['int8']:.3g} (int8) x the "
              f"sampling noise (> {threshold:g}); bf16")
    return WireAdvice(bf16, False, ratios, reason)
