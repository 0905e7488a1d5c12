"""The bench's defaults and the names of its choices, shared by its command
line (:mod:`lmcache_tiered.cli.bench`) and the run; importing this module
imports neither torch nor LMCache, so ``--help`` answers at once."""

from __future__ import annotations

#: Warm drives (directories) when ``--warm`` names none: the deployment the
#: plugin is built for stripes over several local NVMe drives.
DEFAULT_WARM_DRIVES = 4
#: How the served engine loads LMCache's hits (``--loading``): in the engine
#: loop, blocking the step (vLLM's LMCacheConnectorV1 in-process, LMCache's
#: default), or prefetched off it (``lmcache server`` with vLLM's
#: LMCacheMPConnector, the multi-process road)
LOADING_SYNC, LOADING_PREFETCH = "sync", "prefetch"
#: The deployment the plugin is built for, at the seed's rates: warm, four
#: local NVMe drives of 1.31 GB/s + 0.1 ms (5.23 GB/s striped, the seed's
#: parallel-read rate; one drive, the stock backend's, near its 0.98 GB/s).
DEFAULT_WARM_DRIVE = "1.31,0.1"
#: Variants replayed at once, each in a process of its own: three kept
#: valid on the 2-core machine the defaults are sized for (docs/bench.md).
DEFAULT_JOBS = 3
#: The policies of a run with no options: with the stock backend, one round
#: of DEFAULT_JOBS.
DEFAULT_POLICIES = ("none", "hinted")
#: The built-in workload of a run with no options: its working set is larger
#: than vLLM's HBM cache and LMCache's CPU tier, as the seed's was.
DEFAULT_WORKLOAD = "agent"
#: Cold: the fleet's NVMe-oF array over TCP, one 25 GbE path per host,
#: shared by the host's reads and its demotions: 3.125 GB/s line rate, about
#: 2.8 GB/s of NVMe data after TCP/IP and NVMe/TCP framing; 0.3 ms a command
#: (NVMe/TCP over 25 GbE: 200-500 us end to end for a 4 KiB read against
#: 50-150 us for local NVMe, simplyblock.io/glossary/nvme-tcp-vs-local-nvme/).
#: Slower per host than the local drives, as in the deployments the vendor
#: report describes.
DEFAULT_COLD_LINK = "2.8,0.3"
#: Where the picture goes unless --plot says otherwise.
DEFAULT_PLOT = "lmcache-tiered-bench.png"
