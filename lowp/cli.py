"""The ``lowp`` command.

Every module in :mod:`lowp.commands` is a subcommand (``norm_check.py`` -> ``lowp norm-check``)
with ``HELP``, ``add_arguments(parser)`` and ``run(args) -> int``; heavy imports stay inside
``run`` so that ``lowp --help`` is quick.
"""
from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

import lowp.commands


def command_modules() -> dict[str, str]:
    """Subcommand name -> module name, in alphabetical order."""
    found = pkgutil.iter_modules(lowp.commands.__path__)
    return {m.name.replace("_", "-"): f"lowp.commands.{m.name}" for m in sorted(found, key=lambda m: m.name)}


def build_parser() -> argparse.ArgumentParser:
    """The ``lowp`` argument parser, one subcommand per module of :mod:`lowp.commands`."""
    from lowp import __version__

    parser = argparse.ArgumentParser(prog="lowp", description="Low-precision training without losing accuracy.")
    parser.add_argument("--version", action="version", version=f"lowp {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, module_name in command_modules().items():
        module = importlib.import_module(module_name)
        cmd = sub.add_parser(name, help=module.HELP, description=module.HELP)
        module.add_arguments(cmd)
        cmd.set_defaults(_run=module.run)
    return parser


def main(argv: list[str] | None = None) -> int:
    """Run the ``lowp`` command line on ``argv`` (default: ``sys.argv[1:]``); returns the exit
    status (130 after Ctrl-C; usage errors exit with 2 from argparse; 1 when an output path turned
    into something other than a regular file between parsing and writing, which is left as it is:
    :class:`lowp.report.UnsafeOutputError`).

    Args:
        argv: the arguments after ``lowp``.
    """
    from lowp.report import UnsafeOutputError

    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return 0
    try:
        return int(args._run(args) or 0)
    except KeyboardInterrupt:
        print(f"\nlowp {args.command}: interrupted", file=sys.stderr)
        return 130
    except UnsafeOutputError as exc:
        print(f"lowp {args.command}: error: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
