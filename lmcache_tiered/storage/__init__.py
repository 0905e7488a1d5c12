"""Storage: one tier's chunks on disk or in a store, each record checked.

The on-disk format (:mod:`.layout`: names, superblock, record headers), the
tier's files (:mod:`.files`, :mod:`.tierfiles`), its in-memory index
(:mod:`.index`) and health (:mod:`.health`), the file tier (:mod:`.tier`),
the store-backed tier over one of LMCache's L2 adapters (:mod:`.adapter_tier`,
:mod:`.store_client`), and the protocol every tier keeps
(:mod:`.base`).

May import: :mod:`lmcache_tiered.io` and the foundation modules (``config``,
``keys``, ``metrics``, ``_lmcache``); nothing of the cache, warm-up or
integration layers above it.
"""
