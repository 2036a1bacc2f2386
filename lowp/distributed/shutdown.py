"""End a ``torch.distributed`` job so that no communication thread outlives the Python interpreter.

Why a script that ends with ``dist.destroy_process_group()`` can still abort at exit
(``terminate called without an active exception``, SIGABRT), seen in ``examples/fsdp_train.py``
under CPU load: ``destroy_process_group`` removes the groups from torch's registry and calls
their ``shutdown()``, but a ``ProcessGroupGloo`` joins its worker threads only in its C++
destructor, which runs when the last Python reference to the group goes. FSDP2 modules, their
``DeviceMesh`` and every ``DTensor`` hold such references, so when ``main()`` returns the worker
threads are still alive while the interpreter finalizes (measured: 4 threads per rank after
``destroy_process_group()`` in the example, 1 after :func:`shutdown`). The path to the abort, as
far as the report's core dump (a gloo worker freeing the last all-reduce's work during
interpreter shutdown) and the experiments show: a worker that finished the last collective a
moment late (descheduled right after completing the work, which the main thread had already seen
as done) drops its last reference to the work's tensors; a tensor that Python handed over needs
the GIL to be freed, and a thread that takes the GIL while the runtime finalizes is terminated
(Python C API, ``PyEval_RestoreThread``: "Calling this function from a thread when the runtime
is finalizing will terminate the thread",
https://docs.python.org/3/c-api/init.html#c.PyEval_RestoreThread). glibc terminates it by
unwinding its stack (``pthread_exit(3)``, https://man7.org/linux/man-pages/man3/pthread_exit.3.html),
and unwinding through a ``noexcept`` C++ destructor calls ``std::terminate``.

:func:`shutdown` closes that window: a barrier (every rank has finished its collectives and
reached the end), ``destroy_process_group()``, then a garbage collection, so that groups held only
by reference cycles (modules with hooks) are destroyed, and their worker threads joined, while
Python is fully alive (torch releases the GIL while destroying a process group, so a worker that
needs it can finish). It counts the groups still referenced afterwards and warns about them.

Freeing the group needs every reference gone, and torch keeps some of its own:

- DTensor's sharding-propagation caches (an unbounded ``lru_cache`` in Python and a native one)
  and its redistribution planners key their entries by ``DTensorSpec`` or mesh, and hold the
  ``DeviceMesh``, which holds the group. After training with FSDP2 the group therefore outlived
  the model, the optimizer and ``destroy_process_group()`` (observed with torch 2.13: the group's
  weak reference stayed alive until those caches were cleared). :func:`shutdown` empties them once
  the groups are destroyed (they only speed up dispatch; a destroyed group's DTensors cannot run
  collectives anyway).
- ``torch.distributed.nn.functional`` (imported by ``torch.distributed.fsdp``) binds
  ``group.WORLD`` as a default argument when it is imported: imported after
  ``init_process_group``, it holds the default group for good. Import ``torch.distributed.fsdp``
  (and ``torch.distributed.checkpoint``) at the top of the script, before ``init_process_group``.
"""
from __future__ import annotations

import datetime
import gc
import importlib
import sys
import warnings
import weakref
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["shutdown"]


def _groups() -> list[Any]:
    """Every process group torch knows of (the default group and those of ``new_group``/``DeviceMesh``)."""
    world = getattr(dist.distributed_c10d, "_world", None)    # private registry; the default group suffices without it
    groups = list(getattr(world, "pg_map", {}) or ())
    default = dist.group.WORLD
    if default is not None and all(g is not default for g in groups):
        groups.append(default)
    return groups


def _weak(objects: list[Any]) -> list[weakref.ref]:
    out = []
    for obj in objects:
        try:
            out.append(weakref.ref(obj))
        except TypeError:    # a binding without weak references: cannot be watched, not counted
            pass
    return out


#: torch's caches whose entries hold a ``DeviceMesh`` (and so its process groups): (module, clearing callable's
#: path). All private, so each is optional; ``debug._clear_sharding_prop_cache`` is torch's own helper for the
#: first two (the Python and the native sharding-propagation caches).
_DTENSOR_CACHES = (
    ("torch.distributed.tensor.debug", "_clear_sharding_prop_cache"),
    ("torch.distributed.tensor", "DTensor._op_dispatcher.sharding_propagator.propagate_op_sharding.cache_clear"),
    ("torch.distributed.tensor",
     "DTensor._op_dispatcher.sharding_propagator._propagate_tensor_meta_cached.cache_clear"),
    ("torch.distributed.tensor._redistribute", "clear_redistribute_planner_cache"),
    ("torch.distributed.tensor._redistribute", "_gen_transform_infos.cache_clear"),
    ("torch.distributed.tensor._collective_utils", "MeshTopoInfo.build_from_mesh.cache_clear"),
)


def _drop_dtensor_caches() -> None:
    """Empty the caches of :data:`_DTENSOR_CACHES` (nothing to do when no DTensor was ever used)."""
    if "torch.distributed.tensor" not in sys.modules:
        return
    for module, path in _DTENSOR_CACHES:
        try:
            obj: Any = importlib.import_module(module)
        except ImportError:
            continue
        for name in path.split("."):
            obj = getattr(obj, name, None)
        if callable(obj):
            obj()


def _barrier(timeout: datetime.timedelta | None) -> None:
    """Every rank of the default group arrives (gloo: a monitored barrier that names the ranks that do not)."""
    backend = str(dist.get_backend())
    if backend == dist.Backend.GLOO:
        dist.monitored_barrier(timeout=timeout, wait_all_ranks=True)
    elif "nccl" in backend and torch.cuda.is_available():
        dist.barrier(device_ids=[torch.cuda.current_device()])
    else:
        dist.barrier()


def shutdown(timeout: float | datetime.timedelta | None = None, *, barrier: bool = True) -> int:
    """Finish every rank's collectives, destroy the process groups and free them while Python is alive.

    A collective: every rank calls it, once, at the end of a run that went well (after a rank
    failed, peers may be stuck in a collective; leave then without it). Call it after the
    objects that hold the group are gone (the model, optimizer, ``DeviceMesh``, the DTensors):
    e.g. train in a function and call ``shutdown()`` after it returns. Without a process group it
    only collects garbage.

    Args:
        timeout: how long the barrier waits for the other ranks, in seconds or as a
            ``timedelta`` (None: the process group's timeout). With gloo the barrier is
            ``monitored_barrier``, which raises naming every rank that did not arrive.
        barrier: False skips the barrier (every rank is known to be past its last collective).

    Returns:
        How many process groups are still referenced after the collection (0 when all were
        freed; each one keeps its communication threads until the interpreter exits, which is
        what this function is meant to avoid, and is reported with a ``RuntimeWarning``).
    """
    if isinstance(timeout, bool) or not (timeout is None or isinstance(timeout, (int, float, datetime.timedelta))):
        raise TypeError(f"timeout: expected None, seconds or a datetime.timedelta, got {timeout!r}")
    if isinstance(timeout, (int, float)):
        if timeout <= 0:
            raise ValueError(f"timeout: expected a positive number of seconds, got {timeout}")
        timeout = datetime.timedelta(seconds=timeout)
    watched: list[weakref.ref] = []
    if dist.is_available() and dist.is_initialized():
        watched = _weak(_groups())
        if barrier:
            _barrier(timeout)
        dist.destroy_process_group()
        _drop_dtensor_caches()
    gc.collect()
    alive = sum(ref() is not None for ref in watched)
    if alive:
        warnings.warn(f"shutdown(): {alive} process group(s) still referenced after destroy_process_group() (by a "
                      "model, DeviceMesh or DTensor still alive, or torch.distributed.fsdp imported after "
                      "init_process_group?); their threads run until the interpreter exits, where they can abort the "
                      "process. Call shutdown() once those objects are gone (see lowp.distributed.shutdown).",
                      RuntimeWarning, stacklevel=2)
    return alive
