"""``lmcache-tiered inspect PATHS``: what a tier holds, from its files alone.

Per owner (one per LMCache worker): the layout, chunks and payload bytes,
capacity in slots and disk bytes, oldest and newest record, and the groups
(model and request tags, or cache salt) holding the most bytes. Only headers
are read, so it is quick on a big tier and safe beside a live server (files
opened read-only, no lock taken). ``--keys`` lists every stored key instead,
newest first: the input ``warmup --keys`` takes. Text from the files (model
names, owners) is printed with unprintable characters escaped (``\\x1b``),
as ``warmup --keys`` reads it back.

Exit status: 0 all read, 2 some owner could not be read (reported; the others
are still shown) or bad arguments.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections import Counter
from typing import Any

from lmcache_tiered.files import printable
from lmcache_tiered.keys import key_text
from lmcache_tiered.ops.records import (
    TierFiles,
    ToolError,
    add_tier_arguments,
    group_of,
    lock_holder,
    newest,
    owners,
)

GIB, MIB = 1 << 30, 1 << 20


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="summarise what a tier's files hold (read-only)",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_tier_arguments(parser)
    parser.add_argument(
        "--top", type=int, default=10, help="groups to list (default 10)"
    )
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="machine-readable output")
    output.add_argument(
        "--keys", action="store_true", help="print every stored key, newest first"
    )
    parser.set_defaults(func=run)


def summarise(files: TierFiles, top: int) -> dict[str, Any]:
    """Everything ``inspect`` reports about one owner's files."""
    slots = list(files.scan())
    live, stale = newest(slots)
    headers = [s.header for s in live.values() if s.header is not None]
    sizes: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for header in headers:
        sizes[group_of(header.key)] += header.payload_size
        counts[group_of(header.key)] += 1
    created = [h.created_ns for h in headers]
    geometry = files.geometry
    return {
        "owner": files.owner,
        "paths": files.paths,
        "in_use_by_pid": lock_holder(files.lock_name),
        "layout": None
        if geometry is None
        else {
            "devices": geometry.devices,
            "stripe_bytes": geometry.stripe,
            "slot_payload_bytes": geometry.max_payload,
        },
        "chunks": len(headers),
        "payload_bytes": sum(h.payload_size for h in headers),
        "bad_headers": sum(s.header is None for s in slots),
        "stale_copies": len(stale),
        "slots": files.slots,
        "free_slots": files.slots - len(headers),
        "disk_bytes": files.disk_bytes,
        "oldest": _iso(min(created)) if created else None,
        "newest": _iso(max(created)) if created else None,
        "top_groups": [
            {"group": g, "chunks": counts[g], "bytes": b}
            for g, b in sizes.most_common(top)
        ],
    }


def _iso(ns: int) -> str:
    when = datetime.datetime.fromtimestamp(ns / 1e9, datetime.timezone.utc)
    return when.isoformat(timespec="seconds")


def _text(report: dict[str, Any]) -> str:
    holder = report["in_use_by_pid"]
    lines = [
        f"{printable(report['owner'])} under "
        f"{printable(', '.join(report['paths']))}"
        + (f" (in use by pid {holder})" if holder else " (not in use)")
    ]
    layout = report["layout"]
    if layout is None:
        lines.append(
            "  superblock unreadable: a tier opening these files starts degraded "
            "and leaves them as they are"
        )
        return "\n".join(lines)
    lines += [
        f"  layout: {layout['devices']} device(s), stripe "
        f"{layout['stripe_bytes'] // 1024} KiB, slots of "
        f"{layout['slot_payload_bytes'] / MIB:.2f} MiB",
        f"  chunks: {report['chunks']} ({report['payload_bytes'] / MIB:.1f} MiB), "
        f"bad headers: {report['bad_headers']}, "
        f"stale copies: {report['stale_copies']}",
        f"  capacity: {report['slots']} slots ({report['free_slots']} free), "
        f"{report['disk_bytes'] / GIB:.3f} GiB on disk",
        f"  oldest: {report['oldest']}  newest: {report['newest']}",
    ]
    if report["top_groups"]:
        lines.append("  top groups by size:")
        lines += [
            f"    {g['bytes'] / MIB:10.1f} MiB {g['chunks']:8d} chunks  "
            f"{printable(g['group'])}"
            for g in report["top_groups"]
        ]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    try:
        names = owners(args.paths[0], args.owner)
    except ToolError as exc:
        print(f"lmcache-tiered inspect: {printable(str(exc))}", file=sys.stderr)
        return 2
    reports, unread = [], []
    for owner in names:
        try:
            with TierFiles(args.paths, owner) as files:
                if args.keys:
                    live, _ = newest(list(files.scan()))
                    by_age = sorted(
                        (s.header for s in live.values() if s.header is not None),
                        key=lambda h: h.sequence,
                        reverse=True,
                    )
                    sys.stdout.writelines(
                        printable(key_text(h.key)) + "\n" for h in by_age
                    )
                else:
                    reports.append(summarise(files, args.top))
        except (ToolError, OSError) as exc:
            unread.append({"owner": owner, "error": str(exc)})
            why = printable(str(exc))
            print(f"lmcache-tiered inspect: {printable(owner)}: {why}", file=sys.stderr)
    if args.json:
        print(json.dumps({"owners": reports, "unreadable": unread}, indent=2))
    elif reports:
        print("\n".join(_text(r) for r in reports))
    return 2 if unread else 0
