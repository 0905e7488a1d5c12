"""What ``lmcache-tiered inspect`` runs: a summary of what a tier's files (or
every tier a configuration names) hold, headers only. Its options and help
text are in :mod:`lmcache_tiered.cli.inspect`.

May touch: nothing (files opened read-only, no lock taken).
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
from collections import Counter
from typing import Any

from lmcache_tiered.config import ConfigError, TieredConfig
from lmcache_tiered.keys import key_text
from lmcache_tiered.ops.records import (
    TierFiles,
    ToolError,
    group_of,
    lock_holder,
    newest,
    owners,
)
from lmcache_tiered.storage.files import printable

GIB, MIB = 1 << 30, 1 << 20


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
        f"  oldest: {report['oldest']}  newest: {report['newest']}"
        if report["chunks"]
        else "  no records yet",
    ]
    if report["top_groups"]:
        lines.append("  top groups by size:")
        lines += [
            f"    {g['bytes'] / MIB:10.1f} MiB {g['chunks']:8d} chunks  "
            f"{printable(g['group'])}"
            for g in report["top_groups"]
        ]
    return "\n".join(lines)


def load_config(path: str) -> TieredConfig:
    """The tiers' settings in ``path``: LMCache's YAML (``extra_config``) or
    the ``--l2-adapter`` JSON (``adapter_params``); ConfigError if neither."""
    import yaml  # LMCache's own dependency: its configuration is YAML

    try:
        with open(path, encoding="utf-8") as f:
            doc = yaml.safe_load(f)
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigError(f"--config {path}: {exc}") from None
    if isinstance(doc, dict) and isinstance(doc.get("extra_config"), dict):
        return TieredConfig.from_extra_config(doc["extra_config"])
    if isinstance(doc, dict) and isinstance(doc.get("adapter_params"), dict):
        from lmcache_tiered.integration.l2_config import TieredL2AdapterConfig

        return TieredL2AdapterConfig.from_dict(doc["adapter_params"]).settings
    raise ConfigError(
        f"--config {path}: neither LMCache's YAML (with extra_config) nor an "
        "--l2-adapter JSON (with adapter_params)"
    )


def _tiers(args: argparse.Namespace) -> tuple[list[list[str]], TieredConfig | None]:
    """The directories of each tier of files to read, and the configuration
    they came from (None: PATHS given)."""
    if args.config is None:
        if not args.paths:
            raise ToolError("give a tier's PATHS or --config FILE")
        return [args.paths], None
    if args.paths:
        raise ToolError("give a tier's PATHS or --config FILE, not both")
    config = load_config(args.config)
    tiers = [config.warm, config.cold]
    return [list(t.paths) for t in tiers if t is not None], config


def _read_files(
    args: argparse.Namespace, paths: list[str], reports: list[Any], unread: list[Any]
) -> None:
    """Report (or list the keys of) each owner's files under ``paths``; with
    ``--config``, a tier without files is reported and the others shown."""
    try:
        names = owners(paths[0], args.owner)
    except ToolError as exc:
        if args.config is None:
            raise
        unread.append({"paths": paths, "error": str(exc)})
        print(f"lmcache-tiered inspect: {printable(str(exc))}", file=sys.stderr)
        return
    for owner in names:
        try:
            with TierFiles(paths, owner) as files:
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


def run(args: argparse.Namespace) -> int:
    reports: list[Any] = []
    unread: list[Any] = []
    try:
        tiers, config = _tiers(args)
        for paths in tiers:
            _read_files(args, paths, reports, unread)
    except (ToolError, ConfigError) as exc:
        print(f"lmcache-tiered inspect: {printable(str(exc))}", file=sys.stderr)
        return 2
    store = None
    if config is not None and config.cold_adapter is not None:
        from lmcache_tiered.ops.store import survey

        store = survey(config.cold_adapter, host_id=config.host_id)
        if args.keys:
            print(
                "lmcache-tiered inspect: the store's keys are not listed: its "
                "objects are named by digests",
                file=sys.stderr,
            )
    if args.json:
        out: dict[str, Any] = {"owners": reports, "unreadable": unread}
        if config is not None:
            out["store"] = store
        print(json.dumps(out, indent=2))
    elif not args.keys:
        from lmcache_tiered.ops.store import text

        texts = [_text(r) for r in reports] + ([text(store)] if store else [])
        if texts:
            print("\n".join(texts))
    return 2 if unread or (store is not None and not store["reachable"]) else 0
