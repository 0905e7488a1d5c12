"""The bench's verdict does not move with its scale-down factor F.

The measurement model's rule (DESIGN.md): the same workload at two scale
factors gives the same TTFTs and ranking. Real work (LMCache's calls, this
machine's I/O) is charged once on the production clock and the drives charge
production's bytes, so F only changes what this machine stores. Here a small
workload whose TTFTs are set by loads from disk (no CPU tier, no GPU prefix
cache) runs at F = 16 (the bench's default) and 128, the rule's two scale
factors 8 times apart, through real LMCache, real files and the modelled
drives. (At F = 2 to 8 the bench itself judged the runs of a 2-vCPU Intel VM
not valid: its loop fell 5-9 % of a TTFT p50 behind the modelled clock,
where the CPU work per byte is largest; the TTFTs it printed there agreed
all the same, within 3 %.)
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from lmcache_tiered import cli
from lmcache_tiered.bench.common import report
from lmcache_tiered.bench.model import scenario, variants
from lmcache_tiered.bench.model.baseline import NO_EXTERNAL_CACHE

#: Three 1k-token documents read once, then nine times again (each with a
#: question of its own under one chunk): the rereads, most of the requests,
#: load the documents from the warm tier (the plugin, over two drives) or
#: from the stock backend's one drive.
DOCUMENT_TOKENS = 1024
FIRST_READS_MS = (0, 300, 600)
REREADS_MS = tuple(2000 + 800 * k for k in range(9))
SCALES = (16, 128)
VARIANTS = ("none", variants.LOCAL_DISK, NO_EXTERNAL_CACHE)


def write_trace(path: Path) -> Path:
    blocks = DOCUMENT_TOKENS // 512
    records = [
        {
            "timestamp": at,
            "input_length": DOCUMENT_TOKENS,
            "output_length": 4,
            "hash_ids": list(range(d * 100, d * 100 + blocks)),
        }
        for d, at in enumerate(FIRST_READS_MS)
    ]
    records += [
        {
            "timestamp": at,
            "input_length": DOCUMENT_TOKENS + 100,
            "output_length": 4,
            "hash_ids": [*range(k % 3 * 100, k % 3 * 100 + blocks), 1000 + k],
        }
        for k, at in enumerate(REREADS_MS)
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def summaries_at(tmp_path: Path, scale: int) -> dict[str, dict[str, Any]]:
    """Each variant's summary at ``--kv-scale scale``."""
    drives = [tmp_path / f"d{scale}-{i}" for i in range(2)]
    for drive in drives:
        drive.mkdir(parents=True)
    args = cli.parse_args(
        [
            "bench",
            "--trace",
            str(write_trace(tmp_path / "docs.jsonl")),
            "--profile",
            "llama-3.1-8b-tp1",
            "--kv-scale",
            str(scale),
            "--gpu-kv-gb",
            "0",
            "--hot-gb",
            "0",
            "--warm",
            ",".join(map(str, drives)),
            "--warm-drive",
            "0.1,0.1",
            "--cold",
            "none",
            "--concurrency",
            "2",
        ]
    )
    requests = scenario.load_requests(args)
    setup = scenario.make_setup(args, requests)
    workload = scenario.Workload.build(requests, setup.shape, args.seed)
    return {
        name: report.summarize(variants.run_variant(name, setup, workload, name))
        for name in VARIANTS
    }


#: Runs at one scale until all its variants are valid: a busy moment of this
#: machine (CI saw one at 6 % of a TTFT p50, 5 % being the bound) makes a
#: run invalid, which the bench reports and does not compare; so neither do we.
TRIES = 3


def valid_summaries_at(tmp_path: Path, scale: int) -> dict[str, dict[str, Any]]:
    """Each variant's summary at ``scale`` from the first of :data:`TRIES`
    runs in which every variant was valid; the last run's lags if none was."""
    for attempt in range(TRIES):
        runs = summaries_at(tmp_path / f"try{attempt}", scale)
        if all(run["valid"] for run in runs.values()):
            break
    return runs


def test_the_same_workload_at_f_16_and_128_gives_the_same_ttfts_and_ranking(
    tmp_path: Path,
) -> None:
    runs = {scale: valid_summaries_at(tmp_path, scale) for scale in SCALES}
    ttft = {
        name: [runs[scale][name]["ttft_p50_s"] for scale in SCALES] for name in VARIANTS
    }
    for scale in SCALES:
        for name in VARIANTS:
            run = runs[scale][name]
            assert run["valid"], (
                scale,
                name,
                run["lag_share"],
                run["device_overrun_share"],
            )
    # loads from disk set the TTFTs: the plugin's two drives beat the stock
    # backend's one; recomputing 1k tokens beats both on this profile
    for name, values in ttft.items():
        assert max(values) <= 1.1 * min(values), (
            name,
            dict(zip(SCALES, values, strict=True)),
        )
    rankings = {
        scale: sorted(VARIANTS, key=lambda n: runs[scale][n]["ttft_p50_s"])
        for scale in SCALES
    }
    assert len({tuple(r) for r in rankings.values()}) == 1, rankings
    assert rankings[SCALES[0]] == [NO_EXTERNAL_CACHE, "none", variants.LOCAL_DISK]
    # the rereads were served from disk, not recomputed
    for scale in SCALES:
        assert runs[scale]["none"]["hit_rate"]["warm"] > 0.5
