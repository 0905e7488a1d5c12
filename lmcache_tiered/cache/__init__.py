"""The cache: tiers composed into one cache for LMCache.

:class:`.tiered_cache.TieredCache` puts the warm and cold tiers behind one
lookup/read/write face; demand reads fan out over the tiers (:mod:`.reads`),
puts are written behind by one writer thread (:mod:`.writer`), and a cold
tier shared by several hosts is coordinated in :mod:`.shared`.

May import: :mod:`lmcache_tiered.storage`, :mod:`lmcache_tiered.warmup`,
:mod:`lmcache_tiered.io` and the foundation modules; never the integration
layer that calls it.
"""
