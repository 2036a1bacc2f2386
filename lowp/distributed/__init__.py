"""Low-precision gradient reduction: simulate it, model its error, fix it in real collectives.

- :mod:`lowp.distributed.simulator` — R simulated ranks, ring / tree / all-to-all reductions with
  every hop rounded to a lowp format (nearest or stochastic), four averaging schemes.
- :mod:`lowp.distributed.model` — closed-form error model (why the bf16 ring error of that post does
  not grow with R) and the regimes where it does hurt.
- :mod:`lowp.distributed.hooks` — DDP communication hooks for ``torch.distributed``.
- :mod:`lowp.distributed.wire` — 8-bit wire formats with block scales (:class:`WireFormat`).
- :mod:`lowp.distributed.compressed` — a DDP hook with an 8-bit wire, fp32 accumulation and error
  feedback (:class:`CompressedState`, :func:`compressed_hook`).
- :mod:`lowp.distributed.compressed_fsdp` — the same 8-bit wire and error feedback as an FSDP2
  reduce-scatter (:class:`CompressedReduceScatter`, :func:`set_compressed_reduce_scatter`), with
  its residuals checkpointed by DCP.
- :mod:`lowp.distributed.advisor` — per-bucket statistics in, predicted error and warnings out.
- :mod:`lowp.distributed.checkpoint` — crash-safe DCP checkpoints: one folder per step, published
  atomically when complete, loaded only when a marker proves it whole (import it by name).
- :func:`shutdown` (:mod:`lowp.distributed.shutdown`) — end a run: barrier, destroy the process
  groups, free them before the interpreter exits.
"""
from lowp.distributed.compressed import CompressedState, compressed_hook, register_compressed_hook
from lowp.distributed.compressed_fsdp import CompressedReduceScatter, set_compressed_reduce_scatter
from lowp.distributed.shutdown import shutdown
from lowp.distributed.simulator import (ALGORITHMS, AVERAGING, ErrorStats, GaussianGrads, ReduceConfig, accumulate,
                                        exact_reduce, measure_error, reduce, wire_reduce)
from lowp.distributed.wire import WireFormat

__all__ = ["ALGORITHMS", "AVERAGING", "CompressedReduceScatter", "CompressedState", "ErrorStats", "GaussianGrads",
           "ReduceConfig", "WireFormat", "accumulate", "compressed_hook", "exact_reduce", "measure_error", "reduce",
           "register_compressed_hook", "set_compressed_reduce_scatter", "shutdown", "wire_reduce"]
