"""Small shared helpers for the command-line reports: aligned text tables, markdown, CSV, and
atomic writes of report files and folders.

Every file a command writes goes through :func:`write_atomic` or :func:`atomic_path`: the
content goes to a temporary file in the destination's folder and ``os.replace`` (atomic on
POSIX within one file system) puts it in place, so a full disk, an error or Ctrl-C leaves the
previous report whole instead of a truncated one. :func:`staged_folder` does the same for a
set of files written over a long run (``lowp reduce-sim``).

Only regular files are ever replaced: a target that is a folder, a symbolic link, a device
(``/dev/null``), a named pipe or a socket makes the write raise :class:`UnsafeOutputError`, checked
with ``os.lstat`` immediately before each ``os.replace`` (the command line refuses such paths
earlier, when it parses its options: :mod:`lowp.cli_args`).
"""
from __future__ import annotations

import contextlib
import csv
import io
import os
import shutil
import stat
import tempfile
from collections.abc import Iterator, Sequence

from lowp.interrupts import deferred_interrupts


class UnsafeOutputError(OSError):
    """An output path exists but is not a regular file (a folder, symbolic link, device, named
    pipe or socket), so writing the report would replace it; nothing was written."""


def non_regular_kind(path: "str | os.PathLike[str]") -> "str | None":
    """What ``path`` is when it exists but is not a regular file, as a phrase for messages
    (``"a folder"``, ``"a symbolic link"``, ``"a character device"`` ...); ``None`` when it is a
    regular file or does not exist.

    Args:
        path: the path to inspect with ``os.lstat``: a symbolic link is reported as one, whatever
            it points to (``os.replace`` would replace the link, not write where it points).
    """
    try:
        mode = os.lstat(path).st_mode
    except (FileNotFoundError, NotADirectoryError):
        return None
    if stat.S_ISREG(mode):
        return None
    for test, kind in ((stat.S_ISLNK, "a symbolic link"), (stat.S_ISDIR, "a folder"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return "not a regular file"


def check_replaceable(path: "str | os.PathLike[str]") -> None:
    """Raise :class:`UnsafeOutputError` naming ``path`` when it exists and is not a regular file.

    Args:
        path: an output file about to be created or replaced.
    """
    kind = non_regular_kind(path)
    if kind is not None:
        raise UnsafeOutputError(f"{os.fspath(path)!r} is {kind}, not a regular file: refusing to replace it "
                                f"(nothing was written there)")


def _cell(value: object) -> str:
    if isinstance(value, float):
        if value == 0 or 1e-3 <= abs(value) < 1e6:
            return f"{value:.6g}"
        return f"{value:.4g}"
    return "-" if value is None else str(value)


def _check_rows(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> None:
    """ValueError naming the first row whose length differs from the headers' (zip would drop cells)."""
    for i, row in enumerate(rows):
        if len(row) != len(headers):
            raise ValueError(f"rows: expected {len(headers)} cells per row (one per header), row {i} has {len(row)}")


def text_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A plain aligned table for the terminal."""
    _check_rows(headers, rows)
    cells = [[_cell(v) for v in row] for row in rows]
    widths = [max(len(h), *(len(r[i]) for r in cells)) if cells else len(h) for i, h in enumerate(headers)]
    line = "  ".join(h.ljust(w) for h, w in zip(headers, widths))
    out = [line, "  ".join("-" * w for w in widths)]
    out += ["  ".join(c.rjust(w) if _numeric(c) else c.ljust(w) for c, w in zip(r, widths)) for r in cells]
    return "\n".join(out)


def markdown_table(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """A GitHub-flavoured markdown table."""
    _check_rows(headers, rows)
    out = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    out += ["| " + " | ".join(_cell(v) for v in row) + " |" for row in rows]
    return "\n".join(out)


def csv_text(headers: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    """CSV text with a header line."""
    _check_rows(headers, rows)
    buf = io.StringIO()
    writer = csv.writer(buf)
    writer.writerow(headers)
    writer.writerows(rows)
    return buf.getvalue()


def _numeric(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


@contextlib.contextmanager
def atomic_path(path: "str | os.PathLike[str]") -> Iterator[str]:
    """Yield a temporary file name next to ``path`` (same folder, same extension, so writers that
    pick a format from the name, like matplotlib, still do); when the block ends normally the
    file replaces ``path`` in one ``os.replace``, otherwise it is removed and ``path`` is untouched.

    ``path`` must be a regular file or not exist: it is checked (:func:`check_replaceable`) before
    the block and again immediately before ``os.replace``, so a path that became a folder, link,
    device or pipe meanwhile raises :class:`UnsafeOutputError`, the temporary file is removed and
    ``path`` is left as it is.

    Args:
        path: the file to create or replace.
    """
    path = os.fspath(path)
    check_replaceable(path)
    folder, name = os.path.split(os.path.abspath(path))
    stem, ext = os.path.splitext(name)
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}.", suffix=f".tmp{ext}", dir=folder)
    os.close(fd)
    try:
        yield tmp
        check_replaceable(path)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def write_atomic(path: "str | os.PathLike[str]", data: "str | bytes") -> None:
    """Write ``data`` (text as UTF-8, or bytes) to ``path`` atomically (see :func:`atomic_path`);
    the data is flushed to disk before the rename, so a full disk raises here, before any swap."""
    with atomic_path(path) as tmp:
        with open(tmp, "wb") as fh:
            fh.write(data.encode() if isinstance(data, str) else data)
            fh.flush()
            os.fsync(fh.fileno())


@contextlib.contextmanager
def staged_folder(out: "str | os.PathLike[str]") -> Iterator[str]:
    """Yield a temporary folder next to ``out`` to write a run's files into. When the block ends
    normally each file is moved into ``out`` with ``os.replace`` (Ctrl-C held meanwhile), so
    ``out`` gets either all of the run's files or none of them; files of earlier runs that this
    run does not write are kept. On an error or Ctrl-C the staging folder is deleted and ``out``
    is untouched.

    A symbolic link ``out`` (or one among its parents) is resolved: the files go into the folder
    it points to, and the staging folder is made next to that folder (``os.replace`` cannot
    move across file systems). ``out`` must then be a folder or not exist, and no file of the
    run may land on an entry of ``out`` that is not a regular file (a folder, link, device, pipe
    or socket): every target is checked before the first move and again immediately before its
    own, and :class:`UnsafeOutputError` names the first offender; nothing is moved when the
    first check fails.

    Args:
        out: the folder that receives the run's files (created if missing).
    """
    out = os.path.realpath(os.fspath(out))
    parent, name = os.path.split(out)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=parent)
    try:
        yield staging
        if os.path.lexists(out) and not os.path.isdir(out):
            raise UnsafeOutputError(f"{out!r} is {non_regular_kind(out) or 'a regular file'}, not a folder: "
                                    f"refusing to write into it (nothing was written)")
        os.makedirs(out, exist_ok=True)
        entries = sorted(os.listdir(staging))
        for entry in entries:
            check_replaceable(os.path.join(out, entry))
        with deferred_interrupts():
            for entry in entries:
                target = os.path.join(out, entry)
                check_replaceable(target)
                os.replace(os.path.join(staging, entry), target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)
