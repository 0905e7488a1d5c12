"""The ``lmcache-tiered`` command: one subcommand per job.

Each subcommand has a module here that holds only its command line: its help
text (the docstring), ``SUMMARY`` (one line), ``add_arguments(parser)`` and
``RUN``, the ``module:function`` that does the job, imported only when the
subcommand runs (``args.func`` does). These modules import neither torch nor LMCache, so
``--help`` answers at once (a test holds them to it).
"""

from __future__ import annotations

import argparse
import functools
import importlib
import logging
import os
import sys
from collections.abc import Sequence
from types import ModuleType

#: subcommands, in the order ``--help`` lists them
COMMANDS = (
    "bench",
    "serve-bench",
    "diskbench",
    "inspect",
    "fsck",
    "warmup",
    "demo",
    "soak",
)


class HelpFormatter(argparse.RawDescriptionHelpFormatter):
    """Help text as written, each option's default at the end of its help
    unless the help says it already or there is none (None, a flag off)."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        unsaid = action.default is None or action.default is False
        if "default" in text or unsaid or action.default == argparse.SUPPRESS:
            return text
        return f"{text} (default: %(default)s)".lstrip()


def command_module(name: str) -> ModuleType:
    """The command-line module of subcommand ``name``."""
    return importlib.import_module(f"lmcache_tiered.cli.{name.replace('-', '_')}")


def run_command(target: str, args: argparse.Namespace) -> int:
    """Import ``target`` (``module:function``) and run it on ``args``."""
    module_name, _, function = target.partition(":")
    return int(getattr(importlib.import_module(module_name), function)(args) or 0)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmcache-tiered",
        description="Striped NVMe tiers and warm-up for LMCache: benchmarks and tools.",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log at INFO (default WARNING)"
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMANDS:
        module = command_module(name)
        sub = subparsers.add_parser(
            name,
            help=module.SUMMARY,
            description=module.__doc__,
            formatter_class=HelpFormatter,
        )
        module.add_arguments(sub)
        sub.set_defaults(func=functools.partial(run_command, module.RUN))
    return parser


def parse_args(argv: Sequence[str]) -> argparse.Namespace:
    """``argv`` parsed as the command line would be; ``command_line``: the
    ``argv`` itself, for a command that runs itself again elsewhere (in a
    network namespace of its own: bench.common.stores)."""
    args = build_parser().parse_args(argv)
    args.command_line = list(argv)
    return args


def verbose(argv: Sequence[str]) -> bool:
    """Whether ``-v``/``--verbose`` is among the options before the subcommand."""
    for arg in argv:
        if arg in ("-v", "--verbose"):
            return True
        if not arg.startswith("-"):
            return False
    return False


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    level = logging.INFO if verbose(argv) else logging.WARNING
    # LMCache's loggers read this when they are made, at import, which can
    # come while the options are parsed (an option's type may import it), and
    # print to stderr on their own: at the level chosen here unless the user
    # set it
    os.environ.setdefault("LMCACHE_LOG_LEVEL", logging.getLevelName(level))
    args = parse_args(argv)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    return int(args.func(args))
