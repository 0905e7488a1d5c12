"""``lmcache-tiered demo DIR``: a real tier to try the operator tools on,
without vLLM or a GPU.

It builds a real LMCache engine (on CPU) with the tiered plugin, its warm
tier striped over ``--drives`` directories under DIR, stores ``--prompts``
prompts of random KV through LMCache's own store path (as vLLM's connector
calls it), reads them all back from disk to check them, and closes the
engine: the files stay. It then prints the commands to try on them
(``inspect``, ``fsck``, ``warmup``). Run it again on the same DIR to add
more prompts: the tier keeps what it held.
"""

from __future__ import annotations

import argparse

SUMMARY = "store a few prompts in a real tier under DIR, to try inspect/fsck/warmup on"
RUN = "lmcache_tiered.ops.demo:run"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", help="where the tier's drive directories go")
    parser.add_argument(
        "--drives", type=int, default=2, help="drive directories to stripe over"
    )
    parser.add_argument("--prompts", type=int, default=8, help="prompts to store")
    parser.add_argument(
        "--tokens", type=int, default=2048, help="tokens per prompt (256 per chunk)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="first prompt's seed (one per prompt)"
    )
