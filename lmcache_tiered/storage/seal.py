"""Keyed MACs on the records of a cold tier that a fleet shares.

CRC32C finds damage, not forgery: whoever can write a shared cold directory or
the store behind a cold tier can craft a record, header checksum and payload
checksum included, for a key that follows from the model's name and the
tokens (a known system prompt), and every host would serve its bytes as KV.
Under a fleet secret (``tiered.cold.auth_key_file``) every record the cold
tier writes carries a BLAKE3 keyed MAC of what it is (key, shape, dtype,
format, size: :meth:`RecordHeader.identity`) and of its payload, and a cold
record without a valid one is a miss: without the secret nobody can make a
host serve bytes no holder of the secret wrote. BLAKE3's keyed mode is a MAC
by design, one pass, about 3.5x CRC32C's CPU per GB here (docs/design.md).
"""

from __future__ import annotations

import hmac
import logging
import os
import stat
import threading
from collections.abc import Callable
from typing import TypeVar

import blake3

from lmcache_tiered.config import ConfigError
from lmcache_tiered.metrics import TierStats
from lmcache_tiered.storage.layout import MAC_SIZE, SEALED_VERSION, RecordHeader
from lmcache_tiered.storage.payload import Payload

_Item = TypeVar("_Item")

logger = logging.getLogger("lmcache_tiered")

#: Fewest bytes of a fleet secret: 256 bits, what the MAC's key holds.
MIN_SECRET_BYTES = 32
#: A secret file larger than this is not a secret file.
MAX_SECRET_BYTES = 4096
#: BLAKE3's key derivation context: the MAC key is the secret's, for this use only.
_CONTEXT = "lmcache-tiered 2026-12-06 cold record MAC"


class RecordSeal:
    """Signs and checks records under one fleet secret."""

    __slots__ = ("_key",)

    def __init__(self, secret: bytes) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"a fleet secret needs {MIN_SECRET_BYTES} bytes at least")
        self._key = blake3.blake3(secret, derive_key_context=_CONTEXT).digest()

    def __repr__(self) -> str:  # never the key, in a log line or a traceback
        return "RecordSeal(<secret>)"

    def mac(self, identity: bytes, payload: memoryview) -> bytes:
        """The MAC of a record that is ``identity`` and holds ``payload``."""
        hasher = blake3.blake3(identity, key=self._key)
        hasher.update(payload)
        mac: bytes = hasher.digest(MAC_SIZE)
        return mac

    def verifies(self, header: RecordHeader, payload: memoryview) -> bool:
        """Whether ``header`` carries a valid MAC for ``payload`` (a record of
        another version carries none)."""
        return header.version == SEALED_VERSION and hmac.compare_digest(
            self.mac(header.identity(), payload), header.mac
        )


class SealedRecords:
    """One tier's records under the fleet secret: what it writes is signed,
    what lacks a valid MAC is refused, counted in its ``unsigned`` and the
    first logged (one WARNING per owner's files or store)."""

    def __init__(self, seal: RecordSeal, stats: TierStats, where: str) -> None:
        self._seal = seal
        self._stats = stats
        self._where = where
        self._logged = False
        self._lock = threading.Lock()

    def sign(self, payload: Payload) -> bytes:
        return self._seal.mac(payload.identity(), payload.view)

    def sealed(
        self, items: list[_Item], header: Callable[[_Item], RecordHeader]
    ) -> list[_Item]:
        """The ``items`` whose record (``header(item)``, as
        :func:`~lmcache_tiered.storage.layout.newest` takes it) carries a MAC;
        the others are refused."""
        kept = [i for i in items if header(i).version == SEALED_VERSION]
        if unsigned := len(items) - len(kept):
            self.refuse(unsigned, f"{unsigned} records without a MAC")
        return kept

    def passes(self, header: RecordHeader, payload: memoryview) -> bool:
        """Whether ``payload`` read under ``header`` verifies (else refused)."""
        return self._seal.verifies(header, payload) or self.refuse(
            1, "a record whose MAC does not verify"
        )

    def refuse(self, count: int, what: str) -> bool:
        """Count ``count`` records refused (``what`` they were); False, what
        a read that refuses one returns."""
        with self._lock:
            self._stats.unsigned += count
            first, self._logged = not self._logged, True
        logger.log(
            logging.WARNING if first else logging.DEBUG,
            "%s: %s: refused, never served (forged, or written without the "
            "fleet secret; counted in unsigned, logged once)",
            self._where,
            what,
        )
        return False


def load_seal(path: str, setting: str) -> RecordSeal:
    """The seal of the secret in file ``path``; a ConfigError naming
    ``setting`` and the fix when the file is missing, short or open to
    others (whoever reads the secret can forge records)."""
    make = (
        f"make one with `head -c {MIN_SECRET_BYTES} /dev/urandom > {path} && "
        f"chmod 0400 {path}`, the same file on every host"
    )
    try:
        with open(path, "rb") as file:
            info = os.fstat(file.fileno())
            secret = file.read(MAX_SECRET_BYTES + 1)
    except OSError as exc:
        raise ConfigError(
            f"{setting}: cannot read {path}: {exc.strerror}; {make}"
        ) from None
    if not stat.S_ISREG(info.st_mode) or len(secret) > MAX_SECRET_BYTES:
        raise ConfigError(f"{setting}: {path} is not a secret file; {make}")
    if len(secret) < MIN_SECRET_BYTES:
        raise ConfigError(
            f"{setting}: {path} holds {len(secret)} bytes, fewer than "
            f"{MIN_SECRET_BYTES}; {make}"
        )
    if info.st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise ConfigError(
            f"{setting}: {path} is open to other users "
            f"(mode {stat.S_IMODE(info.st_mode):04o}): whoever reads it can forge "
            f"records; `chmod 0400 {path}`"
        )
    return RecordSeal(secret)
