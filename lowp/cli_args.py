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

__all__ = ["int_at_least", "int_list", "output_dir", "usage_error"]


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
