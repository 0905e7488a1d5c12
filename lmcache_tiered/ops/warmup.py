"""What ``lmcache-tiered warmup`` runs: listed chunks copied from one tier's
files to another's (server stopped), or hint bodies sent to a live server.
Its options and help text are in :mod:`lmcache_tiered.cli.warmup`.

May touch: the target tier's files (under its lock); the server it hints.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence

from lmcache_tiered.config import GIB, ConfigError, TieredConfig
from lmcache_tiered.keys import StoreKey, key_digest, key_from_string
from lmcache_tiered.ops.records import Slot, TierFiles, ToolError, newest, owners
from lmcache_tiered.storage.files import unprintable
from lmcache_tiered.storage.layout import (
    CorruptRecord,
    Geometry,
    TierNames,
    align_up,
    read_superblock,
)
from lmcache_tiered.storage.payload import Payload
from lmcache_tiered.storage.tier import Tier
from lmcache_tiered.warmup.hints import send_hint

#: records copied per write batch
_BATCH = 32


def run(args: argparse.Namespace) -> int:
    try:
        if args.trace:
            if not args.hint_url:
                raise ToolError("--trace needs --hint-url (the server's /hint)")
            return send_trace(args.trace, args.hint_url)
        if not args.source or not args.target:
            raise ToolError("--keys needs --from and --to (tier paths)")
        return copy_keys(args)
    except ToolError as exc:
        print(f"lmcache-tiered warmup: {exc}", file=sys.stderr)
        return 2


# ------------------------------------------------------------------ hints


def send_trace(path: str, url: str) -> int:
    """POST every hint of ``path`` to ``url``; 1 if any was refused."""
    sent = refused = 0
    for number, line in _lines(path):
        try:
            hint = json.loads(line)
            token_ids = hint["token_ids"]
            deadline_s = hint.get("deadline_s")
        except (ValueError, TypeError, KeyError, AttributeError):
            raise ToolError(
                f'{path}:{number}: expected {{"token_ids": [...]}}, got {line[:60]!r}'
            ) from None
        if send_hint(url, token_ids, deadline_s, timeout=5.0):
            sent += 1
        else:
            refused += 1
    print(f"{sent} hint(s) accepted by {url}, {refused} refused or undelivered")
    return 1 if refused else 0


# ------------------------------------------------------------------- keys


def copy_keys(args: argparse.Namespace) -> int:
    """Copy the listed keys, owner by owner; 1 if any is not in the target."""
    wanted = {key_digest(k): k for k in _read_keys(args.keys)}
    loaded: set[bytes] = set()
    names = owners(args.source[0], args.owner)
    for owner in names:
        with TierFiles(args.source, owner) as source:
            if source.geometry is None:
                raise ToolError(f"{source.header_name}: superblock unreadable")
            live, _ = newest(list(source.scan()))
            mine = [k for d, k in wanted.items() if d in live]
            if mine:
                loaded |= _copy_owner(args, source, live, mine)
    missing = len(wanted) - len(loaded)
    print(f"{len(loaded)} of {len(wanted)} key(s) in the target, {missing} not")
    return 1 if missing else 0


def _copy_owner(
    args: argparse.Namespace,
    source: TierFiles,
    live: dict[bytes, Slot],
    keys: Sequence[StoreKey],
) -> set[bytes]:
    """Copy ``keys`` (file order) into the target's files of the same owner;
    the digests the target holds afterwards."""
    assert source.geometry is not None
    target = _open_target(args, source.owner, source.geometry)
    copied = present = bad = dropped = 0
    try:
        order = list(reversed(keys))
        for start in range(0, len(order), _BATCH):
            payloads = []
            for key in reversed(order[start : start + _BATCH]):
                if target.header(key) is not None:
                    present += 1
                    continue
                slot = live[key_digest(key)]
                header = slot.header
                assert header is not None
                try:
                    view = source.read_payload(slot.index, header)
                except CorruptRecord as exc:
                    print(f"{source.header_name}: slot {slot.index}: {exc}")
                    bad += 1
                    continue
                payloads.append(Payload.read_back(header, view))
            stored = target.write_payloads(payloads)
            copied += sum(stored)
            dropped += stored.count(False)
        held = {key_digest(k) for k in keys if target.header(k) is not None}
        print(
            f"{source.owner}: {copied} copied, {present} already there, {bad} bad "
            f"in the source, {dropped} dropped, {target.stats.evictions} evicted"
        )
        return held
    finally:
        target.close()


def _open_target(args: argparse.Namespace, owner: str, source: Geometry) -> Tier:
    """The target tier as a live one would open it, never reformatted."""
    recorded = _recorded_geometry(TierNames((args.target[0],), owner).header)
    max_payload = (recorded or source).max_payload
    extra = {
        "tiered.warm.paths": args.target,
        "tiered.stripe_kb": args.stripe_kb,
        "tiered.warm.capacity_gb": args.capacity_gb,
        "tiered.io_engine": args.io_engine,
        "tiered.fsync": True,
    }
    try:
        config = TieredConfig.from_extra_config(extra)
        planned = Geometry.plan(
            len(args.target), config.stripe_bytes, align_up(max_payload)
        )
        if recorded is not None and planned != recorded:
            raise ToolError(
                f"{args.target[0]}: {owner} was formatted with {recorded}, this "
                f"would be {planned}: pass the server's --stripe-kb"
            )
        return Tier(
            config.tier_options(config.warm),
            owner=owner,
            max_payload=max_payload,
            capacity_bytes=int(args.capacity_gb * GIB),
        )
    except ConfigError as exc:
        raise ToolError(str(exc)) from None


def _recorded_geometry(header_name: str) -> Geometry | None:
    try:
        return read_superblock(header_name)
    except OSError as exc:  # a link, a FIFO...: the target refuses it too
        raise ToolError(
            f"{header_name}: {exc.strerror}" if exc.strerror else str(exc)
        ) from None


def _read_keys(path: str) -> list[StoreKey]:
    keys = []
    for number, line in _lines(path):
        try:
            keys.append(key_from_string(unprintable(line)))
        except (ValueError, KeyError, IndexError, TypeError):
            raise ToolError(f"{path}:{number}: not a key: {line[:80]!r}") from None
    return keys


def _lines(path: str) -> list[tuple[int, str]]:
    """(line number, text) of the non-blank, non-comment lines of ``path``."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read().splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise ToolError(f"{path}: {exc}") from None
    stripped = ((n, line.strip()) for n, line in enumerate(text, 1))
    return [(n, line) for n, line in stripped if line and not line.startswith("#")]
