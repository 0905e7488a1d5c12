"""Warm-up: policies that plan promotions (cold -> warm -> hot) ahead of use.

A policy is chosen by name (``tiered.warmup.policy``) among the entry points
of the ``lmcache_tiered.warmup_policies`` group; see :mod:`.registry`.
"""

from lmcache_tiered.warmup.base import CacheView, Plan, WarmupPolicy
from lmcache_tiered.warmup.registry import installed_policies, load_policy

__all__ = ["CacheView", "Plan", "WarmupPolicy", "installed_policies", "load_policy"]
