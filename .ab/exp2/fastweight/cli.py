"""The ``fastweight`` command: one subcommand per module.

Each module of :data:`SUBCOMMANDS` exposes ``register(subparsers)``, which adds its parser and
sets ``func`` (``func(args) -> exit status``). Every one is imported: an import error is raised,
never hidden. A bad argument value (the ValueError or TypeError that fastweight raises for it, a
file not found) is printed as one ``fastweight <command>: error: ...`` line, exit status 2, as
argparse does for its own errors; ``FASTWEIGHT_TRACEBACK=1`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import importlib
import os
import sys

SUBCOMMANDS = ("fastweight.verify", "fastweight.train", "fastweight.evaluate", "fastweight.plot",
               "fastweight.models.convert", "fastweight.niah_eval")


def positive_int(text: str) -> int:
    """An argparse ``type``: a positive int, else argparse's error naming the argument."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive int, got {value}")
    return value


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
    return _run(args)


def _run(args) -> int:
    try:
        return int(args.func(args) or 0)
    except (ValueError, TypeError, FileNotFoundError) as e:
        if os.environ.get("FASTWEIGHT_TRACEBACK") == "1":
            raise
        print(f"fastweight {args.command}: error: {e}", file=sys.stderr)
        return 2


def main(argv=None) -> int:
    parser = build_parser()
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    return _run(args)


if __name__ == "__main__":
    sys.exit(main())
