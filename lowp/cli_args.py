"""Argument types for the ``lowp`` subcommands: bad values become argparse errors.

An argparse ``type=`` callable that raises :class:`argparse.ArgumentTypeError` makes argparse
print ``lowp <command>: error: argument --name: <message>`` and exit with status 2, instead
of a traceback from deep inside ``run``. (This module lives outside :mod:`lowp.commands`,
where every module is a subcommand.)
"""
from __future__ import annotations

import argparse
import decimal
import math
import os
import sys
from typing import Callable, Iterable, NoReturn

__all__ = ["int_at_least", "int_in", "int_list", "float_in", "format_spec", "format_list", "output_dir",
           "output_file", "usage_error", "writable_folder", "writable_file", "available_memory", "check_memory",
           "check_at_most", "SEED_MAX"]

#: the largest seed torch's generators take (``torch.manual_seed`` and ``Generator.manual_seed``
#: accept ``[-2**63, 2**64)``, negative seeds standing for ``seed + 2**64``) and lowp's optimizers
#: take (``[0, 2**64)``, :func:`lowp.optim.preflight.check_seed`)
SEED_MAX = 2**64 - 1


def _bound(value: int) -> str:
    """``value`` for a message: ``2**64 - 1`` rather than twenty digits for bounds near a power of two."""
    for k in range(32, 129):
        if abs(value - 2**k) <= 16:
            off = value - 2**k
            return f"2**{k}" + (f" - {-off}" if off < 0 else f" + {off}" if off > 0 else "")
    return str(value)


def _integer(text: str, minimum: int, maximum: "int | None" = None, note: str = "") -> int:
    """``text`` as an int in ``[minimum, maximum]`` (no upper bound for ``None``); ``"1e5"`` is
    accepted as 100000, ``"2.5"`` is not. Parsed exactly (as a decimal, not a float), so
    ``"18446744073709551615"`` is not rounded to ``2**64``."""
    number: "int | None" = None
    try:
        value = decimal.Decimal(text.strip())
        if value.is_finite() and math.isfinite(float(value)) and value == value.to_integral_value():
            number = int(value)
    except (decimal.InvalidOperation, ValueError):
        pass
    if number is None or number < minimum or (maximum is not None and number > maximum):
        expected = (f"an integer >= {_bound(minimum)}" if maximum is None
                    else f"an integer in [{_bound(minimum)}, {_bound(maximum)}]")
        raise argparse.ArgumentTypeError(f"expected {expected}{note}, got {text!r}")
    return number


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: one integer >= ``minimum``."""
    def parse(text: str) -> int:
        return _integer(text, minimum)
    parse.__name__ = f"integer >= {minimum}"     # argparse names the type in some messages
    return parse


def int_in(minimum: int, maximum: int, note: str = "") -> Callable[[str], int]:
    """An argparse type: one integer in ``[minimum, maximum]``.

    Args:
        minimum: the smallest accepted value.
        maximum: the largest accepted value.
        note: said after the range in the error message, e.g. ``" (a 64-bit seed)"``.
    """
    def parse(text: str) -> int:
        return _integer(text, minimum, maximum, note)
    parse.__name__ = f"integer in [{minimum}, {maximum}]"
    return parse


def int_list(minimum: int) -> Callable[[str], list[int]]:
    """An argparse type: a comma-separated, non-empty list of integers >= ``minimum``."""
    def parse(text: str) -> list[int]:
        items = [t.strip() for t in text.split(",") if t.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers >= {minimum}, got {text!r}")
        return [_integer(t, minimum) for t in items]
    parse.__name__ = f"list of integers >= {minimum}"
    return parse


def float_in(low: float, high: float, *, low_open: bool = False) -> Callable[[str], float]:
    """An argparse type: a finite number in ``[low, high]`` (``(low, high]`` with ``low_open``)."""
    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value > high or value < low or (low_open and value == low):
            raise argparse.ArgumentTypeError(f"expected a finite number in {'(' if low_open else '['}{low:g}, "
                                             f"{high:g}], got {text!r}")
        return value
    parse.__name__ = "number"
    return parse


def format_spec(text: str) -> str:
    """An argparse type: a number format lowp knows (a preset name or ``eXmY``), returned as
    given; the message lists the known names."""
    from lowp.formats import get_format

    try:
        get_format(text.strip())
    except (ValueError, TypeError) as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("format: ")) from None
    return text.strip()


def format_list(text: str) -> list[str]:
    """An argparse type: a comma-separated, non-empty list of :func:`format_spec` names."""
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"expected comma-separated format names, got {text!r}")
    return [format_spec(t) for t in items]


def _symlink_note(path: str) -> str:
    """Why a symbolic link is refused as an output file, naming where it points."""
    try:
        target = os.path.join(os.path.dirname(path), os.readlink(path))
    except OSError:
        return ""
    return f"; writing would replace the link instead of writing to {target!r} (give that path instead)"


def _output_file_problem(path: str) -> "str | None":
    """Why ``path`` cannot be an output file (it exists and is not a regular file), or ``None``."""
    from lowp.report import non_regular_kind

    kind = non_regular_kind(path)
    if kind is None:
        return None
    note = _symlink_note(path) if kind == "a symbolic link" else ""
    return f"expected a regular file (it is replaced), but {path!r} is {kind}{note}"


def output_file(text: str) -> str:
    """An argparse type: a file to write (replace) a report into. It may not exist yet; when it
    does it must be a regular file, not a folder, a symbolic link, a device (``/dev/null``), a
    named pipe or a socket, which the atomic write (:func:`lowp.report.write_atomic`) would
    replace by a regular file."""
    if not text:
        raise argparse.ArgumentTypeError("expected a file path, got ''")
    problem = _output_file_problem(text)
    if problem is not None:
        raise argparse.ArgumentTypeError(problem)
    return text


def output_dir(text: str) -> str:
    """An argparse type: a folder to write into. It may not exist yet; when it does it must be a
    folder, or a symbolic link to one (the files then go into the folder it points to)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a folder path, got ''")
    if os.path.lexists(text) and not os.path.isdir(text):
        from lowp.report import non_regular_kind

        kind = non_regular_kind(text) or "a regular file"
        if kind == "a symbolic link":
            kind = f"a symbolic link to {os.path.realpath(text)!r}, which is not a folder"
        raise argparse.ArgumentTypeError(f"expected a folder, but {text!r} is {kind}")
    return text


def usage_error(command: str, option: str, message: str) -> NoReturn:
    """Report a bad option found after parsing (say, a folder that cannot be created) the way
    argparse does: ``lowp <command>: error: argument <option>: <message>`` and exit status 2."""
    print(f"lowp {command}: error: argument {option}: {message}", file=sys.stderr)
    raise SystemExit(2)


def writable_folder(command: str, option: str, path: "str | os.PathLike[str]", files: Iterable[str] = ()) -> None:
    """Before any work: create the folder ``path`` if missing and write (then delete) a probe file
    in it, so an unwritable output fails now, with a usage error naming ``option``, and not after
    the whole run.

    Args:
        command: the subcommand, for the message (``"audit"``).
        option: the option that gave ``path`` (``"--out"``).
        path: the folder; a symbolic link to a folder is followed.
        files: names of the files the command will write into the folder: each that exists must
            be a regular file (the writes replace it), else a usage error names it.
    """
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        usage_error(command, option, f"cannot write into the folder {os.fspath(path)!r}: {exc.strerror or exc}")
    for name in files:
        problem = _output_file_problem(os.path.join(os.fspath(path), name))
        if problem is not None:
            usage_error(command, option, f"cannot write {name}: {problem}")


def writable_file(command: str, option: str, path: "str | os.PathLike[str]") -> None:
    """Before any work: ``path`` must be a regular file or not exist (not a folder, symbolic link,
    device, named pipe or socket: see :func:`output_file`) and its folder must be writable
    (:func:`writable_folder`; created if missing).

    Args:
        command: the subcommand, for the message (``"norm-check"``).
        option: the option that gave ``path`` (``"--csv"``).
        path: the file the command will write.
    """
    problem = _output_file_problem(os.fspath(path))
    if problem is not None:
        usage_error(command, option, problem)
    writable_folder(command, option, os.path.dirname(os.path.abspath(path)))


def available_memory() -> int:
    """Bytes of memory available to a new allocation: ``MemAvailable`` of /proc/meminfo on Linux
    (else the physical memory, ``SC_PAGE_SIZE * SC_PHYS_PAGES``), lowered to what a cgroup v2
    memory limit still allows (``memory.max - memory.current``) when the process runs in one."""
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    try:
        with open("/proc/meminfo") as fh:
            for line in fh:
                if line.startswith("MemAvailable:"):
                    have = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    try:
        with open("/sys/fs/cgroup/memory.max") as fh:
            limit = fh.read().strip()
        with open("/sys/fs/cgroup/memory.current") as fh:
            used = int(fh.read().strip())
        if limit != "max":
            have = min(have, max(int(limit) - used, 0))
    except (OSError, ValueError):
        pass
    return have


def _gib(nbytes: float) -> str:
    return f"{nbytes / 2**30:.3g} GiB"


def check_memory(command: str, option: str, need: float, what: str) -> None:
    """A usage error naming ``option`` when ``need`` bytes (the caller's estimate of ``what``)
    exceed the memory available now."""
    have = available_memory()
    if need > have:
        usage_error(command, option, f"{what} needs about {_gib(need)} of memory, {_gib(have)} is available")


def check_at_most(command: str, option: str, value: float, limit: float, why: str) -> None:
    """A usage error naming ``option`` when ``value`` exceeds a documented ``limit``."""
    if value > limit:
        usage_error(command, option, f"expected at most {_number(limit)} ({why}), got {_number(value)}")


def _number(value: float) -> str:
    return f"{int(value):,}" if float(value).is_integer() else f"{value:g}"
