"""The module path LMCache's YAML names (``storage_plugin.tiered.module_path:
lmcache_tiered.backend``): kept stable for users' configurations; the plugin
lives in :mod:`lmcache_tiered.integration.backend`."""

from lmcache_tiered.integration.backend import TieredBackend

__all__ = ["TieredBackend"]
