"""Every ``tiered.*`` setting, declared once: its key, parser, default, help
and the field of :class:`~lmcache_tiered.config.tiered_config.TieredConfig`
it fills. The dataclass's defaults, the configuration reference in
docs/configuration.md and the multi-process adapter's help all derive from
this table."""

from __future__ import annotations

import os
import socket
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from lmcache_tiered.config.parse import (
    Parser,
    choice,
    in_range,
    list_of,
    parse_adapter,
    parse_bool,
    parse_file,
    parse_float,
    parse_fraction,
    parse_host_id,
    parse_int,
    parse_mode,
    parse_paths,
    positive,
)

PREFIX = "tiered."
#: The warm-up policy when none is set: the one ``lmcache-tiered bench`` shows
#: best overall (docs/bench.md): on the measured workloads no
#: policy beat plain demand reads.
DEFAULT_POLICY = "none"
GIB = 1 << 30
#: The kernel's limit on an io_uring's entries (IORING_MAX_ENTRIES).
MAX_QUEUE_DEPTH = 32768
#: A stripe unit above 1 GiB is no stripe: no chunk of LMCache's is that big.
MAX_STRIPE_KB = 1 << 20
#: Nor is a chunk slot above 64 GiB (a 480B model's 256 tokens take ~64 MiB).
MAX_SLOT_MB = 64 << 10


def _same(value: Any) -> Any:
    return value


@dataclass(frozen=True, slots=True)
class Setting:
    """One ``tiered.*`` key: how to parse it, its default and what it means.
    ``shown`` says the default in words where it is computed at start;
    ``field`` names the TieredConfig field it fills (None where a composite
    field takes it, as a tier takes its paths and capacity), ``convert``
    turns the parsed value into that field's."""

    parse: Parser
    default: Any
    help: str
    shown: str | None = None
    field: str | None = None
    convert: Callable[[Any], Any] = _same

    def field_default(self) -> Any:
        """The field's value when the setting is not given."""
        return self.convert(self.default)


#: Every accepted key (without the ``tiered.`` prefix). Warm-up policy
#: parameters (``tiered.warmup.<policy>.<param>``) are passed to the policy.
SETTINGS: dict[str, Setting] = {
    "warm.paths": Setting(
        parse_paths,
        None,
        "directories of the warm tier, one per NVMe device; a list or a "
        "comma-separated string",
        "(required)",
    ),
    "warm.capacity_gb": Setting(
        positive(parse_float),
        100.0,
        "cap on bytes stored by the warm tier (host); a WARNING at start where it "
        "is more than the file systems under `warm.paths` hold",
    ),
    "cold.paths": Setting(
        parse_paths,
        None,
        "directories of the cold tier (NVMe-oF, shared FS); without it there are "
        "two tiers",
        "none",
    ),
    "cold.adapter": Setting(
        parse_adapter,
        None,
        "instead of `cold.paths`: the cold tier on a store, as the JSON LMCache's "
        "`--l2-adapter` takes (text, or a mapping in YAML)",
        "none",
        field="cold_adapter",
    ),
    "cold.capacity_gb": Setting(
        positive(parse_float),
        1000.0,
        "cap on bytes stored by the cold tier",
    ),
    "cold.write": Setting(
        choice("back", "through"),
        "back",
        "`back`: warm evictions move to cold; `through`: every put goes to both "
        "(use it for a cold tier that several hosts share)",
        field="cold_write_through",
        convert=lambda mode: mode == "through",
    ),
    "cold.auth_key_file": Setting(
        parse_file,
        None,
        "a file holding the fleet's secret (32 random bytes or more, mode 0400, "
        "the same on every host): every record the cold tier writes carries a "
        "keyed MAC (BLAKE3) and a cold record without a valid one is a miss "
        "(docs: Deploy a fleet, Security)",
        "none",
        field="cold_auth_key_file",
    ),
    "cold.owners": Setting(
        list_of(parse_host_id),
        None,
        "host ids (`host_id`) whose files in a shared cold tier are read; other "
        "hosts' files are ignored, with one WARNING each",
        "every host",
        field="cold_owners",
    ),
    "cold.owner_uids": Setting(
        list_of(in_range(parse_int, 0, 2**32 - 2)),
        None,
        "user ids that may own other hosts' files in a shared cold tier; files "
        "another user owns are ignored, with one WARNING each",
        "this process's user id",
        field="cold_owner_uids",
        convert=lambda uids: frozenset((os.geteuid(),) if uids is None else uids),
    ),
    "host_id": Setting(
        parse_host_id,
        None,
        "this host's name in a shared cold tier's file names; set it where "
        "hostnames change across restarts (containers)",
        "the hostname",
        field="host_id",
        convert=lambda host: host or parse_host_id("hostname", socket.gethostname()),
    ),
    "io_engine": Setting(
        choice("auto", "uring", "threads"),
        "auto",
        "`auto` (io_uring if a child process proved it works here, else threads "
        "with an ERROR line; a tier whose probe has not answered within 2 s starts "
        "on threads and moves to io_uring when it passes) | `uring` | `threads`",
        field="io_engine",
    ),
    "register_cpu_pool": Setting(
        choice("auto", "always", "never"),
        "auto",
        "register LMCache's CPU pool as io_uring fixed buffers (reads pin no pages "
        "per request): `auto` when LMCache pinned it (GPU hosts) | `always`, also "
        "a pageable pool (CPU-only hosts: commits the pool's memory at start-up) "
        "| `never`",
        field="register_cpu_pool",
    ),
    "queue_depth": Setting(
        in_range(positive(parse_int), 1, MAX_QUEUE_DEPTH),
        64,
        f"I/O requests kept in flight per tier, writes on at most half; at most "
        f"{MAX_QUEUE_DEPTH} (the kernel's io_uring limit), each engine caps it lower",
        field="queue_depth",
    ),
    "stripe_kb": Setting(
        in_range(parse_int, 4, MAX_STRIPE_KB),
        1024,
        f"largest stripe unit in KiB (multiple of 4, 4 to {MAX_STRIPE_KB:,}, at "
        "most `slot_mb` where that is set); the unit is chosen so a chunk fills "
        "whole rows of devices",
        field="stripe_bytes",
        convert=lambda kb: kb * 1024,
    ),
    "direct_io": Setting(
        parse_bool,
        True,
        "O_DIRECT; falls back to buffered I/O with a warning where the file "
        "system refuses it",
        field="direct_io",
    ),
    "slot_mb": Setting(
        # at least one 4 KiB block: a smaller slot cannot be planned
        in_range(parse_float, 4 / 1024, MAX_SLOT_MB),
        None,
        "largest chunk stored, in MiB; bigger ones are dropped and counted; less "
        "than one full chunk is refused at start",
        "LMCache's full chunk size",
        field="slot_bytes",
        convert=lambda mb: None if mb is None else int(mb * (1 << 20)),
    ),
    "verify_reads": Setting(
        parse_bool,
        True,
        "check each chunk's CRC32C before serving it (records recovered after a "
        "restart are always checked on first read)",
        field="verify_reads",
    ),
    "fsync": Setting(
        parse_bool,
        False,
        "fdatasync each write batch before it is acknowledged (power-loss safe; "
        "see the design page, Durability)",
        field="fsync",
    ),
    "file_mode": Setting(
        parse_mode,
        0o600,
        "permission bits of data files (0640 for a cold tier shared by a group: "
        "readers need only read); the owner must keep read and write; quote it in "
        'YAML (`"0640"`: a bare `640` is a decimal number)',
        "0600",
        field="file_mode",
    ),
    "warmup.policy": Setting(
        lambda key, value: str(value).strip(),
        DEFAULT_POLICY,
        "warm-up policy name (entry point group `lmcache_tiered.warmup_policies`; "
        "see Warm-up policies)",
        field="warmup_policy",
    ),
    "warmup.bandwidth_mbps": Setting(
        positive(parse_float),
        None,
        "cap on warm-up reads, MB/s",
        "unlimited",
        field="warmup_bandwidth_bytes_s",
        convert=lambda mbps: None if mbps is None else mbps * 1e6,
    ),
    "warmup.min_precision": Setting(
        parse_fraction,
        0.25,
        "benefit guard: while fewer than this share of the last 256 promotions to "
        "hot were used before LMCache dropped them, only one unit of warm-up work "
        "in 8 runs (0: off)",
        field="warmup_min_precision",
    ),
    "warmup.hot_fraction": Setting(
        parse_fraction,
        0.25,
        "share of the CPU tier that promotions, pinned until used or expired, may "
        "fill; those needed sooner displace those needed later (0: promotions go "
        "to warm only, the CPU tier is LMCache's alone, as with lmcache server)",
        field="warmup_hot_fraction",
    ),
    "warmup.tick_ms": Setting(
        # below 1 ms an idle engine spins (1e-9 burnt a third of a core)
        in_range(parse_float, 1.0),
        50.0,
        "period of the policies' tick event, ms (at least 1)",
        field="warmup_tick_s",
        convert=lambda ms: ms / 1000,
    ),
    "warmup.hint_port": Setting(
        in_range(parse_int, -1, 65535),
        -1,
        "loopback port of the arrival-hint endpoint (0: any free port); worker "
        "*k* on a host listens on port + *k*",
        "-1 (off)",
        field="hint_port",
    ),
    "recompute_tokens_per_s": Setting(
        positive(parse_float),
        None,
        "read-time admission: a lookup answers only the prefix of its hits the "
        "tiers can deliver before vLLM would recompute it at this many prompt "
        "tokens a second (measure it: prompt tokens / TTFT of one long request "
        "on an idle vLLM; see Read-time admission); stored chunks left out stay "
        "stored",
        "off",
        field="recompute_tokens_per_s",
    ),
    "warm.admit_after_hits": Setting(
        in_range(parse_int, 0),
        0,
        "with the `frequency` policy: write a chunk to NVMe only once it was seen "
        "this often",
        "0 (admit all)",
        field="admit_after_hits",
    ),
}


def setting_key(name: str) -> str:
    """The full key of setting ``name`` (``tiered.<name>``), as errors and
    log lines cite it; KeyError for a name that is no setting."""
    if name not in SETTINGS:
        raise KeyError(f"no setting {PREFIX}{name}")
    return PREFIX + name


def plugin_extra_config(settings: Mapping[str, Any]) -> dict[str, Any]:
    """LMCache's ``extra_config`` that loads this package as its ``tiered``
    storage plugin with ``settings`` (``tiered.*`` keys)."""
    return {
        "storage_plugin.tiered.module_path": "lmcache_tiered.backend",
        "storage_plugin.tiered.class_name": "TieredBackend",
        **settings,
    }
