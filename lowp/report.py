"""Small shared helpers for the command-line reports: aligned text tables, markdown, CSV, and
atomic writes of report files and folders.

Every file a command writes goes through :func:`write_atomic` or :func:`atomic_path`: the
content goes to a temporary file in the destination's folder and ``os.replace`` (atomic on
POSIX within one file system) puts it in place, so a full disk, an error or Ctrl-C leaves the
previous report whole instead of a truncated one. :func:`staged_folder` does the same for a
set of files written over a long run (``lowp reduce-sim``).
"""
from __future__ import annotations

import contextlib
import csv
import io
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator, Sequence


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
    file replaces ``path`` in one ``os.replace``, otherwise it is removed and ``path`` is untouched."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    stem, ext = os.path.splitext(name)
    fd, tmp = tempfile.mkstemp(prefix=f".{stem}.", suffix=f".tmp{ext}", dir=folder)
    os.close(fd)
    try:
        yield tmp
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
def _sigint_deferred() -> Iterator[None]:
    """Hold Ctrl-C (SIGINT) for the duration of the block and deliver it afterwards (main thread only)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught: list[int] = []
    previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(signum))
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            signal.raise_signal(signal.SIGINT)


@contextlib.contextmanager
def staged_folder(out: "str | os.PathLike[str]") -> Iterator[str]:
    """Yield a temporary folder next to ``out`` to write a run's files into. When the block ends
    normally each file is moved into ``out`` with ``os.replace`` (Ctrl-C held meanwhile), so
    ``out`` gets either all of the run's files or none of them; files of earlier runs that this
    run does not write are kept. On an error or Ctrl-C the staging folder is deleted and ``out``
    is untouched."""
    out = os.path.abspath(os.fspath(out))
    parent, name = os.path.split(out)
    os.makedirs(parent, exist_ok=True)
    staging = tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=parent)
    try:
        yield staging
        os.makedirs(out, exist_ok=True)
        with _sigint_deferred():
            for entry in sorted(os.listdir(staging)):
                os.replace(os.path.join(staging, entry), os.path.join(out, entry))
    finally:
        shutil.rmtree(staging, ignore_errors=True)
