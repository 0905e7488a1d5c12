"""The module path ``lmcache server --l2-adapter`` names (``"module_path":
"lmcache_tiered.mp"``): kept stable for users' command lines; the adapter
lives in :mod:`lmcache_tiered.integration.mp`. LMCache looks up the class and
its config class (the class name + ``Config``) here."""

from lmcache_tiered.integration.mp import TieredL2Adapter, TieredL2AdapterConfig

__all__ = ["TieredL2Adapter", "TieredL2AdapterConfig"]
