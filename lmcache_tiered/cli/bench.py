"""``lmcache-tiered bench``: replay a workload through real LMCache and real I/O.

Only the GPU and the drives are modelled. The serving model is one vLLM instance with
LMCache's synchronous loading, its in-process default (``--loading sync``):

- a frontend thread releases each request at its arrival time, sends the
  arrival hint the way the deployed wiring does (prompt token ids POSTed to
  the backend's loopback endpoint by a forwarder thread), then queues it;
- the engine loop has ``--concurrency`` slots (vLLM's ``max_num_seqs``). With
  slots free it takes requests from the queue, runs LMCache's lookup for each
  (pinning the hits, as the scheduler does), then retrieves the hits (as the
  worker does at the start of the step, blocking it); with ``--loading
  prefetch`` (``lmcache server``'s road, which serve-bench times) every
  waiting request is looked up while a slot is free, every chunk found is
  prefetched off the loop (vLLM's own share too, as the server does), and
  the request is scheduled once that is done, taking a slot once the chunks
  past vLLM's share are copied in; there ``hinted``'s hints are the server's
  warm prefetches into LMCache's CPU tier;
- each step computes up to ``--token-budget`` prompt tokens (chunked prefill)
  and one token for every decoding request, for the profile's modelled time,
  slept, so background I/O (writes, demotion, warm-up) overlaps it as on a
  GPU server; a request's new KV is stored when its prefill completes;
- follow-up turns of a session arrive a think time after the previous turn
  finished.

The loop keeps a GPU clock that modelled compute and the measured time of
real LMCache calls advance; it sleeps until the wall clock catches up, so a
late wake-up (another thread holding the GIL) delays no later step.

The replay runs on the production clock: each real cost (LMCache's Python per
call, threads, syscalls) is charged once, as production pays it. Only KV
bytes are scaled down (``--kv-scale F``), and every drive and link is
modelled at its production rate for F times the bytes really moved
(:mod:`lmcache_tiered.bench.model.devices`), so F changes what fits this machine,
not the verdict. A variant whose replay fell behind its GPU clock by more
than 5 % of its TTFT p50, or whose real I/O overran the modelled drives by
more than 10 % of their time, is reported as not valid and compared with
nothing.

Every variant (each ``--policies`` entry; vLLM alone, ``no_external_cache``,
the reference every change is measured against; LMCache's stock
``LocalDiskBackend`` on one drive; the all-hot bound, vLLM with unbounded
HBM) gets a fresh engine and fresh directories under ``--warm``/``--cold``.
The variants without LMCache run on virtual time, in a moment; the others
``--jobs`` at a time, each in a process of its own, so none makes another's
replay lag for the GIL (a variant's keys never leave its process, so
LMCache's token hashing needs no common PYTHONHASHSEED).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from lmcache_tiered.bench.common.args import split_list
from lmcache_tiered.bench.model import presets
from lmcache_tiered.bench.model.baseline import ALL_HOT, LOCAL_DISK, NO_EXTERNAL_CACHE
from lmcache_tiered.bench.model.options import (
    DEFAULT_COLD_LINK,
    DEFAULT_JOBS,
    DEFAULT_PLOT,
    DEFAULT_POLICIES,
    DEFAULT_WARM_DRIVE,
    DEFAULT_WARM_DRIVES,
    DEFAULT_WORKLOAD,
    LOADING_PREFETCH,
    LOADING_SYNC,
)
from lmcache_tiered.bench.model.profiles import DEFAULT_PROFILE, PROFILES
from lmcache_tiered.cli.shared import add_workload_arguments, store_arg

if TYPE_CHECKING:
    from lmcache_tiered.bench.model.devices import DeviceSpec

SUMMARY = "replay a workload through LMCache with each warm-up policy (GPU modelled)"
RUN = "lmcache_tiered.bench.model.command:main"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--preset",
        choices=list(presets.PRESETS),
        help="a named operating point; an option given on the command line at "
        "another value than its default wins ("
        + "; ".join(f"{n}: {p.description}" for n, p in presets.PRESETS.items())
        + ")",
    )
    add_workload_arguments(parser, DEFAULT_WORKLOAD)
    model = parser.add_argument_group("model")
    model.add_argument(
        "--profile",
        metavar="NAME|FILE",
        default=DEFAULT_PROFILE,
        help="model and GPUs whose compute is modelled: one of "
        f"{', '.join(PROFILES)}, or the JSON of serve-bench --calibrate (the "
        f"real server it measured) (default: {DEFAULT_PROFILE})",
    )
    model.add_argument(
        "--kv-link",
        type=float,
        metavar="GBPS",
        help="copies between LMCache's buffers and the engine's KV cache, "
        "production GB/s (default: the profile's: PCIe for a GPU; on vLLM-CPU "
        "LMCache's multi-process server measured about 0.12, see "
        "docs/serve-bench.md)",
    )
    model.add_argument(
        "--loading",
        choices=(LOADING_SYNC, LOADING_PREFETCH),
        default=LOADING_SYNC,
        help=f"how LMCache's hits reach the engine: {LOADING_SYNC}, in the engine "
        "loop, blocking the step (vLLM's LMCacheConnectorV1, in-process); "
        f"{LOADING_PREFETCH}, off it (lmcache server and vLLM's "
        "LMCacheMPConnector: a request waits for the prefetch of every chunk "
        "found and the copies into the KV cache without a slot, the others go "
        "on; the stock baseline reads as its fs adapter, one chunk of a "
        "prefetch at a time; what serve-bench runs) "
        f"(default: {LOADING_SYNC})",
    )
    model.add_argument(
        "--kv-scale",
        type=float,
        metavar="F",
        help="store F times fewer KV bytes than production, so the run fits this "
        "machine; the modelled drives charge production's bytes, so F does not "
        "change the verdict (default: the profile's)",
    )
    model.add_argument(
        "--concurrency",
        type=_concurrency_arg,
        default=(8,),
        metavar="N[,N...]",
        help="request slots, vLLM's max_num_seqs (default: 8); several, e.g. "
        "8,16: the variants run at each (--repeat times), each concurrency's "
        "results are printed, then the seed's table over all of them, and the "
        "picture shows them side by side",
    )
    model.add_argument(
        "--token-budget",
        type=int,
        default=8192,
        metavar="N",
        help="prompt tokens per step, vLLM's max_num_batched_tokens (default: 8192)",
    )
    tiers = parser.add_argument_group("tiers")
    tiers.add_argument(
        "--policies",
        metavar="LIST",
        help="warm-up policies to compare, comma-separated, or 'all' installed "
        f"ones (default: {','.join(DEFAULT_POLICIES)}: no warm-up and the "
        "arrival-hint policy, so the default run is one round of --jobs); a "
        "name given twice runs twice, as NAME#2: 'none,none' measures the "
        "run-to-run noise; NAME+admit runs NAME with read-time admission on "
        "(tiered.recompute_tokens_per_s at the profile's prefill rate)",
    )
    tiers.add_argument(
        "--no-baseline",
        action="store_true",
        help=f"skip the baselines: LMCache's stock LocalDiskBackend ({LOCAL_DISK}), "
        f"vLLM's GPU prefix cache alone ({NO_EXTERNAL_CACHE}) and the all-hot "
        f"bound ({ALL_HOT})",
    )
    tiers.add_argument(
        "--gpu-kv-gb",
        type=float,
        metavar="GB",
        help="HBM per rank for vLLM's KV cache, its GPU prefix cache in front "
        "of every variant, in production GB (10^9 bytes); 0: none (default: the "
        "profile's budget, 0.9 x GPU memory - weights - activations)",
    )
    tiers.add_argument(
        "--hot-gb",
        type=float,
        metavar="GIB",
        help="LMCache CPU tier size in GiB (LMCache's GB), 0 for none (default: "
        "a quarter of the workload's distinct KV, and at least what vLLM's HBM "
        "cache holds, up to all of it)",
    )
    tiers.add_argument(
        "--warm-gb",
        type=float,
        metavar="GIB",
        help="warm tier cap in GiB (default: the distinct KV and a little room)",
    )
    tiers.add_argument(
        "--cold-gb",
        type=float,
        metavar="GIB",
        help="cold tier cap in GiB (default: twice the distinct KV)",
    )
    tiers.add_argument(
        "--warm",
        metavar="DIRS",
        help="warm tier directories, one per drive, comma-separated; a directory "
        "named N times holds N modelled drives (default: "
        f"{DEFAULT_WARM_DRIVES} drives in the temp directory, or in the current "
        "one if that is in memory)",
    )
    tiers.add_argument(
        "--baseline-disk",
        metavar="DIRS",
        help="directory of the stock LocalDiskBackend baseline, on one modelled "
        "drive like a warm one (default: one of --warm's)",
    )
    tiers.add_argument(
        "--cold",
        metavar="DIRS",
        help="cold tier directories, or 'none' (default: as for --warm)",
    )
    tiers.add_argument(
        "--cold-adapter",
        type=store_arg("--cold-adapter"),
        metavar="JSON",
        help="the cold tier on a real store instead of directories: the JSON "
        'LMCache\'s --l2-adapter takes, e.g. \'{"type": "resp", "host": '
        '"127.0.0.1", "port": 6379}\', or \'mooncake\': a Mooncake pool of the '
        "bench's own on loopback (the run then goes in a network namespace of "
        "its own with only loopback up, which needs root: Mooncake listens on "
        "all addresses); no link is modelled (the store's own speed is the "
        "link's: a loopback store is faster than a remote one); each variant "
        "stores under a model name of its own and deletes its chunks when done",
    )
    tiers.add_argument(
        "--cold-link",
        type=_link_arg,
        default=DEFAULT_COLD_LINK,
        metavar="GBPS[,MS]|none",
        help="the cold tier is remote: a link of this bandwidth and latency per "
        "command, production units, shared by its reads and writes (default: "
        f"{DEFAULT_COLD_LINK}); 'none': cold on local drives like the warm "
        "ones, the stock baseline then gets both capacities",
    )
    tiers.add_argument(
        "--warm-drive",
        type=_link_arg,
        default=DEFAULT_WARM_DRIVE,
        metavar="GBPS[,MS]|none",
        help="each warm directory's drive (and the stock backend's): bandwidth "
        "and latency per command, production units, shared by its reads and "
        f"writes (default: {DEFAULT_WARM_DRIVE}); 'none': this machine's disk "
        "as it is, which counts F times faster than it is unless --kv-scale 1",
    )
    tiers.add_argument(
        "--restart",
        action="store_true",
        help="start each variant with LMCache as after a restart over full "
        "drives: store every distinct prompt once, untimed, wait until it is on "
        "the drives, then empty LMCache's CPU tier (the model of serve-bench "
        "--restart; with --workload random-cpu most requests then load from the "
        "drives)",
    )
    tiers.add_argument(
        "--io-engine",
        choices=["auto", "uring", "threads"],
        default="auto",
        help="the plugin's I/O engine (default: auto)",
    )
    model.add_argument(
        "--jobs",
        type=int,
        default=DEFAULT_JOBS,
        metavar="N",
        help="variants replayed at once, each in a process of its own (they "
        "share this machine's cores and disk: a run the machine could not keep "
        "up with is reported as not valid; 1: one after the other, in this "
        f"process) (default: {DEFAULT_JOBS})",
    )
    model.add_argument(
        "--repeat",
        type=int,
        default=1,
        metavar="N",
        help="run the variants N times (at each --concurrency), interleaved, and "
        "report medians (default: 1)",
    )
    out = parser.add_argument_group("output")
    out.add_argument("--json", metavar="FILE", help="write the results as JSON")
    out.add_argument(
        "--plot",
        metavar="FILE|none",
        default=DEFAULT_PLOT,
        help="write TTFT CDFs, TTFT p50 and throughput bars as a PNG "
        f"(default: {DEFAULT_PLOT} in the current directory; 'none': no picture)",
    )
    parser.set_defaults(
        # how a preset's text settings become values (presets.apply)
        preset_parse=PRESET_PARSE,
        # as given, before their type parsed them: presets.apply compares
        preset_defaults={
            dest: parser.get_default(dest)
            for preset in presets.PRESETS.values()
            for dest in preset.settings
        },
    )


def _link_arg(text: str) -> DeviceSpec | None:
    from lmcache_tiered.bench.model.devices import (
        DeviceSpec,  # when parsed, not at --help
    )

    if text == "none":
        return None
    try:
        return DeviceSpec.parse(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _concurrency_arg(text: str) -> tuple[int, ...]:
    values = split_list(text)
    if not values or not all(v.isdigit() and int(v) >= 1 for v in values):
        raise argparse.ArgumentTypeError(
            f"{text!r}: give request slots as whole numbers of at least 1, "
            "comma-separated, e.g. 8 or 8,16"
        )
    levels = tuple(int(v) for v in values)
    if len(set(levels)) < len(levels):
        raise argparse.ArgumentTypeError(f"{text!r}: a concurrency is given twice")
    return levels


#: How a preset's text settings become values, as their options' types do.
PRESET_PARSE: dict[str, Callable[[Any], Any]] = {
    "cold_link": _link_arg,
    "warm_drive": _link_arg,
}
