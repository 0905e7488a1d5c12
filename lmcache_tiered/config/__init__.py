"""Typed settings read from LMCache's ``extra_config`` (keys ``tiered.*``).

Every setting is declared once in :data:`SETTINGS` (key, parser, default,
help, the field it fills), so an unknown key, a bad type or a bad path gives
one :class:`ConfigError` that names the key and says how to fix it. LMCache
only logs a plugin's constructor error, so the backend also logs these at
ERROR before re-raising.

- :mod:`~lmcache_tiered.config.parse`: the value parsers;
- :mod:`~lmcache_tiered.config.settings`: the table of settings;
- :mod:`~lmcache_tiered.config.tiered_config`: the parsed settings, checked
  together.
"""

from lmcache_tiered.config.parse import ConfigError
from lmcache_tiered.config.settings import (
    DEFAULT_POLICY,
    GIB,
    MAX_QUEUE_DEPTH,
    MAX_SLOT_MB,
    MAX_STRIPE_KB,
    PREFIX,
    SETTINGS,
    Setting,
    plugin_extra_config,
    setting_key,
)
from lmcache_tiered.config.tiered_config import TieredConfig, TierOptions, TierSettings

__all__ = [
    "DEFAULT_POLICY",
    "GIB",
    "MAX_QUEUE_DEPTH",
    "MAX_SLOT_MB",
    "MAX_STRIPE_KB",
    "PREFIX",
    "SETTINGS",
    "ConfigError",
    "Setting",
    "TierOptions",
    "TierSettings",
    "TieredConfig",
    "setting_key",
    "plugin_extra_config",
]
