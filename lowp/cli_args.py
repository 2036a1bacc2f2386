"""Argument types for the ``lowp`` subcommands: bad values become argparse errors.

An argparse ``type=`` callable that raises :class:`argparse.ArgumentTypeError` makes argparse
print ``lowp <command>: error: argument --name: <message>`` and exit with status 2, instead
of a traceback from deep inside ``run``. (This module lives outside :mod:`lowp.commands`,
where every module is a subcommand.)
"""
from __future__ import annotations

import argparse
import math
import os
import sys
from typing import Callable, NoReturn

__all__ = ["int_at_least", "int_list", "float_in", "format_spec", "format_list", "output_dir", "usage_error",
           "writable_folder", "writable_file", "available_memory", "check_memory", "check_at_most"]


def _integer(text: str, minimum: int) -> int:
    """``text`` as an int >= ``minimum``; ``"1e5"`` is accepted as 100000, ``"2.5"`` is not."""
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value != int(value) or value < minimum:
        raise argparse.ArgumentTypeError(f"expected an integer >= {minimum}, got {text!r}")
    return int(value)


def int_at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: one integer >= ``minimum``."""
    def parse(text: str) -> int:
        return _integer(text, minimum)
    parse.__name__ = f"integer >= {minimum}"     # argparse names the type in some messages
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


def output_dir(text: str) -> str:
    """An argparse type: a folder to write into (it may not exist yet, but must not be a file)."""
    if not text:
        raise argparse.ArgumentTypeError("expected a folder path, got ''")
    if os.path.exists(text) and not os.path.isdir(text):
        raise argparse.ArgumentTypeError(f"expected a folder, but {text!r} is a file")
    return text


def usage_error(command: str, option: str, message: str) -> NoReturn:
    """Report a bad option found after parsing (say, a folder that cannot be created) the way
    argparse does: ``lowp <command>: error: argument <option>: <message>`` and exit status 2."""
    print(f"lowp {command}: error: argument {option}: {message}", file=sys.stderr)
    raise SystemExit(2)


def writable_folder(command: str, option: str, path: "str | os.PathLike[str]") -> None:
    """Before any work: create the folder ``path`` if missing and write (then delete) a probe file
    in it, so an unwritable output fails now, with a usage error naming ``option``, and not after
    the whole run."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        usage_error(command, option, f"cannot write into the folder {os.fspath(path)!r}: {exc.strerror or exc}")


def writable_file(command: str, option: str, path: "str | os.PathLike[str]") -> None:
    """Before any work: ``path`` must not be a folder and its folder must be writable
    (:func:`writable_folder`; created if missing)."""
    if os.path.isdir(path):
        usage_error(command, option, f"expected a file path, but {os.fspath(path)!r} is a folder")
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
