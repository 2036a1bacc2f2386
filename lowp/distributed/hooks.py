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

Every hook checks its arguments before any collective (``TypeError``/``ValueError`` naming
``state``, ``state.<field>``, ``bucket`` or ``process_group``), then the ranks compare what
decides their collectives (the hook, ``wire_dtype``, ``gather_dtype``, ``collect_stats``, the
bucket's size, dtype and layout) in one small all-gather of integers: ranks that disagree all
raise a ``ValueError`` naming the setting and each distinct value with a rank that has it, where
mismatched collectives would otherwise exchange buffers of different sizes, which aborts the
process inside gloo. A collective that fails (a rank raised or died before joining it, or the
process group timed out) raises an error naming the hook, the collective and the bucket, chained
to the backend's. Empty buckets are returned as they are, without statistics; sparse buckets
(``nn.Embedding(sparse=True)``) are reduced by ``fp32_reduce_hook`` and ``sum_then_divide_hook``
and refused by the all-to-all hooks; fp64 buckets are reduced in fp64 by ``fp32_reduce_hook``.

Set ``ReduceState.collect_stats`` to record per-bucket :class:`~lowp.distributed.advisor.BucketStats`
(mean and spread across ranks, underflow fraction) for :func:`lowp.distributed.advisor.advise`,
at the price of one extra 3-element all-reduce per bucket.

(No ``from __future__ import annotations`` here: DDP compares the hooks' annotations with
``dist.GradBucket`` and ``torch.futures.Future[torch.Tensor]`` as objects.)
"""
import math
import operator
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

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

    Every field is checked when the state is made and again at each hook call (a field set
    later is caught before any collective, the error naming ``state.<field>``).

    Args:
        process_group: group the collectives run on, a ``torch.distributed.ProcessGroup`` or
            ``None`` (default: the default group, which must be initialised before the first
            hook call); anything else (the ``int`` that ``new_group`` returns on a rank outside
            the group, say) raises ``TypeError``.
        wire_dtype: dtype sent over the network: ``torch.bfloat16`` (default), ``torch.float16``
            or ``torch.float32`` (no compression); anything else raises ``ValueError``.
        gather_dtype: dtype of the all-gather of reduced shards in the all-to-all hooks (default
            ``None``: ``wire_dtype``; ``torch.float32`` doubles those bytes and keeps the fp32
            mean); same choices and check as ``wire_dtype``.
        seed: base seed of stochastic rounding, any int, numpy integer included, but not a bool
            (taken modulo 2**64; rank and call are mixed in, see ``_stream_seed``). Default 0.
        collect_stats: record :class:`~lowp.distributed.advisor.BucketStats` per bucket into
            ``stats`` (default ``False``; costs one 3-element all-reduce per bucket). A bool.
        stats: bucket index -> statistics of its latest reduction, a dict (default: empty; filled
            by the hooks; empty buckets get no entry).
        calls: hook calls so far, an int >= 0 (default 0; the hooks count it up, and stochastic
            rounding streams depend on it, so keep it when resuming for identical bits).
    """

    process_group: Optional[dist.ProcessGroup] = None
    wire_dtype: torch.dtype = torch.bfloat16
    gather_dtype: Optional[torch.dtype] = None
    seed: int = 0
    collect_stats: bool = False
    stats: dict[int, BucketStats] = field(default_factory=dict)
    calls: int = 0

    def __post_init__(self) -> None:
        _check_fields(self, "")
        self.seed, self.calls = operator.index(self.seed), operator.index(self.calls)

    @property
    def world_size(self) -> int:
        """Ranks in ``process_group``."""
        return dist.get_world_size(self.process_group)


_WIRE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_BUCKET_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


def _integer(value: Any) -> Optional[int]:
    """``value`` as an int when it is an integer other than a bool (numpy integers included)."""
    if isinstance(value, bool) or not hasattr(value, "__index__") or isinstance(value, torch.Tensor):
        return None
    return operator.index(value)


def _check_fields(state: ReduceState, prefix: str) -> None:
    """Raise naming ``prefix + field`` for the first field of ``state`` the hooks cannot use."""
    if state.process_group is not None and not isinstance(state.process_group, dist.ProcessGroup):
        raise TypeError(f"{prefix}process_group: expected a torch.distributed.ProcessGroup or None, got "
                        f"{type(state.process_group).__name__} (new_group() returns an int on ranks outside the group)")
    for name in ("wire_dtype", "gather_dtype"):
        value = getattr(state, name)
        if (value is not None or name == "wire_dtype") and value not in _WIRE_DTYPES:
            raise ValueError(f"{prefix}{name}: expected torch.bfloat16, torch.float16 or torch.float32"
                             f"{' (or None)' if name == 'gather_dtype' else ''}, got {value}")
    check_seed_and_calls(state, prefix)
    if not isinstance(state.collect_stats, bool):
        raise ValueError(f"{prefix}collect_stats: expected True or False, got {state.collect_stats!r}")
    if not isinstance(state.stats, dict):
        raise TypeError(f"{prefix}stats: expected a dict, got {type(state.stats).__name__}")


def check_seed_and_calls(state: Any, prefix: str) -> None:
    """``ValueError`` naming ``prefix + "seed"`` or ``prefix + "calls"`` unless ``state.seed`` is an
    int (not a bool) and ``state.calls`` an int >= 0 (the hook states' stream inputs)."""
    if _integer(state.seed) is None:
        raise ValueError(f"{prefix}seed: expected an int, got {state.seed!r}")
    calls = _integer(state.calls)
    if calls is None or calls < 0:
        raise ValueError(f"{prefix}calls: expected an int >= 0, got {state.calls!r}")


def _checked(state: Any, bucket: Any, hook: str, sparse: bool) -> torch.Tensor:
    """Check the arguments of hook ``hook`` before any collective; return the bucket's buffer.
    ``sparse``: whether the hook reduces sparse buffers."""
    if not isinstance(state, ReduceState):
        raise TypeError(f"state: expected a lowp.distributed.hooks.ReduceState, got {type(state).__name__} "
                        f"(ddp.register_comm_hook(ReduceState(...), {hook}))")
    _check_fields(state, "state.")
    return check_bucket(state.process_group, bucket, hook, _BUCKET_DTYPES, sparse)


def check_bucket(group: Any, bucket: Any, hook: str, dtypes: tuple[torch.dtype, ...], sparse: bool,
                 methods: tuple[str, ...] = ("buffer", "index")) -> torch.Tensor:
    """The checks of a DDP bucket every hook makes before any collective (``TypeError`` naming
    ``bucket``; ``RuntimeError`` naming ``process_group`` when ``group`` is ``None`` and no default
    group is initialized): a ``GradBucket`` with ``methods``, whose buffer is a tensor of one of
    ``dtypes`` with data, dense (or sparse COO when ``sparse``). Returns the buffer."""
    if not all(callable(getattr(bucket, name, None)) for name in methods):
        raise TypeError(f"bucket: expected a torch.distributed.GradBucket (what DistributedDataParallel's "
                        f"register_comm_hook passes to {hook}), got {type(bucket).__name__}")
    buffer = bucket.buffer()
    if not isinstance(buffer, torch.Tensor):
        raise TypeError(f"bucket: its buffer() is a {type(buffer).__name__}, expected a tensor")
    if buffer.dtype not in dtypes:
        raise TypeError(f"bucket: gradients of dtype {buffer.dtype}; {hook} reduces "
                        f"{', '.join(map(str, dtypes))} buckets")
    if buffer.is_meta:
        raise TypeError("bucket: on the meta device, without data to reduce")
    if buffer.layout == torch.sparse_coo and not sparse:
        raise TypeError(f"bucket: a sparse gradient (nn.Embedding(sparse=True)?); {hook} reduces dense buckets "
                        f"only: use fp32_reduce_hook or sum_then_divide_hook, or dense gradients")
    if buffer.layout not in (torch.strided, torch.sparse_coo):
        raise TypeError(f"bucket: a {buffer.layout} tensor; expected a dense (strided) or sparse COO tensor")
    if _integer(bucket.index()) is None:
        raise TypeError(f"bucket: index() is {bucket.index()!r}, expected an int")
    if group is None and not (dist.is_available() and dist.is_initialized()):
        raise RuntimeError("process_group: None means torch.distributed's default group, which is not initialized; "
                           "call torch.distributed.init_process_group first (DistributedDataParallel needs it too)")
    return buffer


def _renamed(exc: BaseException, message: str) -> BaseException:
    """``exc``'s class with ``message`` (a plain ``RuntimeError`` when that class cannot take one)."""
    try:
        return type(exc)(message)
    except Exception:  # noqa: BLE001 - a backend exception type with another constructor
        return RuntimeError(message)


def _collective(state: Any, hook: str, index: int, op: Callable[..., Any], *args: torch.Tensor) -> None:
    """Run collective ``op(*args, group=...)``; a failure raises naming ``hook``, the collective
    and the bucket, chained to the backend's error."""
    try:
        op(*args, group=state.process_group)
    except RuntimeError as exc:
        name = getattr(op, "__name__", "collective").lstrip("_")
        raise _renamed(exc, f"{hook}: the {name} of bucket {index} on a group of {state.world_size} ranks failed "
                            f"(a rank raised, died or hung before joining it, or the backend refused it): "
                            f"{exc}") from exc


_HOOK_NAMES = ("fp32_reduce_hook", "alltoall_fp32_hook", "stochastic_rounding_hook", "sum_then_divide_hook",
               "compressed_hook")     # the last: lowp.distributed.compressed
#: one compared setting: its name in the error, its value as an int, how to show a value
Setting = tuple[str, int, Callable[[int], str]]
_LAYOUTS = (torch.strided, torch.sparse_coo)


def _agree(state: Any, hook: str, index: int, buffer: torch.Tensor, uses: tuple[str, ...],
           settings: Optional[tuple[Setting, Setting, Setting]] = None) -> None:
    """All ranks compare what decides their collectives for this bucket (one all-gather of a few
    int64); on a difference every rank raises ``ValueError`` naming it. ``uses``: the settings of
    ``state`` that ``hook`` reads (the others may differ harmlessly). ``settings``: three settings
    compared instead of a ``ReduceState``'s ``collect_stats``, ``wire_dtype`` and ``gather_dtype``
    (so every hook sends the same number of integers, and two ranks running different hooks are
    told so instead of aborting inside the backend)."""
    _agreement_check(state, hook, index, _agreement_table(state, hook, index, buffer, uses, settings, None))


def _agreement_fields(state: Any, hook: str, buffer: torch.Tensor, uses: tuple[str, ...],
                      settings: Optional[tuple[Setting, Setting, Setting]]) -> list[Setting]:
    if settings is None:
        gather = state.gather_dtype or state.wire_dtype
        settings = (("state.collect_stats", int(state.collect_stats), lambda v: str(bool(v))),
                    ("state.wire_dtype", _WIRE_DTYPES.index(state.wire_dtype) if "wire_dtype" in uses else -1,
                     lambda v: str(_WIRE_DTYPES[v])),
                    ("state.gather_dtype", _WIRE_DTYPES.index(gather) if "gather_dtype" in uses else -1,
                     lambda v: str(_WIRE_DTYPES[v])))
    return [("hook", _HOOK_NAMES.index(hook), lambda v: _HOOK_NAMES[v]), *settings,
            ("bucket dtype", _BUCKET_DTYPES.index(buffer.dtype), lambda v: str(_BUCKET_DTYPES[v])),
            ("bucket layout", _LAYOUTS.index(buffer.layout), lambda v: str(_LAYOUTS[v])),
            ("bucket size", buffer.numel(), str)]


def _agreement_table(state: Any, hook: str, index: int, buffer: torch.Tensor, uses: tuple[str, ...],
                     settings: Optional[tuple[Setting, Setting, Setting]], async_op: Optional[list[Any]]
                     ) -> tuple[list[Setting], torch.Tensor]:
    """Start (``async_op`` is a list: the work is appended to it) or run the agreement's
    all-gather; return the fields and the gathered ``(R * fields)`` int64 tensor."""
    fields = _agreement_fields(state, hook, buffer, uses, settings)
    mine = torch.tensor([v for _, v, _ in fields], dtype=torch.int64, device=buffer.device)
    R = state.world_size
    every = torch.empty(R * len(fields), dtype=torch.int64, device=buffer.device)
    if async_op is None:
        _collective(state, hook, index, _all_gather, every, mine)
    else:
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        async_op.append(gather(every, mine, group=state.process_group, async_op=True))
    return fields, every


def _agreement_check(state: Any, hook: str, index: int, gathered: tuple[list[Setting], torch.Tensor]) -> None:
    """Raise ``ValueError`` on every rank when the gathered settings differ."""
    fields, every = gathered
    R = state.world_size
    table = every.view(R, len(fields)).tolist()
    for column, (name, _, show) in enumerate(fields):
        first: dict[int, int] = {}
        for rank, row in enumerate(table):
            first.setdefault(row[column], rank)
        if len(first) > 1:
            seen = ", ".join(f"rank {rank}: {show(value)}" for value, rank in sorted(first.items(), key=lambda i: i[1]))
            raise ValueError(f"{name}: the ranks disagree on bucket {index} ({seen}); every rank must register the "
                             f"same hook with the same ReduceState settings on the same model (mismatched "
                             f"collectives would exchange buffers of different sizes)")


def _done(value: torch.Tensor) -> torch.futures.Future[torch.Tensor]:
    fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
    fut.set_result(value)
    return fut


def _all_gather(output: torch.Tensor, shard: torch.Tensor, group: Optional[dist.ProcessGroup]) -> None:
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(output, shard, group=group)


def _record_stats(state: ReduceState, hook: str, index: int, local: torch.Tensor, mean: torch.Tensor) -> None:
    """Across-rank statistics from one 3-element all-reduce and the already reduced mean.

    ``sum_r ||g_r||**2 - R ||mean||**2 = sum_{r,i} (g_ri - mean_i)**2`` gives the spread exactly
    (up to the rounding of ``mean``), without sending a second full-size tensor. Sparse buckets
    are measured densely (their numel is the dense one).
    """
    R = state.world_size
    tiny = get_format(state.wire_dtype).min_subnormal / 2 * R
    local = (local.to_dense() if local.is_sparse else local).float()
    mean = mean.to_dense() if mean.is_sparse else mean
    summary = torch.stack([(local * local).sum(), (local.abs() < tiny).sum().float(), local.abs().max()])
    _collective(state, hook, index, dist.all_reduce, summary)
    n = local.numel()
    mean_sq = float((mean.float() ** 2).sum())
    spread_sq = max(float(summary[0]) - R * mean_sq, 0.0) / (n * max(R - 1, 1))
    state.stats[index] = BucketStats(numel=n, world_size=R, mean_rms=math.sqrt(mean_sq / n),
                                     spread_rms=math.sqrt(spread_sq), underflow_fraction=float(summary[1]) / (n * R),
                                     absmax=float(summary[2]) / R)


def _finish(state: ReduceState, hook: str, bucket: dist.GradBucket, mean: torch.Tensor
            ) -> torch.futures.Future[torch.Tensor]:
    buffer = bucket.buffer()
    if state.collect_stats and buffer.numel():
        _record_stats(state, hook, operator.index(bucket.index()), buffer, mean)
    state.calls += 1
    out = mean.to(buffer.dtype)
    return _done(out if out.is_sparse else out.view(buffer.shape))


def _begin(state: Any, bucket: Any, hook: str, uses: tuple[str, ...], sparse: bool) -> Optional[torch.Tensor]:
    """Checks and the ranks' agreement; the buffer to reduce, or ``None`` for an empty bucket
    (the same on every rank once they agree on its size)."""
    buffer = _checked(state, bucket, hook, sparse)
    _agree(state, hook, operator.index(bucket.index()), buffer, uses)
    return buffer if buffer.numel() else None


def fp32_reduce_hook(state: ReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce in fp32 (fp64 for an fp64 bucket), divide by R likewise, return in the bucket's dtype."""
    buffer = _begin(state, bucket, "fp32_reduce_hook", (), sparse=True)
    if buffer is None:
        return _finish(state, "fp32_reduce_hook", bucket, bucket.buffer())
    dtype = torch.float64 if buffer.dtype == torch.float64 else torch.float32
    total = (buffer if buffer.is_sparse else buffer.reshape(-1)).to(dtype, copy=True)
    _collective(state, "fp32_reduce_hook", bucket.index(), dist.all_reduce, total)
    return _finish(state, "fp32_reduce_hook", bucket, total / state.world_size)


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
    seed = _stream_seed(operator.index(state.seed), rank, operator.index(state.calls))
    gen = torch.Generator(device=values.device).manual_seed(seed)
    return quantize(values.to(torch.float32), state.wire_dtype, "stochastic", generator=gen).to(state.wire_dtype)


def _alltoall_mean(state: ReduceState, bucket: dist.GradBucket, stochastic: bool) -> torch.futures.Future[torch.Tensor]:
    hook = "stochastic_rounding_hook" if stochastic else "alltoall_fp32_hook"
    buffer = _begin(state, bucket, hook, ("wire_dtype", "gather_dtype"), sparse=False)
    if buffer is None:
        return _finish(state, hook, bucket, bucket.buffer())
    index = bucket.index()
    flat = buffer.reshape(-1)
    R, n = state.world_size, flat.numel()
    shard = -(-n // R)
    send = torch.zeros(R * shard, dtype=state.wire_dtype, device=buffer.device)
    send[:n] = _compress(state, flat, stochastic)
    received = torch.empty_like(send)
    _collective(state, hook, index, dist.all_to_all_single, received, send)
    mine = received.view(R, shard).to(torch.float32).sum(dim=0) / R
    gather_dtype = state.gather_dtype or state.wire_dtype
    gathered = torch.empty(R * shard, dtype=gather_dtype, device=buffer.device)
    _collective(state, hook, index, _all_gather, gathered, mine.to(gather_dtype))
    return _finish(state, hook, bucket, gathered[:n])


def alltoall_fp32_hook(state: ReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """Reduce-scatter by all-to-all in ``wire_dtype`` + fp32 local sum + all-gather."""
    return _alltoall_mean(state, bucket, stochastic=False)


def stochastic_rounding_hook(state: ReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """``alltoall_fp32_hook`` with stochastic-rounding compression to ``wire_dtype`` (unbiased)."""
    return _alltoall_mean(state, bucket, stochastic=True)


def sum_then_divide_hook(state: ReduceState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """All-reduce the *sum* in ``wire_dtype``, then divide by R in fp32 (no ``fl(1/R)`` bias,
    no underflow of ``g / R``)."""
    buffer = _begin(state, bucket, "sum_then_divide_hook", ("wire_dtype",), sparse=True)
    if buffer is None:
        return _finish(state, "sum_then_divide_hook", bucket, bucket.buffer())
    total = (buffer if buffer.is_sparse else buffer.reshape(-1)).to(state.wire_dtype, copy=True)
    _collective(state, "sum_then_divide_hook", bucket.index(), dist.all_reduce, total)
    return _finish(state, "sum_then_divide_hook", bucket, total.to(torch.float32) / state.world_size)


HOOKS = {"fp32": fp32_reduce_hook, "alltoall": alltoall_fp32_hook, "stochastic": stochastic_rounding_hook,
         "sum_then_divide": sum_then_divide_hook}
