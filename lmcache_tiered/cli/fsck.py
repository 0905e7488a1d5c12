"""``lmcache-tiered fsck PATHS [--repair]``: check every record of a tier.

Each header is decoded as a live tier does, and each record's payload read
from the slabs and checked against its CRC32C. Problems are listed one per
line. ``--repair`` zeroes the header of every bad record (a live tier then
sees a free slot; a stale older copy of the same key, if good, becomes the
one served) and cuts a truncated header file to whole blocks. It takes the
tier's lock and refuses while a live process holds it; without ``--repair``
the files are only read.

Exit status: 0 clean, 1 problems found (repaired or not), 2 could not check
(bad arguments, missing or unreadable files, tier in use). An owner that
cannot be checked is reported and the others are still checked.
"""

from __future__ import annotations

import argparse

from lmcache_tiered.cli.shared import add_tier_arguments

SUMMARY = "verify every record's checksums; --repair drops bad ones"
RUN = "lmcache_tiered.ops.fsck:run"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_tier_arguments(parser, nargs="+")
    parser.add_argument(
        "--repair", action="store_true", help="drop bad records (needs the lock)"
    )
    parser.add_argument(
        "--progress", action="store_true", help="progress bar even when not a tty"
    )
