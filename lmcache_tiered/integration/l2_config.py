"""The multi-process adapter's settings: ``adapter_params`` parsed as the
YAML's ``tiered.*`` settings (:class:`TieredL2AdapterConfig`, which LMCache
finds by the adapter's class name + ``Config``), and the capacity LMCache's
usage accounting is given."""

from __future__ import annotations

import re
from typing import Any

from lmcache.v1.distributed.l2_adapters.config import L2AdapterConfigBase

from lmcache_tiered.cache.tiered_cache import EmptyView, load_configured_policy
from lmcache_tiered.config import PREFIX, SETTINGS, ConfigError, TieredConfig


class TieredL2AdapterConfig(L2AdapterConfigBase):
    """The adapter's ``adapter_params``: the ``tiered.*`` settings, no prefix."""

    def __init__(self, settings: TieredConfig) -> None:
        self.settings = settings

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TieredL2AdapterConfig:
        """Parse ``adapter_params``; names copied with the prefix also work."""
        extra = {k if k.startswith(PREFIX) else PREFIX + k: v for k, v in d.items()}
        try:
            settings = TieredConfig.from_extra_config(extra)
            # Built and dropped to check the policy's name and parameters now:
            # the real one is built when the tiers open, maybe at the first
            # store (when the slot size is known), long after start-up.
            load_configured_policy(settings, EmptyView())
            return cls(settings)
        except ConfigError as exc:
            # name settings as the user wrote them: without the prefix
            text = re.sub(rf"(?<![\w/.]){re.escape(PREFIX)}", "", str(exc))
            raise ConfigError(f"TieredL2Adapter adapter_params: {text}") from None

    @classmethod
    def help(cls) -> str:
        lines = [f"- {name}: {setting.help}" for name, setting in SETTINGS.items()]
        head = "TieredL2Adapter adapter_params (the YAML's tiered.* settings):"
        return "\n".join([head, *lines])


def capacity_bytes(settings: TieredConfig) -> int:
    """Most bytes of distinct chunks the tiers hold, as LMCache's usage counts
    them (each chunk once): with write-through warm only holds copies."""
    warm = settings.warm.capacity_bytes
    cold = 0 if settings.cold is None else settings.cold.capacity_bytes
    return max(warm, cold) if settings.cold_write_through else warm + cold
