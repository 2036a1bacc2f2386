"""Crash-safe ``torch.distributed.checkpoint`` (DCP) checkpoints: one folder per step, published by
an atomic rename once every rank's files are on disk, and loaded only if a marker proves it whole.

``dcp.save(state, checkpoint_id=folder)`` writes each rank's data files and then rank 0's
``.metadata`` into ``folder``, overwriting what is there. Saving over an earlier checkpoint and
being interrupted (a killed job, a full disk, a dead node) leaves some new data files next to the
old ``.metadata`` or the reverse, and ``dcp.load`` reads that mixture without complaint: a state
that never existed. :func:`save` never writes into a folder that can be loaded:

1. the ranks agree on a fresh folder ``root/.step-<step>.tmp-<token>`` (rank 0 draws the token
   and every rank receives it with the other save arguments, which are checked to agree);
2. every rank writes its part there with ``dcp.save`` (DCP fsyncs each file it writes);
3. after a barrier, rank 0 lists the folder and writes the marker ``lowp-checkpoint.json`` (the
   step, the world size, every file's relative path and size), fsyncs it and the folder;
4. rank 0 renames the folder to ``root/step-<step>`` (nine digits) and fsyncs ``root``. A
   ``rename`` of a directory within one file system is atomic: other processes see the old name
   or the new one, never a partial folder (POSIX ``rename()``,
   https://pubs.opengroup.org/onlinepubs/9699919799/functions/rename.html); the directory fsyncs
   make the rename and the files' entries durable (Linux ``fsync(2)``: "an explicit fsync() on a
   file descriptor for the directory is also needed", https://man7.org/linux/man-pages/man2/fsync.2.html);
5. rank 0 removes the ``.tmp`` / ``.old`` folders of dead saves and, with ``keep=``, the oldest
   complete checkpoints (each is first renamed out of sight, then deleted); a last collective
   hands every rank rank 0's outcome, so that all ranks return (or raise) together.

An existing complete ``step-<step>`` is never written into. Saving a step again raises
``FileExistsError`` unless ``replace=True``; then the new folder is written in full first and
swapped in atomically with ``renameat2(RENAME_EXCHANGE)`` on Linux (``rename(2)``,
https://man7.org/linux/man-pages/man2/rename.2.html); where the file system or C library lacks it,
the old folder is renamed aside and the new one renamed in: a crash between the two renames leaves
no ``step-<step>``, so :func:`load` falls back to the previous complete step, never to a mixture.

:func:`load` and :func:`latest` accept a folder only if it is named ``step-<nine digits>``, holds a
marker of that step, and every file the marker lists is on disk with its recorded size and no file
is unlisted (:func:`verify`). Rank 0 picks the folder (the newest complete one, or the one asked
for) and hands its name to every rank, so all load the same one; a folder asked for by step or by
path that is not complete raises :class:`IncompleteCheckpointError` naming it, on every rank.

Assumptions: ``root`` is one shared directory that every rank sees (DCP's file system storage
needs that to load at another world size anyway), on a file system with POSIX ``rename``
semantics (local disks, NFS; not object stores mounted through FUSE); one job saves into a given
``root`` at a time. Sizes catch truncated and missing files, not files overwritten with other
bytes of the same length. With NCCL, the object collectives (the agreement and the outcome) run
through the current CUDA device: call ``torch.cuda.set_device`` first, as DCP itself requires.
"""
from __future__ import annotations

import ctypes
import datetime
import errno
import json
import os
import re
import secrets
import shutil
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

__all__ = ["IncompleteCheckpointError", "MARKER", "complete_checkpoints", "folder_name", "latest", "load", "save",
           "verify"]

#: the completeness marker rank 0 writes last into a checkpoint folder
MARKER = "lowp-checkpoint.json"
_FORMAT = "lowp.distributed.checkpoint/1"
_WIDTH = 9
_STEP_DIR = re.compile(r"step-(\d+)")
_LEFTOVER = re.compile(r"\.step-\d+\.(tmp|old)-[0-9a-f]+")
_SHOWN = 3     # file names quoted per reason
#: errors of rank 0's choice in load() that the other ranks raise as the same type
_ERRORS: dict[str, type[Exception]] = {"FileNotFoundError": FileNotFoundError, "ValueError": ValueError}
_SINGLE_PROCESS = "torch.distributed is disabled, unavailable or uninitialized"   # DCP's warning without a group


class IncompleteCheckpointError(RuntimeError):
    """A folder that is not a complete checkpoint of :func:`save` was asked for; it was not loaded.

    Args:
        folder: the folder refused.
        reason: what is wrong with it (no marker, a missing or resized file, ...).
    """

    def __init__(self, folder: str | os.PathLike, reason: str) -> None:
        self.folder = Path(folder)
        self.reason = reason
        super().__init__(f"{self.folder}: not a complete checkpoint ({reason}); refusing to load it")


def folder_name(step: int) -> str:
    """The name of the folder holding the checkpoint of ``step``: ``step-`` and nine digits (more past 10^9).

    Args:
        step: a non-negative int.
    """
    _check_step(step)
    return f"step-{step:0{_WIDTH}d}"


def _check_step(step: Any) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 0:
        raise ValueError(f"step: expected a non-negative int, got {step!r}")


def _step_of(name: str) -> int | None:
    """The step of a canonical folder name, else None (``step-5`` and ``step-0000000005x`` are not ours)."""
    m = _STEP_DIR.fullmatch(name)
    return int(m[1]) if m and name == folder_name(int(m[1])) else None


def _files(folder: Path) -> dict[str, int]:
    """Every regular file under ``folder`` but the marker: relative POSIX path -> size in bytes."""
    out = {}
    for top, dirs, names in os.walk(folder):
        dirs.sort()
        for name in sorted(names):
            path = Path(top, name)
            rel = path.relative_to(folder).as_posix()
            if rel != MARKER:
                out[rel] = path.stat().st_size
    return out


def _listing(names: list[str]) -> str:
    more = f" and {len(names) - _SHOWN} more" if len(names) > _SHOWN else ""
    return ", ".join(names[:_SHOWN]) + more


def verify(folder: str | os.PathLike) -> dict[str, Any]:
    """Check that ``folder`` is a complete checkpoint written by :func:`save`; return its marker.

    Complete means: a folder named ``step-<nine digits>`` holding a readable marker of that step
    whose file list matches the files on disk exactly (same relative paths, same sizes; DCP's
    ``.metadata`` among them).

    Args:
        folder: the checkpoint folder (``root/step-000000120``).

    Returns:
        The marker: ``step``, ``world_size``, ``files`` (relative path -> size), ``saved_at``, ``torch``.

    Raises:
        IncompleteCheckpointError: naming ``folder`` and what is wrong with it.
    """
    folder = Path(folder)
    if not folder.is_dir():
        raise IncompleteCheckpointError(folder, "no such folder")
    step = _step_of(folder.name)
    if step is None:
        raise IncompleteCheckpointError(folder, f"expected a folder named step-<{_WIDTH} digits>, as save() names them")
    try:
        marker = json.loads((folder / MARKER).read_text())
    except FileNotFoundError:
        raise IncompleteCheckpointError(folder, f"no {MARKER}: the save that wrote it did not finish") from None
    except (OSError, ValueError) as exc:
        raise IncompleteCheckpointError(folder, f"unreadable {MARKER}: {exc}") from None
    listed = marker.get("files") if isinstance(marker, dict) else None
    if (not isinstance(marker, dict) or marker.get("format") != _FORMAT or not isinstance(listed, dict)
            or not all(isinstance(k, str) and isinstance(v, int) for k, v in listed.items())):
        raise IncompleteCheckpointError(folder, f"{MARKER} is not a marker of format {_FORMAT}")
    if marker.get("step") != step:
        raise IncompleteCheckpointError(folder, f"{MARKER} is of step {marker.get('step')!r}, the name says {step}")
    if ".metadata" not in listed:
        raise IncompleteCheckpointError(folder, f"{MARKER} lists no DCP .metadata")
    on_disk = _files(folder)
    problems = []
    missing = sorted(set(listed) - set(on_disk))
    if missing:
        problems.append(f"missing {_listing(missing)}")
    resized = sorted(f"{k} ({on_disk[k]} bytes, {listed[k]} recorded)" for k in set(listed) & set(on_disk)
                     if on_disk[k] != listed[k])
    if resized:
        problems.append(f"resized {_listing(resized)}")
    unlisted = sorted(set(on_disk) - set(listed))
    if unlisted:
        problems.append(f"files written after the save: {_listing(unlisted)}")
    if problems:
        raise IncompleteCheckpointError(folder, "; ".join(problems))
    return marker


def _scan(root: Path) -> list[tuple[int, Path, str | None]]:
    """Every canonical step folder of ``root``, newest first: (step, folder, None if complete else why not)."""
    if not root.is_dir():
        return []
    found: list[tuple[int, Path, str | None]] = []
    for entry in root.iterdir():
        step = _step_of(entry.name)
        if step is None or not entry.is_dir():
            continue
        try:
            verify(entry)
            found.append((step, entry, None))
        except IncompleteCheckpointError as exc:
            found.append((step, entry, exc.reason))
    return sorted(found, key=lambda f: f[0], reverse=True)


def complete_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """The complete checkpoints under ``root`` (see :func:`verify`), oldest first, as (step, folder).

    Args:
        root: the folder :func:`save` writes into; a missing one holds none.
    """
    return [(step, path) for step, path, why in reversed(_scan(Path(root))) if why is None]


def latest(root: str | os.PathLike) -> Path | None:
    """The complete checkpoint of the highest step under ``root``, or None when there is none.

    Folders without a valid marker, with missing, resized or extra files, and the ``.tmp``
    folders of saves in progress or dead are skipped. This only reads the file system; under a
    process group, :func:`load` has rank 0 decide for every rank.

    Args:
        root: the folder :func:`save` writes into.
    """
    done = complete_checkpoints(root)
    return done[-1][1] if done else None


# ---- process group ----------------------------------------------------------------------------

def _group(process_group: dist.ProcessGroup | None) -> tuple[int, int, bool]:
    """(rank, world size, whether a process group is in use)."""
    if not (dist.is_available() and dist.is_initialized()):
        if process_group is not None:
            raise ValueError("process_group: given, but torch.distributed is not initialized")
        return 0, 1, False
    return dist.get_rank(process_group), dist.get_world_size(process_group), True


def _share(obj: Any, process_group: dist.ProcessGroup | None, distributed: bool) -> Any:
    """Rank 0's ``obj`` on every rank (a collective when ``distributed``)."""
    if not distributed:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, group=process_group, group_src=0)
    return box[0]


def _everyones(mine: dict[str, Any], process_group: dist.ProcessGroup | None, distributed: bool,
               world: int) -> list[dict[str, Any]]:
    """Every rank's ``mine``, by rank (a collective when ``distributed``)."""
    if not distributed:
        return [mine]
    views: list[Any] = [None] * world
    dist.all_gather_object(views, mine, group=process_group)
    return views


def _agree(views: list[dict[str, Any]], names: tuple[str, ...], function: str) -> None:
    """Raise (on every rank alike) unless every rank passed the same value of each argument in ``names``."""
    for name in names:
        if any(v[name] != views[0][name] for v in views):
            raise ValueError(f"{name}: every rank must pass the same value to {function}(), got "
                             + ", ".join(f"{v[name]!r} on rank {r}" for r, v in enumerate(views)))


def _fsync_dir(path: Path) -> None:
    """Make the entries of directory ``path`` durable (see the module docstring)."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    except OSError as exc:   # some file systems refuse fsync on directories; their renames are what they are
        if exc.errno not in (errno.EINVAL, errno.ENOTSUP, errno.EBADF):
            raise
    finally:
        os.close(fd)


_RENAME_EXCHANGE = 2    # <linux/fs.h>
_AT_FDCWD = -100


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` atomically (Linux ``renameat2(RENAME_EXCHANGE)``); False where unsupported."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    renameat2.restype = ctypes.c_int
    if renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP):
        return False
    raise OSError(err, f"renameat2(RENAME_EXCHANGE) of {a} and {b}: {os.strerror(err)}")


def _discard(path: Path, token: str) -> None:
    """Rename ``path`` out of sight (``.step-N.old-token``), then delete it: a crash leaves no torn ``step-N``."""
    aside = path.with_name(f".{path.name}.old-{token}")
    os.rename(path, aside)
    shutil.rmtree(aside, ignore_errors=True)


def _publish(tmp: Path, final: Path, step: int, world: int, token: str, keep: int | None) -> None:
    """Rank 0's part after every rank has written: the marker, the rename, the clean-up (see the module docstring)."""
    files = _files(tmp)
    if ".metadata" not in files:
        raise RuntimeError(f"{tmp}: DCP wrote no .metadata; the checkpoint is not published")
    marker = {"format": _FORMAT, "step": step, "world_size": world, "files": files, "torch": torch.__version__,
              "saved_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    with open(tmp / MARKER, "x") as f:
        json.dump(marker, f, indent=1, sort_keys=True)
        f.flush()
        os.fsync(f.fileno())
    _fsync_dir(tmp)
    root = final.parent
    if final.exists():                       # replace=True: swap the complete new folder in
        if _exchange(tmp, final):
            _fsync_dir(root)
            shutil.rmtree(tmp, ignore_errors=True)    # now the old checkpoint, under the .tmp name
        else:
            aside = root / f".{final.name}.old-{token}"
            os.rename(final, aside)
            os.rename(tmp, final)
            _fsync_dir(root)
            shutil.rmtree(aside, ignore_errors=True)
    else:
        os.rename(tmp, final)
        _fsync_dir(root)
    for entry in root.iterdir():             # the folders of dead saves (one job per root)
        if _LEFTOVER.fullmatch(entry.name) and entry.is_dir():
            shutil.rmtree(entry, ignore_errors=True)
    if keep is not None:
        others = [path for s, path in complete_checkpoints(root) if path != final]
        for path in others[:max(0, len(others) - (keep - 1))]:
            _discard(path, token)
    newer = [s for s, _ in complete_checkpoints(root) if s > step]
    if newer:
        warnings.warn(f"saved step {step} to {final}, but {root} also holds complete checkpoints of later steps "
                      f"({_listing([str(s) for s in newer])}): latest() and load() pick those. Remove them if they "
                      "belong to an abandoned run.", stacklevel=3)


def save(state: dict[str, Any], root: str | os.PathLike, step: int, *, keep: int | None = None,
         replace: bool = False, process_group: dist.ProcessGroup | None = None) -> Path:
    """Save ``state`` with DCP as the checkpoint of ``step`` under ``root``, crash-safely (module docstring).

    Every rank of the process group must call it with the same ``step`` (checked); without a
    process group it saves from this one process.

    Args:
        state: what ``dcp.save`` takes (e.g. ``{"model": model_sd, "optim": optim_sd}`` from
            ``get_state_dict``).
        root: the folder holding the checkpoints (created if missing); shared by all ranks.
        step: a non-negative int; the checkpoint goes to ``root/step-<step, nine digits>``.
        keep: None to keep every checkpoint, or a positive int: after this save, only the newest
            ``keep`` complete checkpoints remain (this one always among them).
        replace: what to do if ``step`` was saved before: False raises ``FileExistsError`` before
            anything is written; True writes the new checkpoint in full, then swaps it in.
        process_group: the group whose ranks save (None: the default group, if initialized).

    Returns:
        The published folder, ``root/step-<step>``.

    Raises:
        ValueError: ``step`` or ``keep`` is invalid, or the ranks passed different steps.
        FileExistsError: ``root/step-<step>`` exists and ``replace`` is False.
    """
    root = Path(root)
    rank, world, distributed = _group(process_group)
    # one collective: every rank sees every rank's arguments (so all raise alike) and rank 0's token
    mine: dict[str, Any] = {"step": step, "replace": bool(replace), "keep": keep}
    if rank == 0:
        valid_step = not isinstance(step, bool) and isinstance(step, int) and step >= 0
        mine.update(token=secrets.token_hex(8), exists=valid_step and os.path.lexists(root / folder_name(step)))
    views = _everyones(mine, process_group, distributed, world)
    _check_step(step)
    if keep is not None and (isinstance(keep, bool) or not isinstance(keep, int) or keep < 1):
        raise ValueError(f"keep: expected None or a positive int, got {keep!r}")
    _agree(views, ("step", "replace", "keep"), "save")
    final = root / folder_name(step)
    token, exists = views[0]["token"], views[0]["exists"]
    if exists and not replace:
        raise FileExistsError(f"{final}: step {step} was saved before; pass replace=True to swap in a new "
                              "checkpoint of that step, or save another step")
    tmp = root / f".{final.name}.tmp-{token}"
    writer = dcp.FileSystemWriter(tmp, sync_files=True, overwrite=False)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)    # one process is what was asked for
        dcp.save(state, storage_writer=writer, process_group=process_group, no_dist=not distributed)
    if distributed:
        dist.barrier(group=process_group)   # every rank's files are written and fsynced
    error: Exception | None = None
    failure = None
    if rank == 0:
        try:
            _publish(tmp, final, step, world, token, keep)
        except Exception as exc:    # handed to the other ranks first, so that none waits for rank 0
            error, failure = exc, f"{type(exc).__name__}: {exc}"
    failure = _share(failure, process_group, distributed)
    if error is not None:
        raise error
    if failure is not None:
        raise RuntimeError(f"saving step {step} under {root}: rank 0 could not publish the checkpoint: {failure}")
    return final


def _choose(root: Path, step: int | None) -> tuple[str | None, int]:
    """Rank 0's pick: (the folder's name under ``root``, or None when ``root`` is the folder itself; its step)."""
    if step is not None:
        _check_step(step)
        verify(root / folder_name(step))
        return folder_name(step), step
    own = _step_of(root.name)
    if own is not None and root.is_dir() and not any(_step_of(p.name) is not None for p in root.iterdir()):
        verify(root)                  # root names one checkpoint folder
        return None, own
    found = _scan(root)
    for s, path, why in found:
        if why is None:
            return path.name, s
    refused = "; ".join(f"{path.name}: {why}" for _, path, why in found[:_SHOWN])
    raise FileNotFoundError(f"root: no complete checkpoint in {root}" + (f" (refused: {refused})" if refused else ""))


def load(state: dict[str, Any], root: str | os.PathLike, *, step: int | None = None,
         process_group: dist.ProcessGroup | None = None) -> int:
    """Load the newest complete checkpoint under ``root`` (or the one of ``step``) into ``state``, in place.

    Rank 0 chooses the folder and hands its name to every rank (one ``all_gather_object``, which
    also checks that the ranks passed the same ``step``), so every rank loads the same one or
    raises alike. ``dcp.load`` reshards to this process group's size.

    Args:
        state: what ``dcp.load`` fills (e.g. ``{"model": model_sd, "optim": optim_sd}`` from
            ``get_state_dict``, then handed to ``set_state_dict``).
        root: the folder :func:`save` writes into, or one checkpoint folder (``root/step-000000120``).
        step: load this step's checkpoint instead of the newest; it must be complete.
        process_group: the group whose ranks load (None: the default group, if initialized).

    Returns:
        The step of the checkpoint loaded.

    Raises:
        IncompleteCheckpointError: the folder asked for (by ``step`` or by path) is not complete.
        FileNotFoundError: ``root`` holds no complete checkpoint.
        ValueError: ``step`` is invalid, or the ranks passed different steps.
    """
    root = Path(root)
    rank, world, distributed = _group(process_group)
    # one collective: every rank's ``step`` (checked to agree) and rank 0's choice of folder
    mine: dict[str, Any] = {"step": step}
    failure: BaseException | None = None
    if rank == 0:
        try:
            mine["choice"] = ("ok", *_choose(root, step))
        except IncompleteCheckpointError as exc:
            failure, mine["choice"] = exc, ("incomplete", os.path.relpath(exc.folder, root), exc.reason)
        except Exception as exc:
            failure, mine["choice"] = exc, (type(exc).__name__, str(exc), None)
    views = _everyones(mine, process_group, distributed, world)
    _agree(views, ("step",), "load")
    if failure is not None:
        raise failure
    kind, name, found = views[0]["choice"]
    if kind == "incomplete":
        raise IncompleteCheckpointError(root / name, found)
    if kind != "ok":
        raise _ERRORS.get(kind, RuntimeError)(name if kind in _ERRORS else f"{kind} on rank 0: {name}")
    folder = root if name is None else root / name
    reader = dcp.FileSystemReader(folder)
    _check_kinds(state, reader.read_metadata())
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=_SINGLE_PROCESS)
        dcp.load(state, storage_reader=reader, process_group=process_group, no_dist=not distributed)
    return int(found)


def _check_kinds(state: dict[str, Any], metadata: Any) -> None:
    """Refuse a load that would cast block-scaled codes (integer or fp8 bytes) into a value
    tensor of ``state`` or the reverse: ``dcp.load`` checks sizes only and ``copy_`` casts, so
    the codes of an 8-bit state (saved with ``coded_min_numel=0``, the default before
    2026-11-28) would land in a 16-bit state of this run's layout as their integer values, and
    its block scales would be left behind. The check reads the checkpoint's metadata on every
    rank (no collective), so all ranks refuse alike, before anything is loaded."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict

    from lowp.optim.state_layout import STORED_FLOATS   # value dtypes; any other dtype holds codes
    flat, _ = flatten_state_dict(state)
    saved = metadata.state_dict_metadata
    for key, value in flat.items():
        entry = saved.get(key)
        if not isinstance(value, torch.Tensor) or entry is None or not hasattr(entry, "properties"):
            continue
        mine, theirs = value.dtype, entry.properties.dtype
        if (mine in STORED_FLOATS) != (theirs in STORED_FLOATS):
            raise ValueError(
                f"state[{key!r}]: the checkpoint holds {theirs} there and this run {mine}: block-scaled codes "
                f"on one side and values on the other, which the load would cast; build the optimizer with "
                f"the options the checkpoint was saved with (a state saved as codes for a tensor of fewer "
                f"than 4096 elements: coded_min_numel=0, the default before 2026-11-28), load, then change "
                f"them and convert with opt.load_state_dict(opt.state_dict())")
