"""DDP communication hooks that reduce low-precision gradients without low-precision sums.

Use with ``ddp_model.register_comm_hook(state, hook)``; ``state`` is a :class:`ReduceState`.
Each hook returns a future holding the *averaged* gradient bucket in the bucket's dtype.

``fp32_reduce_hook``
    Casts the bucket to fp32, all-reduces (sum) and divides by R in fp32. For bf16/fp16
    parameters this is the ``reduce_dtype=float32`` of FSDP. Wire bytes: 4 per element.
``alltoall_fp32_hook``
    Reduce-scatter as an all-to-all in the wire dtype (bf16 by default), each rank adds the R
    shards it owns in fp32 and divides by R in fp32, then an all-gather in ``gather_dtype``.
    A ring reduce-scatter + all-gather moves ``2 (R-1)/R`` elements per rank; so does this,
    but the sum is rounded once instead of at each of R - 1 hops (error independent of R
    for the shard sum; see :mod:`lowp.distributed.model`).
``stochastic_rounding_hook``
    As ``alltoall_fp32_hook`` but the compression to the wire dtype uses stochastic rounding
    (one independent stream per rank and hook call: splitmix64 of the seed, rank and call, see
    ``_stream_seed``), so the compressed gradient is unbiased even for components far below one
    ulp of their neighbours, and the rounding errors of different ranks are uncorrelated.
``sum_then_divide_hook``
    All-reduce *sum* in the wire dtype (no pre-division, so no fp16 underflow of ``g / R``
    and no ``R * fl(1/R)`` bias), then the division by R in fp32. The sum itself is the
    backend's, with its per-hop rounding; watch fp16 overflow (the advisor flags it).

All collectives run to completion inside the hook, which then returns a completed future;
that is simple and deterministic (the tests run them with gloo on CPU), at the cost of not
overlapping these collectives with the rest of the backward pass.

Set ``ReduceState.collect_stats`` to record per-bucket :class:`~lowp.distributed.advisor.BucketStats`
(mean and spread across ranks, underflow fraction) for :func:`lowp.distributed.advisor.advise`,
at the price of one extra 3-element all-reduce per bucket.

(No ``from __future__ import annotations`` here: DDP compares the hooks' annotations with
``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` as objects.)
"""
import math
from dataclasses import dataclass, field
from typing import Optional

import torch
import torch.distributed as dist

from lowp.distributed.stats import BucketStats
from lowp.formats import get_format
from lowp.rounding import quantize

__all__ = ["ReduceState", "fp32_reduce_hook", "alltoall_fp32_hook", "stochastic_rounding_hook",
           "sum_then_divide_hook", "HOOKS"]


@dataclass
class ReduceState:
    """Configuration and bookkeeping shared by the hooks (one instance per DDP model).

    Args:
        process_group: group the collectives run on (default ``None``: the default group, which
            must be initialised before the first hook call).
        wire_dtype: dtype sent over the network: ``torch.bfloat16`` (default), ``torch.float16``
            or ``torch.float32`` (no compression); anything else raises ``ValueError``.
        gather_dtype: dtype of the all-gather of reduced shards in the all-to-all hooks (default
            ``None``: ``wire_dtype``; ``torch.float32`` doubles those bytes and keeps the fp32
            mean); same choices and check as ``wire_dtype``.
        seed: base seed of stochastic rounding, any int (taken modulo 2**64; rank and call are
            mixed in, see ``_stream_seed``). Default 0.
        collect_stats: record :class:`~lowp.distributed.advisor.BucketStats` per bucket into
            ``stats`` (default ``False``; costs one 3-element all-reduce per bucket).
        stats: bucket index -> statistics of its latest reduction (default: empty; filled by the
            hooks).
        calls: hook calls so far (default 0; the hooks count it up, and stochastic rounding
            streams depend on it, so keep it when resuming for identical bits).
    """

    process_group: Optional[dist.ProcessGroup] = None
    wire_dtype: torch.dtype = torch.bfloat16
    gather_dtype: Optional[torch.dtype] = None
    seed: int = 0
    collect_stats: bool = False
    stats: dict[int, BucketStats] = field(default_factory=dict)
    calls: int = 0

    def __post_init__(self) -> None:
        for name in ("wire_dtype", "gather_dtype"):
            value = getattr(self, name)
            if value is not None and value not in (torch.bfloat16, torch.float16, torch.float32):
                raise ValueError(f"{name}: expected torch.bfloat16, torch.float16 or torch.float32, got {value}")

    @property
    def world_size(self) -> int:
        """Ranks in ``process_group``."""
        return dist.get_world_size(self.process_group)


def _done(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(value)
    return fut


def _all_gather(output: torch.Tensor, shard: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, shard, group=group)


def _record_stats(state: ReduceState, index: int, local: torch.Tensor, mean: torch.Tensor) -> None:
    """Across-rank statistics from one 3-element all-reduce and the already reduced mean.

    ``sum_r ||g_r||**2 - R ||mean||**2 = sum_{r,i} (g_ri - mean_i)**2`` gives the spread exactly
    (up to the rounding of ``mean``), without sending a second full-size tensor.
    """
    R = state.world_size
    tiny = get_format(state.wire_dtype).min_subnormal / 2 * R
    local = local.float()
    summary = torch.stack([(local * local).sum(), (local.abs() < tiny).sum().float(), local.abs().max()])
    dist.all_reduce(summary, group=state.process_group)
    n = local.numel()
    mean_sq = float((mean.float() ** 2).sum())
    spread_sq = max(float(summary[0]) - R * mean_sq, 0.0) / (n * max(R - 1, 1))
    state.stats[index] = BucketStats(numel=n, world_size=R, mean_rms=math.sqrt(mean_sq / n),
                                     spread_rms=math.sqrt(spread_sq), underflow_fraction=float(summary[1]) / (n * R),
                                     absmax=float(summary[2]) / R)


def _finish(state: ReduceState, bucket: dist.GradBucket, mean: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    if state.collect_stats:
        _record_stats(state, bucket.index(), buffer, mean)
    state.calls += 1
    return _done(mean.to(buffer.dtype))


def fp32_reduce_hook(state: ReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce in fp32, divide by R in fp32, return in the bucket's dtype."""
    total = bucket.buffer().to(torch.float32, copy=True)
    dist.all_reduce(total, group=state.process_group)
    return _finish(state, bucket, total / state.world_size)


_MASK64 = (1 << 64) - 1
_CALL_BITS = 40     # calls below 2**40 and ranks below 2**24 pack into 64 bits without overlap


def _splitmix64(z: int) -> int:
    """The splitmix64 finalizer (Steele, Lea & Flood, "Fast splittable pseudorandom number
    generators", OOPSLA 2014): a bijection of 64-bit integers that spreads every input bit."""
    z = (z + 0x9E3779B97F4A7C15) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 31)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def _stream_seed(seed: int, rank: int, call: int) -> int:
    """64-bit generator seed of the stochastic rounding stream of ``rank`` at hook call ``call``.

    ``splitmix64(splitmix64(seed) ^ (rank << 40 | call))``: for one ``seed`` the packed key is
    injective for ``rank < 2**24`` and ``call < 2**40`` and splitmix64 is a bijection, so two
    (rank, call) pairs never share a stream (a linear mix such as ``seed*a + rank*b + call``
    gives rank r+1 at call c the stream of rank r at call c+b). Different seeds collide only
    with the ~2**-64 chance of a hash collision.
    """
    if not 0 <= rank < 1 << (64 - _CALL_BITS):
        raise ValueError(f"rank: expected 0 <= rank < {1 << (64 - _CALL_BITS)}, got {rank}")
    key = (rank << _CALL_BITS) | (call & ((1 << _CALL_BITS) - 1))
    return _splitmix64(_splitmix64(seed & _MASK64) ^ key)


def _compress(state: ReduceState, values: torch.Tensor, stochastic: bool) -> torch.Tensor:
    if not stochastic or state.wire_dtype == torch.float32:
        return values.to(state.wire_dtype)
    rank = dist.get_rank(state.process_group)
    gen = torch.Generator(device=values.device).manual_seed(_stream_seed(state.seed, rank, state.calls))
    return quantize(values.to(torch.float32), state.wire_dtype, "stochastic", generator=gen).to(state.wire_dtype)


def _alltoall_mean(state: ReduceState, bucket: dist.GradBucket, stochastic: bool) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    R, n = state.world_size, buffer.numel()
    shard = -(-n // R)
    send = torch.zeros(R * shard, dtype=state.wire_dtype, device=buffer.device)
    send[:n] = _compress(state, buffer, stochastic)
    received = torch.empty_like(send)
    dist.all_to_all_single(received, send, group=state.process_group)
    mine = received.view(R, shard).to(torch.float32).sum(dim=0) / R
    gather_dtype = state.gather_dtype or state.wire_dtype
    gathered = torch.empty(R * shard, dtype=gather_dtype, device=buffer.device)
    _all_gather(gathered, mine.to(gather_dtype), state.process_group)
    return _finish(state, bucket, gathered[:n])


def alltoall_fp32_hook(state: ReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce-scatter by all-to-all in ``wire_dtype`` + fp32 local sum + all-gather."""
    return _alltoall_mean(state, bucket, stochastic=False)


def stochastic_rounding_hook(state: ReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``alltoall_fp32_hook`` with stochastic-rounding compression to ``wire_dtype`` (unbiased)."""
    return _alltoall_mean(state, bucket, stochastic=True)


def sum_then_divide_hook(state: ReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the *sum* in ``wire_dtype``, then divide by R in fp32 (no ``fl(1/R)`` bias,
    no underflow of ``g / R``)."""
    total = bucket.buffer().to(state.wire_dtype, copy=True)
    dist.all_reduce(total, group=state.process_group)
    return _finish(state, bucket, total.to(torch.float32) / state.world_size)


HOOKS = {"fp32": fp32_reduce_hook, "alltoall": alltoall_fp32_hook, "stochastic": stochastic_rounding_hook,
         "sum_then_divide": sum_then_divide_hook}
