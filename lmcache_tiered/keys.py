"""Stable identities for LMCache keys.

Python's ``hash()`` changes with PYTHONHASHSEED, so it cannot name data on disk
or match keys across processes. A digest of ``CacheEngineKey.to_string()`` can.
"""

from __future__ import annotations

import hashlib

from lmcache.utils import CacheEngineKey, parse_cache_key

DIGEST_SIZE = 16


def key_digest(key: CacheEngineKey) -> bytes:
    """16-byte BLAKE2b digest of the key's canonical string form."""
    return hashlib.blake2b(key.to_string().encode(), digest_size=DIGEST_SIZE).digest()


def key_from_string(text: str) -> CacheEngineKey:
    """Inverse of ``CacheEngineKey.to_string()`` (layer keys included)."""
    return parse_cache_key(text)
