"""What ``lmcache-tiered demo`` runs: prompts stored through a real LMCache
engine into a warm tier under a directory, read back and checked, and the
tools to try on the files printed. Its options and help text are in
:mod:`lmcache_tiered.cli.demo`.

May touch: the drive directories under the directory it is given (created).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from lmcache_tiered import testing
from lmcache_tiered.config import plugin_extra_config

#: The demo engine's model name: the group ``inspect`` lists its chunks under.
MODEL_NAME = "demo-model"


def run(args: argparse.Namespace) -> int:
    if min(args.drives, args.prompts, args.tokens) < 1:
        print(
            "demo: --drives, --prompts and --tokens must be at least 1", file=sys.stderr
        )
        return 2
    drives = [os.path.join(args.dir, f"drive{i}") for i in range(args.drives)]
    for drive in drives:
        os.makedirs(drive, exist_ok=True)
    config = testing.build_config(
        max_local_cpu_size_gb=0.25,
        storage_plugins=["tiered"],
        extra_config=plugin_extra_config(
            {"tiered.warm.paths": drives, "tiered.warm.capacity_gb": 1.0}
        ),
    )
    served = total = 0
    with testing.engine_session(config, model_name=MODEL_NAME) as (engine, connector):
        prompts = []
        for seed in range(args.seed, args.seed + args.prompts):
            tokens = testing.make_tokens(args.tokens, seed=seed)
            kv = testing.make_kv(connector, args.tokens, seed=seed)
            testing.store_tokens(engine, tokens, kv)
            prompts.append((tokens, kv))
        for tokens, _ in prompts:
            testing.wait_for_puts(engine, tokens)
        testing.clear_cpu_tier(engine)  # every read below comes from the drives
        for tokens, kv in prompts:
            out, hit = testing.retrieve_tokens(engine, tokens, connector=connector)
            stored = len(testing.chunk_keys(engine, tokens)) * config.chunk_size
            total += stored
            if int(hit.sum()) >= stored and torch.equal(
                out[:, :, :stored], kv[:, :, :stored]
            ):
                served += stored
    paths = " ".join(drives)
    print(
        f"demo: stored {args.prompts} prompts of {args.tokens} tokens in a warm tier "
        f"striped over {paths}; {served} of {total} tokens read back from disk exact"
    )
    print(
        "try:\n"
        f"  lmcache-tiered inspect {paths}\n"
        f"  lmcache-tiered fsck {paths}\n"
        f"  lmcache-tiered inspect {paths} --keys > keys.txt\n"
        f"  lmcache-tiered warmup --keys keys.txt --from {paths} --to OTHER_DIR"
    )
    return 0 if served == total else 1
