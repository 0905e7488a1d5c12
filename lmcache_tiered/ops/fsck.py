"""What ``lmcache-tiered fsck`` runs: every record of a tier checked, the bad
ones dropped with ``--repair``. Its options and help text are in
:mod:`lmcache_tiered.cli.fsck`.

May touch: with ``--repair``, the tier's header file (bad headers zeroed, a
torn tail cut); otherwise nothing.
"""

from __future__ import annotations

import argparse
import os
import sys

from lmcache_tiered.keys import key_text
from lmcache_tiered.ops.records import (
    Progress,
    TierFiles,
    ToolError,
    lock_holder,
    newest,
    owners,
)
from lmcache_tiered.storage.files import printable
from lmcache_tiered.storage.layout import HEADER_SIZE, CorruptRecord


def check(files: TierFiles, show_progress: bool) -> list[tuple[int | None, str]]:
    """(slot, problem) for everything wrong; slot None for the whole file.
    The payload reads, the long part, move a progress bar on stderr."""
    if files.geometry is None:
        return [
            (
                None,
                "superblock unreadable: a tier opening these files starts "
                "degraded and leaves them as they are",
            )
        ]
    problems: list[tuple[int | None, str]] = []
    if files.cut_tail:
        problems.append((None, "header file ends inside a header (truncated)"))
    slots = list(files.scan())
    problems += [(s.index, s.problem or "") for s in slots if s.header is None]
    live, _ = newest(slots)
    progress = Progress(len(live), f"fsck {files.owner}", force=show_progress)
    for done, slot in enumerate(live.values(), 1):
        assert slot.header is not None
        try:
            files.check_payload(slot.index, slot.header)
        except CorruptRecord as exc:
            problems.append((slot.index, f"{exc} ({key_text(slot.header.key)})"))
        progress.update(done)
    progress.finish()
    return sorted(problems, key=lambda p: -1 if p[0] is None else p[0])


def repair(files: TierFiles, problems: list[tuple[int | None, str]]) -> int:
    """Drop the bad records, cut a torn header block, make it durable; how
    many problems that fixed (an unreadable superblock is left to the tier,
    which starts such files empty)."""
    bad = [slot for slot, _ in problems if slot is not None]
    for slot in bad:
        files.drop(slot)
    if files.cut_tail:
        os.ftruncate(files.header_fd, files.header_bytes // HEADER_SIZE * HEADER_SIZE)
    os.fsync(files.header_fd)
    return len(bad) + files.cut_tail


def run(args: argparse.Namespace) -> int:
    found = unchecked = 0
    try:
        names = owners(args.paths[0], args.owner)
    except ToolError as exc:
        print(f"lmcache-tiered fsck: {printable(str(exc))}", file=sys.stderr)
        return 2
    for owner in names:
        try:
            found += check_owner(args, owner)
        except (ToolError, OSError) as exc:
            unchecked += 1
            why = printable(str(exc))
            print(f"lmcache-tiered fsck: {printable(owner)}: {why}", file=sys.stderr)
    return 2 if unchecked else 1 if found else 0


def check_owner(args: argparse.Namespace, owner: str) -> int:
    """Check (and repair, if asked) one owner's files; how many problems."""
    with TierFiles(args.paths, owner, writable=args.repair) as files:
        if args.repair:
            files.lock()
        elif holder := lock_holder(files.lock_name):
            print(
                f"{printable(owner)}: in use by pid {holder}: a record rewritten "
                "during the check may show as a problem",
                file=sys.stderr,
            )
        problems = check(files, args.progress)
        for slot, problem in problems:
            where = "file" if slot is None else f"slot {slot}"
            print(printable(f"{files.header_name}: {where}: {problem}"))
        fixed = repair(files, problems) if problems and args.repair else 0
        print(
            f"{printable(owner)}: {len(problems)} problem(s)"
            + (f", {fixed} repaired" if args.repair else "")
        )
        return len(problems)
