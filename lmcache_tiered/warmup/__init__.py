"""Warm-up: policies that plan promotions (cold -> warm -> hot) ahead of use.

A policy is chosen by name (``tiered.warmup.policy``) among the entry points
of the ``lmcache_tiered.warmup_policies`` group; see :mod:`.registry`.

The names below are imported on first use: :mod:`.hints` (stdlib only) is
imported by the vLLM plugin, which vLLM loads into every one of its
processes, and must not pull in LMCache (numba, llvmlite) through this
package.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from lmcache_tiered.warmup.base import CacheView, Plan, WarmupPolicy
    from lmcache_tiered.warmup.registry import installed_policies, load_policy

__all__ = ["CacheView", "Plan", "WarmupPolicy", "installed_policies", "load_policy"]

_HOME = {
    "CacheView": "base",
    "Plan": "base",
    "WarmupPolicy": "base",
    "installed_policies": "registry",
    "load_policy": "registry",
}


def __getattr__(name: str) -> Any:
    if name not in _HOME:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f"{__name__}.{_HOME[name]}"), name)
