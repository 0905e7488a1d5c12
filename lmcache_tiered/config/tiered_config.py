"""The plugin's settings, parsed and checked together: :class:`TieredConfig`
from LMCache's ``extra_config``, each tier's :class:`TierSettings` and the
:class:`TierOptions` a tier takes. Each field's default comes from its
declaration in :mod:`lmcache_tiered.config.settings`."""

from __future__ import annotations

import difflib
import logging
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from lmcache_tiered.config.parse import ConfigError
from lmcache_tiered.config.settings import GIB, PREFIX, SETTINGS

logger = logging.getLogger("lmcache_tiered")


def _default(name: str) -> Any:
    """Setting ``name``'s field value when it is not given."""
    return SETTINGS[name].field_default()


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
    #: users that may own another host's files this tier reads (None: any)
    owner_uids: frozenset[int] | None = None
    owner_uids_setting: str = ""


@dataclass(frozen=True, slots=True)
class TieredConfig:
    """All settings of the plugin, parsed and validated."""

    warm: TierSettings
    cold: TierSettings | None = None
    #: the cold tier on a store instead: LMCache's ``--l2-adapter`` JSON
    cold_adapter: Mapping[str, Any] | None = _default("cold.adapter")
    io_engine: str = _default("io_engine")
    register_cpu_pool: str = _default("register_cpu_pool")
    queue_depth: int = _default("queue_depth")
    stripe_bytes: int = _default("stripe_kb")
    direct_io: bool = _default("direct_io")
    slot_bytes: int | None = _default("slot_mb")
    verify_reads: bool = _default("verify_reads")
    fsync: bool = _default("fsync")
    file_mode: int = _default("file_mode")
    cold_write_through: bool = _default("cold.write")
    #: the fleet secret's file: cold records carry a MAC under it
    cold_auth_key_file: str | None = _default("cold.auth_key_file")
    #: host ids whose files in a shared cold tier are read (None: all)
    cold_owners: tuple[str, ...] | None = _default("cold.owners")
    #: users that may own other hosts' files in a shared cold tier
    cold_owner_uids: frozenset[int] = field(
        default_factory=lambda: _default("cold.owner_uids")
    )
    #: names this host's files in a cold tier that several hosts share
    host_id: str = field(default_factory=lambda: _default("host_id"))
    admit_after_hits: int = _default("warm.admit_after_hits")
    warmup_policy: str = _default("warmup.policy")
    warmup_bandwidth_bytes_s: float | None = _default("warmup.bandwidth_mbps")
    warmup_hot_fraction: float = _default("warmup.hot_fraction")
    warmup_min_precision: float = _default("warmup.min_precision")
    warmup_tick_s: float = _default("warmup.tick_ms")
    hint_port: int = _default("warmup.hint_port")
    recompute_tokens_per_s: float | None = _default("recompute_tokens_per_s")
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
            owner_uids=self.cold_owner_uids if tier.name == "cold" else None,
            owner_uids_setting=f"{PREFIX}cold.owner_uids",
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
            policy_params=policy_params,
            **{
                setting.field: setting.convert(values[name])
                for name, setting in SETTINGS.items()
                if setting.field is not None
            },
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
