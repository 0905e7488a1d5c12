"""``lmcache-tiered inspect PATHS | --config FILE``: what the tiers hold.

``PATHS`` are one tier's directories. ``--config`` takes the configuration
a server runs with instead: LMCache's YAML (its ``extra_config``'s
``tiered.*`` settings) or the ``--l2-adapter`` JSON of LMCache's
multi-process server (``adapter_params``). Every tier it names is shown:
warm and cold files as below, and a cold tier on a store
(``tiered.cold.adapter`` / ``cold.adapter``) as :mod:`lmcache_tiered.ops.store`
reports it: the adapter, whether the store answers, its own status, and its
chunks where the adapter can list them.

Per owner (one per LMCache worker): the layout, chunks and payload bytes,
capacity in slots and disk bytes, oldest and newest record, and the groups
(model and request tags, or cache salt) holding the most bytes. Only headers
are read, so it is quick on a big tier and safe beside a live server (files
opened read-only, no lock taken). ``--keys`` lists every stored key instead,
newest first: the input ``warmup --keys`` takes. Text from the files (model
names, owners) is printed with unprintable characters escaped (``\\x1b``),
as ``warmup --keys`` reads it back.

Exit status: 0 all read, 2 some owner could not be read or the store did not
answer (reported; the others are still shown), or bad arguments or config.
"""

from __future__ import annotations

import argparse

from lmcache_tiered.cli.shared import add_tier_arguments

SUMMARY = "summarise what a tier's files hold (read-only)"
RUN = "lmcache_tiered.ops.inspect:run"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_tier_arguments(parser, nargs="*")
    parser.add_argument(
        "--config",
        help="every tier a server's configuration names, files and store: LMCache's "
        "YAML, or the multi-process server's --l2-adapter JSON",
    )
    parser.add_argument(
        "--top", type=int, default=10, help="groups to list (default 10)"
    )
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="machine-readable output")
    output.add_argument(
        "--keys", action="store_true", help="print every stored key, newest first"
    )
