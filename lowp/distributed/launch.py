"""Run a function on a local multi-process ``torch.distributed`` group (gloo on CPU by default).

Used by the tests and handy for trying comm hooks without a cluster. Every rank gets the
same process-group timeout, and the launcher itself waits at most ``join_timeout_s``, so a
rank that dies or hangs makes the call fail with :class:`GroupFailure` naming each rank's fate
instead of blocking forever; a rank killed by a signal (a segmentation fault, an abort) is
reported with the Python stacks :mod:`faulthandler` wrote as it died. Only 127.0.0.1 is used.
"""
from __future__ import annotations

import datetime
import faulthandler
import multiprocessing as mp
import os
import pickle
import queue
import socket
import tempfile
import time
import traceback
from collections.abc import Callable
from typing import Any

__all__ = ["GroupFailure", "free_port", "run_local_group"]


class GroupFailure(RuntimeError):
    """One or more ranks raised, died or did not finish in time. ``.ranks`` maps rank -> status.

    Args:
        ranks: rank -> what happened to it (the traceback of its exception, its exit code, or
            that it timed out); only the ranks that failed. The message lists them in rank order.
    """

    def __init__(self, ranks: dict[int, str]) -> None:
        self.ranks = ranks
        super().__init__("process group failed: " + "; ".join(f"rank {r}: {s}" for r, s in sorted(ranks.items())))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _entry(rank: int, world_size: int, port: int, backend: str, timeout_s: float, fn: Callable[..., Any],
           args: tuple, results: "mp.Queue[tuple[int, str, bytes]]", crash_path: str) -> None:
    crash_file = open(crash_path, "w")   # noqa: SIM115 (open until the process ends, for faulthandler)
    faulthandler.enable(file=crash_file, all_threads=True)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        dist.init_process_group(backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout_s))
        value = fn(rank, world_size, *args)
        results.put((rank, "ok", pickle.dumps(value)))
    except BaseException as exc:  # report every failure, then exit non-zero
        results.put((rank, "error", pickle.dumps(f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=3)}")))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_local_group(fn: Callable[..., Any], world_size: int, *args: Any, backend: str = "gloo",
                    timeout_s: float = 20.0, join_timeout_s: float | None = None) -> list[Any]:
    """Call ``fn(rank, world_size, *args)`` in ``world_size`` spawned processes joined in one
    process group; return each rank's (picklable) return value, by rank.

    ``timeout_s`` is the process-group timeout (a collective waiting on a dead or hung peer
    raises after it); ``join_timeout_s`` (default ``3 * timeout_s + 30``) bounds the whole call:
    ranks still running then are terminated, as are ranks still running ``timeout_s + 1`` seconds
    after another rank failed. Raises :class:`GroupFailure` if any rank failed.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size: expected a positive int, got {world_size!r}")
    if timeout_s <= 0:
        raise ValueError(f"timeout_s: expected > 0, got {timeout_s}")
    ctx = mp.get_context("spawn")
    results: mp.Queue = ctx.Queue()
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="lowp-group-") as crashes:
        paths = [os.path.join(crashes, f"rank{r}.txt") for r in range(world_size)]
        procs = [ctx.Process(target=_entry, args=(r, world_size, port, backend, timeout_s, fn, args, results, paths[r]),
                             daemon=True) for r in range(world_size)]
        return _join(procs, paths, results, world_size, timeout_s, join_timeout_s)


def _crash_report(path: str) -> str:
    """What :mod:`faulthandler` wrote in a rank's file (its stacks at a fatal signal), or ''."""
    try:
        with open(path, errors="replace") as f:
            text = f.read().strip()
    except OSError:
        return ""
    return f"\n{text[-4000:]}" if text else ""


def _join(procs: list, paths: list[str], results: mp.Queue, world_size: int, timeout_s: float,
          join_timeout_s: float | None) -> list[Any]:
    """Start the ranks, collect their reports and join them (:func:`run_local_group`)."""
    for p in procs:
        p.start()
    deadline = time.monotonic() + (3 * timeout_s + 30 if join_timeout_s is None else join_timeout_s)
    reports: dict[int, tuple[str, Any]] = {}
    while len(reports) < world_size and time.monotonic() < deadline:
        try:
            rank, status, payload = results.get(timeout=0.2)
            reports[rank] = (status, pickle.loads(payload))
            if status == "error":     # the others get one more process-group timeout to notice
                deadline = min(deadline, time.monotonic() + timeout_s + 1)
        except queue.Empty:
            if all(not p.is_alive() for p in procs) and results.empty():
                break
    failures: dict[int, str] = {}
    for rank, p in enumerate(procs):
        p.join(timeout=max(0.0, deadline - time.monotonic()) if rank in reports else 0.5)
        if p.is_alive():
            p.terminate()
            p.join(5)
            failures.setdefault(rank, "did not finish before the launcher's deadline; terminated")
        status, value = reports.get(rank, ("missing", None))
        if status == "error":
            failures[rank] = str(value).strip()
        elif status == "missing" and rank not in failures:
            failures[rank] = f"died without reporting (exit code {p.exitcode}){_crash_report(paths[rank])}"
    if failures:
        raise GroupFailure(failures)
    return [reports[r][1] for r in range(world_size)]
