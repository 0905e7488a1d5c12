"""Typed settings read from LMCache's ``extra_config`` (keys ``tiered.*``).

Every setting has one entry in :data:`SETTINGS` (name, parser, default, help),
so an unknown key, a bad type or a bad path gives one :class:`ConfigError` that
names the key and says how to fix it. LMCache only logs a plugin's constructor
error, so the backend also logs these at ERROR before re-raising.
"""

from __future__ import annotations

import difflib
import json
import logging
import math
import os
import re
import socket
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger("lmcache_tiered")

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


class ConfigError(ValueError):
    """A ``tiered.*`` setting is missing, unknown or has a bad value."""


def _parse_paths(key: str, value: Any) -> tuple[str, ...]:
    if isinstance(value, str):
        items = [p.strip() for p in value.split(",")]
    elif isinstance(value, (list, tuple)):
        items = [str(p).strip() for p in value]
    else:
        raise ConfigError(
            f"{key}: expected a list of directories or a comma-separated string, "
            f"got {type(value).__name__} {value!r}"
        )
    paths = tuple(os.path.abspath(os.path.expanduser(p)) for p in items if p)
    if not paths:
        raise ConfigError(f"{key}: no directory given; list one directory per device")
    if len(set(paths)) != len(paths):
        raise ConfigError(f"{key}: a directory is listed twice: {list(paths)}")
    return paths


def _parse_adapter(key: str, value: Any) -> dict[str, Any]:
    """The adapter spec of ``tiered.cold.adapter``: a JSON object (text, or a
    mapping from YAML) with a ``type``; ConfigError otherwise."""
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ConfigError(
                f"{key}: not valid JSON ({exc}); give the JSON LMCache's "
                """--l2-adapter takes, e.g. {"type": "resp", "host": "127.0.0.1", """
                '"port": 6379}'
            ) from None
    if not isinstance(value, dict) or not isinstance(value.get("type"), str):
        raise ConfigError(
            f'{key}: expected a JSON object with a "type" (an LMCache L2 adapter '
            f"type such as resp, valkey, s3, mooncake_store, fs), got {value!r}"
        )
    return dict(value)


def _parse_float(key: str, value: Any) -> float:
    if isinstance(value, bool):
        raise ConfigError(f"{key}: expected a number, got {value!r}")
    try:
        number = float(value)
    except (TypeError, ValueError, OverflowError):
        raise ConfigError(f"{key}: expected a number, got {value!r}") from None
    if not math.isfinite(number):
        raise ConfigError(f"{key}: expected a finite number, got {value!r}")
    return number


def _parse_int(key: str, value: Any) -> int:
    number = _parse_float(key, value)
    if number != int(number):
        raise ConfigError(f"{key}: expected a whole number, got {value!r}")
    return int(number)


def _parse_bool(key: str, value: Any) -> bool:
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("true", "1", "yes", "on"):
        return True
    if isinstance(value, str) and value.strip().lower() in ("false", "0", "no", "off"):
        return False
    raise ConfigError(f"{key}: expected true or false, got {value!r}")


def _choice(*choices: str) -> Callable[[str, Any], str]:
    def parse(key: str, value: Any) -> str:
        text = str(value).strip().lower()
        if text not in choices:
            raise ConfigError(
                f"{key}: expected one of {', '.join(choices)}, got {value!r}"
            )
        return text

    return parse


def _positive(parse: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
    def parse_positive(key: str, value: Any) -> Any:
        number = parse(key, value)
        if number <= 0:
            raise ConfigError(f"{key}: must be greater than 0, got {value!r}")
        return number

    return parse_positive


def _in_range(
    parse: Callable[[str, Any], Any], low: float, high: float = math.inf
) -> Callable[[str, Any], Any]:
    def parse_in_range(key: str, value: Any) -> Any:
        number = parse(key, value)
        if not low <= number <= high:
            limits = (
                f"at least {low:g}"
                if high == math.inf
                else f"between {low:g} and {high:g}"
            )
            raise ConfigError(f"{key}: must be {limits}, got {value!r}")
        return number

    return parse_in_range


def _fraction(key: str, value: Any) -> float:
    number = _parse_float(key, value)
    if not 0.0 <= number <= 1.0:
        raise ConfigError(f"{key}: must be between 0 and 1, got {value!r}")
    return number


def _parse_host_id(key: str, value: Any) -> str:
    text = str(value).strip()
    if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", text):
        raise ConfigError(
            f"{key}: expected 1-64 letters, digits, '.', '_' or '-', got {value!r}"
        )
    return text


def _parse_mode(key: str, value: Any) -> int:
    """Octal permission bits: "0660" (string) or an int as YAML may give it
    (YAML reads 0660 as octal, but 660 as a decimal number)."""
    expected = f'{key}: expected octal permission bits like "0600", got {value!r}'
    try:
        mode = value if isinstance(value, int) else int(str(value), 8)
    except ValueError:
        raise ConfigError(expected) from None
    if not 0 <= mode <= 0o777 or isinstance(mode, bool):
        if isinstance(value, int) and re.fullmatch("[0-7]{3}", str(value)):
            expected += f' (YAML reads {value} as a decimal number: write "0{value}")'
        raise ConfigError(expected)
    if mode & 0o600 != 0o600:
        raise ConfigError(
            f"{key}: {mode:04o} does not let the owner read and write its own "
            'files; give at least "0600"'
        )
    return mode


@dataclass(frozen=True, slots=True)
class Setting:
    """One ``tiered.*`` key: how to parse it, its default and what it means
    (the configuration reference in docs/configuration.md is made of these).
    ``shown`` says the default in words where it is computed at start."""

    parse: Callable[[str, Any], Any]
    default: Any
    help: str
    shown: str | None = None


#: Every accepted key (without the ``tiered.`` prefix). Warm-up policy
#: parameters (``tiered.warmup.<policy>.<param>``) are passed to the policy.
SETTINGS: dict[str, Setting] = {
    "warm.paths": Setting(
        _parse_paths,
        None,
        "directories of the warm tier, one per NVMe device; a list or a "
        "comma-separated string",
        "(required)",
    ),
    "warm.capacity_gb": Setting(
        _positive(_parse_float),
        100.0,
        "cap on bytes stored by the warm tier (host); a WARNING at start where it "
        "is more than the file systems under `warm.paths` hold",
    ),
    "cold.paths": Setting(
        _parse_paths,
        None,
        "directories of the cold tier (NVMe-oF, shared FS); without it there are "
        "two tiers",
        "none",
    ),
    "cold.adapter": Setting(
        _parse_adapter,
        None,
        "instead of `cold.paths`: the cold tier on a store, as the JSON LMCache's "
        "`--l2-adapter` takes (text, or a mapping in YAML)",
        "none",
    ),
    "cold.capacity_gb": Setting(
        _positive(_parse_float), 1000.0, "cap on bytes stored by the cold tier"
    ),
    "cold.write": Setting(
        _choice("back", "through"),
        "back",
        "`back`: warm evictions move to cold; `through`: every put goes to both "
        "(use it for a cold tier that several hosts share)",
    ),
    "host_id": Setting(
        _parse_host_id,
        None,
        "this host's name in a shared cold tier's file names; set it where "
        "hostnames change across restarts (containers)",
        "the hostname",
    ),
    "io_engine": Setting(
        _choice("auto", "uring", "threads"),
        "auto",
        "`auto` (io_uring if a child process proved it works here, else threads "
        "with an ERROR line; a tier whose probe has not answered within 2 s starts "
        "on threads and moves to io_uring when it passes) | `uring` | `threads`",
    ),
    "register_cpu_pool": Setting(
        _choice("auto", "always", "never"),
        "auto",
        "register LMCache's CPU pool as io_uring fixed buffers (reads pin no pages "
        "per request): `auto` when LMCache pinned it (GPU hosts) | `always`, also "
        "a pageable pool (CPU-only hosts: commits the pool's memory at start-up) "
        "| `never`",
    ),
    "queue_depth": Setting(
        _in_range(_positive(_parse_int), 1, MAX_QUEUE_DEPTH),
        64,
        f"I/O requests kept in flight per tier, writes on at most half; at most "
        f"{MAX_QUEUE_DEPTH} (the kernel's io_uring limit), each engine caps it lower",
    ),
    "stripe_kb": Setting(
        _in_range(_parse_int, 4, MAX_STRIPE_KB),
        1024,
        f"largest stripe unit in KiB (multiple of 4, 4 to {MAX_STRIPE_KB:,}, at "
        "most `slot_mb` where that is set); the unit is chosen so a chunk fills "
        "whole rows of devices",
    ),
    "direct_io": Setting(
        _parse_bool,
        True,
        "O_DIRECT; falls back to buffered I/O with a warning where the file "
        "system refuses it",
    ),
    "slot_mb": Setting(
        # at least one 4 KiB block: a smaller slot cannot be planned
        _in_range(_parse_float, 4 / 1024, MAX_SLOT_MB),
        None,
        "largest chunk stored, in MiB; bigger ones are dropped and counted; less "
        "than one full chunk is refused at start",
        "LMCache's full chunk size",
    ),
    "verify_reads": Setting(
        _parse_bool,
        True,
        "check each chunk's CRC32C before serving it (records recovered after a "
        "restart are always checked on first read)",
    ),
    "fsync": Setting(
        _parse_bool,
        False,
        "fdatasync each write batch before it is acknowledged (power-loss safe; "
        "see the design page, Durability)",
    ),
    "file_mode": Setting(
        _parse_mode,
        0o600,
        "permission bits of data files (0660 for a cold tier shared by a group); "
        'the owner must keep read and write; quote it in YAML (`"0660"`: a bare '
        "`660` is a decimal number)",
        "0600",
    ),
    "warmup.policy": Setting(
        lambda key, value: str(value).strip(),
        DEFAULT_POLICY,
        "warm-up policy name (entry point group `lmcache_tiered.warmup_policies`; "
        "see Warm-up policies)",
    ),
    "warmup.bandwidth_mbps": Setting(
        _positive(_parse_float), None, "cap on warm-up reads, MB/s", "unlimited"
    ),
    "warmup.min_precision": Setting(
        _fraction,
        0.25,
        "benefit guard: while fewer than this share of the last 256 promotions to "
        "hot were used before LMCache dropped them, only one unit of warm-up work "
        "in 8 runs (0: off)",
    ),
    "warmup.hot_fraction": Setting(
        _fraction,
        0.25,
        "share of the CPU tier that promotions, pinned until used or expired, may "
        "fill; those needed sooner displace those needed later",
    ),
    "warmup.tick_ms": Setting(
        # below 1 ms an idle engine spins (1e-9 burnt a third of a core)
        _in_range(_parse_float, 1.0),
        50.0,
        "period of the policies' tick event, ms (at least 1)",
    ),
    "warmup.hint_port": Setting(
        _in_range(_parse_int, -1, 65535),
        -1,
        "loopback port of the arrival-hint endpoint (0: any free port); worker "
        "*k* on a host listens on port + *k*",
        "-1 (off)",
    ),
    "warm.admit_after_hits": Setting(
        _in_range(_parse_int, 0),
        0,
        "with the `frequency` policy: write a chunk to NVMe only once it was seen "
        "this often",
        "0 (admit all)",
    ),
}


def plugin_extra_config(settings: Mapping[str, Any]) -> dict[str, Any]:
    """LMCache's ``extra_config`` that loads this package as its ``tiered``
    storage plugin with ``settings`` (``tiered.*`` keys)."""
    return {
        "storage_plugin.tiered.module_path": "lmcache_tiered.backend",
        "storage_plugin.tiered.class_name": "TieredBackend",
        **settings,
    }


@dataclass(frozen=True, slots=True)
class TierSettings:
    """Where one tier lives and how much it may hold."""

    name: str
    paths: tuple[str, ...]
    capacity_bytes: int


@dataclass(frozen=True, slots=True)
class TierOptions:
    """What one tier (:class:`lmcache_tiered.storage.tier.Tier`) takes from the
    settings, in its own words. The ``*_setting`` fields are the names its
    errors and warnings cite, so the storage layer speaks no configuration
    vocabulary and the operator still reads what to change."""

    name: str
    paths: tuple[str, ...]
    stripe_bytes: int
    io_engine: str
    queue_depth: int
    direct_io: bool
    verify_reads: bool
    fsync: bool
    file_mode: int
    paths_setting: str
    capacity_setting: str
    slot_setting: str


@dataclass(frozen=True, slots=True)
class TieredConfig:
    """All settings of the plugin, parsed and validated."""

    warm: TierSettings
    cold: TierSettings | None = None
    #: the cold tier on a store instead: LMCache's ``--l2-adapter`` JSON
    cold_adapter: Mapping[str, Any] | None = None
    io_engine: str = "auto"
    register_cpu_pool: str = "auto"
    queue_depth: int = 64
    stripe_bytes: int = 1 << 20
    direct_io: bool = True
    slot_bytes: int | None = None
    verify_reads: bool = True
    fsync: bool = False
    file_mode: int = 0o600
    cold_write_through: bool = False
    #: names this host's files in a cold tier that several hosts share
    host_id: str = field(default_factory=socket.gethostname)
    admit_after_hits: int = 0
    warmup_policy: str = DEFAULT_POLICY
    warmup_bandwidth_bytes_s: float | None = None
    warmup_hot_fraction: float = 0.25
    warmup_min_precision: float = 0.25
    warmup_tick_s: float = 0.05
    hint_port: int = -1
    #: ``tiered.warmup.<policy>.<param>`` values, keyed ``<policy>.<param>``
    policy_params: Mapping[str, Any] = field(default_factory=dict)

    def tier_options(self, tier: TierSettings) -> TierOptions:
        """The options of the tier ``tier`` (warm or cold) of these settings."""
        return TierOptions(
            name=tier.name,
            paths=tier.paths,
            stripe_bytes=self.stripe_bytes,
            io_engine=self.io_engine,
            queue_depth=self.queue_depth,
            direct_io=self.direct_io,
            verify_reads=self.verify_reads,
            fsync=self.fsync,
            file_mode=self.file_mode,
            paths_setting=f"{PREFIX}{tier.name}.paths",
            capacity_setting=f"{PREFIX}{tier.name}.capacity_gb",
            slot_setting=f"{PREFIX}slot_mb",
        )

    @staticmethod
    def from_extra_config(extra_config: Mapping[str, Any] | None) -> TieredConfig:
        """Parse the ``tiered.*`` keys of LMCache's ``extra_config``."""
        raw = {
            k[len(PREFIX) :]: v
            for k, v in (extra_config or {}).items()
            if k.startswith(PREFIX)
        }
        # tiered.warmup.<policy>.<param>: checked by the policy registry
        policy_params = {
            k[len("warmup.") :]: v for k, v in raw.items() if _is_policy_param(k)
        }
        unknown = sorted(
            k for k in raw if k not in SETTINGS and not _is_policy_param(k)
        )
        if unknown:
            key = unknown[0]
            close = difflib.get_close_matches(key, SETTINGS, n=1)
            hint = f" Did you mean {PREFIX}{close[0]}?" if close else ""
            raise ConfigError(
                f"unknown setting {PREFIX}{key}.{hint} Known settings: "
                + ", ".join(PREFIX + k for k in SETTINGS)
            )
        values = {
            name: setting.parse(PREFIX + name, raw[name])
            if name in raw
            else setting.default
            for name, setting in SETTINGS.items()
        }
        if values["warm.paths"] is None:
            raise ConfigError(
                f"{PREFIX}warm.paths is required: list one directory per NVMe "
                'device, e.g. tiered.warm.paths: ["/mnt/nvme0/kv", "/mnt/nvme1/kv"]'
            )
        stripe_kb = values["stripe_kb"]
        if stripe_kb % 4:
            raise ConfigError(
                f"{PREFIX}stripe_kb: must be a multiple of 4 (O_DIRECT alignment), "
                f"got {stripe_kb}"
            )
        slot_mb = values["slot_mb"]
        if "stripe_kb" in raw and slot_mb is not None and stripe_kb > slot_mb * 1024:
            raise ConfigError(
                f"{PREFIX}stripe_kb: {stripe_kb} KiB is larger than a chunk slot "
                f"({PREFIX}slot_mb: {slot_mb:g} MiB): give at most "
                f"{int(slot_mb * 1024) // 4 * 4}, or raise {PREFIX}slot_mb"
            )
        warm = _tier("warm", values)
        if values["cold.paths"] is not None and values["cold.adapter"] is not None:
            raise ConfigError(
                f"{PREFIX}cold.paths and {PREFIX}cold.adapter are both set: the cold "
                "tier is either files or a store; remove one"
            )
        cold = _tier("cold", values) if values["cold.paths"] is not None else None
        for path in cold.paths if cold is not None else ():
            if (pair := same_directory((*warm.paths, path))) is not None:
                raise ConfigError(
                    f"{PREFIX}cold.paths: {path} is also a warm path ({pair[0]}); "
                    "give each tier its own directories"
                )
        return TieredConfig(
            warm=warm,
            cold=cold,
            cold_adapter=values["cold.adapter"],
            io_engine=values["io_engine"],
            register_cpu_pool=values["register_cpu_pool"],
            queue_depth=values["queue_depth"],
            stripe_bytes=stripe_kb * 1024,
            direct_io=values["direct_io"],
            slot_bytes=None if slot_mb is None else int(slot_mb * (1 << 20)),
            verify_reads=values["verify_reads"],
            fsync=values["fsync"],
            file_mode=values["file_mode"],
            cold_write_through=values["cold.write"] == "through",
            host_id=values["host_id"]
            or _parse_host_id("hostname", socket.gethostname()),
            admit_after_hits=values["warm.admit_after_hits"],
            warmup_policy=values["warmup.policy"],
            warmup_bandwidth_bytes_s=None
            if values["warmup.bandwidth_mbps"] is None
            else values["warmup.bandwidth_mbps"] * 1e6,
            warmup_hot_fraction=values["warmup.hot_fraction"],
            warmup_min_precision=values["warmup.min_precision"],
            warmup_tick_s=values["warmup.tick_ms"] / 1000,
            hint_port=values["warmup.hint_port"],
            policy_params=policy_params,
        )


def _is_policy_param(name: str) -> bool:
    return name.startswith("warmup.") and name.count(".") >= 2 and name not in SETTINGS


def _tier(name: str, values: Mapping[str, Any]) -> TierSettings:
    paths = values[f"{name}.paths"]
    for path in paths:
        check_directory(f"{PREFIX}{name}.paths", path)
    if (pair := same_directory(paths)) is not None:
        raise ConfigError(
            f"{PREFIX}{name}.paths: {pair[0]} and {pair[1]} are the same directory "
            "(a symbolic link or bind mount); list each directory once, one per "
            "device"
        )
    capacity_gb = values[f"{name}.capacity_gb"]
    room = _file_system_bytes(paths)
    if room is not None and capacity_gb * GIB > room:
        logger.warning(
            "%s%s.capacity_gb: %g GiB is more than the file systems under %s%s.paths "
            "hold (%.1f GiB): the tier will fill them before it evicts; lower it",
            PREFIX, name, capacity_gb, PREFIX, name, room / GIB,
        )  # fmt: skip
    return TierSettings(
        name=name,
        paths=paths,
        capacity_bytes=int(capacity_gb * GIB),
    )


def _file_system_bytes(paths: Sequence[str]) -> int | None:
    """The size of the distinct file systems under ``paths`` together (None
    where one cannot be asked)."""
    sizes: dict[int, int] = {}
    try:
        for path in paths:
            info = os.statvfs(path)
            sizes[os.stat(path).st_dev] = info.f_blocks * info.f_frsize
    except OSError:
        return None
    return sum(sizes.values())


def check_directory(key: str, path: str) -> None:
    """Raise a ConfigError unless ``path`` is an existing, writable directory."""
    if not os.path.exists(path):
        raise ConfigError(
            f"{key}: {path} does not exist; create it on the device's file system "
            f"(mkdir -p {path}) or fix the path"
        )
    if not os.path.isdir(path):
        raise ConfigError(f"{key}: {path} is not a directory")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(
            f"{key}: {path} is not writable by this process (uid {os.getuid()}); "
            "fix its owner or permissions"
        )


def same_directory(paths: Sequence[str]) -> tuple[str, str] | None:
    """The first two of ``paths`` that are one directory, however spelled (a
    symbolic link, a bind mount: the same ``st_dev`` and ``st_ino``)."""
    seen: dict[tuple[int, int], int] = {}
    for i, path in enumerate(paths):
        info = os.stat(path)
        first = seen.setdefault((info.st_dev, info.st_ino), i)
        if first != i:
            return paths[first], path
    return None
