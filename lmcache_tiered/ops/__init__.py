"""Operator tools over a tier's files: ``inspect``, ``fsck`` and ``warmup``.

They read the files a :class:`~lmcache_tiered.storage.tier.Tier` writes (see
:mod:`lmcache_tiered.storage.layout`) without a running LMCache: read-only, except
``fsck --repair`` and ``warmup``, which take the same ``flock`` a live tier
holds and so refuse to run beside one.
"""
