"""The ``fastweight`` command: one subcommand per module.

Each module of :data:`SUBCOMMANDS` exposes ``register(subparsers)``, which adds its parser and
sets ``func`` (``func(args) -> exit status``). Every one is imported: an import error is raised,
never hidden.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMANDS = ("fastweight.verify", "fastweight.train", "fastweight.evaluate", "fastweight.plot")


def build_parser(modules=SUBCOMMANDS) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="fastweight", description="fastweight: the linear-attention family "
                                     "as fast weights (one DPLR recurrence).")
    subparsers = parser.add_subparsers(dest="command", metavar="command")
    for name in modules:
        importlib.import_module(name).register(subparsers)
    return parser


def run_subcommand(register, command: str, argv=None) -> int:
    """``python -m fastweight.<module> ARGS`` as ``fastweight <command> ARGS``, without loading
    the other subcommands (``register``: the module's own)."""
    parser = argparse.ArgumentParser(prog="fastweight")
    register(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args([command] + list(sys.argv[1:] if argv is None else argv))
    return int(args.func(args) or 0)


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
