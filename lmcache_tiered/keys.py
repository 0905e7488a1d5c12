"""Stable identities for LMCache keys.

Python's ``hash()`` changes with PYTHONHASHSEED, so it cannot name data on disk
or match keys across processes. A digest of a key's canonical text can. Two
key types reach the tiers: ``CacheEngineKey`` from the in-process plugin and
``ObjectKey`` from LMCache's multi-process server (the L2 adapter).
"""

from __future__ import annotations

import functools
import hashlib
import urllib.parse
from typing import TypeAlias

from lmcache.utils import CacheEngineKey, parse_cache_key
from lmcache.v1.distributed.api import ObjectKey

DIGEST_SIZE = 16
#: Keys whose digests are remembered: a chunk's key is digested about a dozen
#: times on its way through a lookup and a load (index, promoter, ledger), and
#: its text (a quoted model name, a hash in hex) costs more than the hash.
DIGESTS_REMEMBERED = 1 << 16

#: A key the tiers store chunks under.
StoreKey: TypeAlias = CacheEngineKey | ObjectKey


def key_text(key: StoreKey) -> str:
    """The key's canonical, reversible text (what headers store).

    An ObjectKey is written as LMCache's raw-block adapter writes it
    (``object_key_to_string`` of its ``raw_block.key_codec``):
    ``<quoted model>@0x<kv_rank:08x>@<group:x>@<chunk hash hex>[@<salt>]``.
    Its second field starts with ``0x``; a CacheEngineKey's (the world size)
    is decimal, so the two forms never collide.
    """
    if isinstance(key, ObjectKey):
        text = (
            f"{urllib.parse.quote(key.model_name, safe='')}@{key.kv_rank:#010x}"
            f"@{key.object_group_id:x}@{key.chunk_hash.hex()}"
        )
        return f"{text}@{key.cache_salt}" if key.cache_salt else text
    return str(key.to_string())


@functools.lru_cache(maxsize=DIGESTS_REMEMBERED)
def key_digest(key: StoreKey) -> bytes:
    """16-byte BLAKE2b digest of the key's canonical text.

    Remembered per key: both key types compare equal exactly when their texts
    are equal (every field the text holds, the type included), so a remembered
    digest is the one the text would give.
    """
    return hashlib.blake2b(key_text(key).encode(), digest_size=DIGEST_SIZE).digest()


def key_from_string(text: str) -> StoreKey:
    """Inverse of :func:`key_text` (CacheEngineKey layer keys included).

    Raises ValueError (or KeyError from LMCache's parser) on malformed text.
    """
    parts = text.split("@")
    if len(parts) in (4, 5) and parts[1].startswith("0x"):
        return ObjectKey(
            chunk_hash=bytes.fromhex(parts[3]),
            model_name=urllib.parse.unquote(parts[0]),
            kv_rank=int(parts[1], 16),
            object_group_id=int(parts[2], 16),
            cache_salt=parts[4] if len(parts) == 5 else "",
        )
    return parse_cache_key(text)
