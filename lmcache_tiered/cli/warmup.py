"""``lmcache-tiered warmup``: pre-load a known hot set before traffic starts.

Two modes, for the two moments an operator has:

``--keys FILE --from PATHS --to PATHS`` (server stopped)
    Copy the listed chunks from one tier's files to another's: for instance
    system prompts from a shared cold tier to a new node's local NVMe, so the
    first requests read them from the fast tier. FILE holds one key per line
    as ``inspect --keys`` prints them (blank lines and ``#`` comments
    skipped); keys listed first are made the most recent, so they are the
    last to be evicted if the set does not fit. Every record is CRC-checked
    before it is copied. The target is opened as a live tier opens it: its
    lock is taken (so this refuses to run beside a server using it) and its
    layout is kept: a target formatted with another stripe is refused, never
    wiped. Give ``--stripe-kb`` and ``--capacity-gb`` as the server sets
    ``tiered.stripe_kb`` and its per-worker share of
    ``tiered.<tier>.capacity_gb``, and run as the server's user.

``--trace FILE --hint-url URL`` (server running, before traffic is routed)
    POST each line of FILE, a hint body ``{"token_ids": [...], "deadline_s":
    ...}``, to the server's hint endpoint (``tiered.warmup.hint_port`` with
    ``tiered.warmup.policy: hinted``). The server promotes the cached prefix of
    each into LMCache's CPU tier, in the background and within its warm-up
    budget: only chunks already on its tiers, nothing is computed.

Exit status: 0 all pre-loaded (or all hints accepted), 1 some were not,
2 could not run.
"""

from __future__ import annotations

import argparse

SUMMARY = "pre-load a hot set: copy keys between tiers, or hint a live server"
RUN = "lmcache_tiered.ops.warmup:run"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    what = parser.add_mutually_exclusive_group(required=True)
    what.add_argument("--keys", help="file of keys to copy (offline)")
    what.add_argument("--trace", help="file of JSON hint bodies to send (live)")
    parser.add_argument("--from", dest="source", nargs="+", help="source tier paths")
    parser.add_argument("--to", dest="target", nargs="+", help="target tier paths")
    parser.add_argument("--owner", help="only this owner's files (e.g. kv-w0)")
    parser.add_argument("--stripe-kb", type=int, default=1024, help="target stripe")
    parser.add_argument(
        "--capacity-gb", type=float, default=100.0, help="target cap per owner"
    )
    parser.add_argument(
        "--io-engine", default="auto", choices=["auto", "uring", "threads"]
    )
    parser.add_argument("--hint-url", help="the server's hint endpoint (with --trace)")
