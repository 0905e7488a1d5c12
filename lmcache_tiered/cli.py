"""The ``lmcache-tiered`` command: one subcommand per job.

Each subcommand lives in its own module, which exposes ``add_parser(subparsers)``
(registering its arguments and setting ``func``) and is listed in
:data:`COMMANDS`; this module only dispatches.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

#: subcommand name -> module that implements it
COMMANDS: dict[str, str] = {
    "bench": "lmcache_tiered.bench.command",
    "serve-bench": "lmcache_tiered.bench.serve_bench",
    "diskbench": "lmcache_tiered.bench.diskbench",
    "inspect": "lmcache_tiered.ops.inspect",
    "fsck": "lmcache_tiered.ops.fsck",
    "warmup": "lmcache_tiered.ops.warmup",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="lmcache-tiered",
        description="Striped NVMe tiers and warm-up for LMCache: benchmarks and tools.",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log at INFO (default WARNING)"
    )
    subparsers = parser.add_subparsers(dest="command", required=True)
    for module in COMMANDS.values():
        importlib.import_module(module).add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format="%(levelname)s %(name)s: %(message)s",
    )
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
