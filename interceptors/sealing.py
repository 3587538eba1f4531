"""Compiled per-record loops for plugins that seal values with a cipher of their own.

Contract: :func:`seal_values` replaces every non-null value of a run of records by
``nonce + encrypt(nonce, value, aad)`` and appends one marker header; :func:`open_values`
undoes it for records that all carry the same marker, or answers None so that the
plugin's own general path can say which record is not of that shape or does not open;
:func:`carries_header` tells a batch with a marked record from one without, building
no header it does not need, and :func:`values_present` counts the values to seal.
For a fetch-side hook's records block (``on_consume_block``), :func:`open_block` is
:func:`open_values` from block to block, and :func:`block_header_value` and
:func:`block_carries_header` find the marker without a record object;
:func:`open_blocks` opens many blocks at once (``on_consume_blocks``: a fetched
partition's batches), its cipher calls spread over threads. :func:`decode_block` reads
a block's records and :func:`encode_block` writes changed ones back as a block, for a
block hook that changes a batch it does not seal. The block functions raise
:class:`CorruptBatch` for a block that is not well-formed records. The
nonces are the caller's, and so is the cipher: a callable (``encrypt``/``decrypt``,
e.g. ``cryptography``'s ``AESGCM``), called once per value, or what :func:`aes_gcm`
returns. These loops are the record codec's (:mod:`kiproxy.protocol.records`), offered
here so that plugins, built-in ones included, need only the plugin API.

:func:`aes_gcm` gives AES-GCM bound to the OpenSSL library the Python interpreter itself
loads for :mod:`hashlib` and :mod:`ssl` (an ``AesGcm``, whose ``encrypt``/``decrypt``
give the bytes ``AESGCM``'s do). Handed to the loops, it seals or opens a whole batch
without a Python call per record and without holding the GIL: a 1 KiB value costs
little more than the cipher. Where that library cannot be bound (an interpreter with
OpenSSL linked in statically, a platform other than Linux), :func:`aes_gcm`
returns ``cryptography``'s ``AESGCM`` instead - the same bytes, one call per value - and
:func:`compiled_gcm` says which one is in use.
"""

from __future__ import annotations

import functools
import logging
import sys
from collections.abc import Iterable
from typing import Protocol, cast

from kiproxy.interceptors.consume import ConsumedBlock
from kiproxy.protocol._codec import AesGcm, load_gcm, load_sodium, sodium_bound
from kiproxy.protocol.errors import CorruptBatch
from kiproxy.protocol.parallel import open_blocks
from kiproxy.protocol.records import (
    Record,
    block_carries_header,
    block_header_value,
    carries_header,
    decode_records,
    encode_records,
    open_block,
    open_values,
    seal_values,
    values_present,
)

log = logging.getLogger("kiproxy.sealing")

__all__ = ["Aead", "AesGcm", "CorruptBatch", "aes_gcm", "block_carries_header",
           "block_header_value", "carries_header", "compiled_gcm", "decode_block",
           "encode_block", "open_block", "open_blocks", "open_values", "seal_values",
           "sodium_gcm", "values_present"]


class Aead(Protocol):
    """What :func:`aes_gcm` returns. ``decrypt`` raises ``ValueError`` (``AesGcm``) or
    ``cryptography.exceptions.InvalidTag`` (``AESGCM``) for a field that does not open."""

    def encrypt(self, nonce: bytes, data: bytes, associated_data: bytes | None) -> bytes: ...

    def decrypt(self, nonce: bytes, data: bytes, associated_data: bytes | None) -> bytes: ...


def aes_gcm(key: bytes) -> Aead:
    """AES-GCM under ``key`` (16, 24 or 32 bytes) for :func:`seal_values` and
    :func:`open_values`: an ``AesGcm`` where OpenSSL could be bound, else ``AESGCM``."""
    if compiled_gcm() is not None:
        return cast(Aead, AesGcm(key))
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    return AESGCM(key)


# AES-256-GCM test case 16 of McGrew and Viega's GCM specification (also in NIST's
# GCM validation vectors): a library that does not give these bytes is not used.
_KAT = tuple(bytes.fromhex(h) for h in (
    "feffe9928665731c6d6a8f9467308308feffe9928665731c6d6a8f9467308308",
    "cafebabefacedbaddecaf888",
    "d9313225f88406e5a55909c5aff5269a86a7a9531534f7da2e4c303d8a318a721c3c0c95956809532f"
    "cf0e2449a6b525b16aedf5aa0de657ba637b39",
    "feedfacedeadbeeffeedfacedeadbeefabaddad2",
    "522dc1f099567d07f47f37a32a84427d643a8cdcbfe5c0c97598a2bd2555d1aa8cb08e48590dbb3d"
    "a7b08b1056828838c5f61e6393ba7a0abcc9f662" "76fc6ece0f4e1768cddf8853bb2d551b"))


@functools.cache
def compiled_gcm() -> str | None:
    """The libcrypto :class:`AesGcm` is bound to, or None when it could not be bound or
    did not give a known answer's bytes."""
    path = _libcrypto()
    if path is None:
        return None
    try:
        load_gcm(path)
        key, nonce, plain, aad, sealed = _KAT
        gcm = AesGcm(key)
        if gcm.encrypt(nonce, plain, aad) != sealed or gcm.decrypt(nonce, sealed, aad) != plain:
            return None
    except (OSError, RuntimeError, ValueError):
        return None
    _bind_sodium()
    return path


def decode_block(block: ConsumedBlock) -> tuple[Record, ...]:
    """The records of ``block`` (each read lazily from the block, offset deltas and
    timestamps as stored); ``CorruptBatch`` for a block that is not its records."""
    data = bytes(block.data)
    return decode_records(data, 0, len(data), block.record_count, block.base_timestamp)


def encode_block(block: ConsumedBlock, records: Iterable[Record]) -> bytes:
    """``records`` - ``block``'s own, changed: the same count, in order, offset deltas
    and timestamps kept - as the new records block a block hook returns for it."""
    block_bytes: bytes = encode_records(tuple(records), block.base_timestamp, False)[0]
    return block_bytes


def sodium_gcm() -> str | None:
    """The libsodium whose AES-256-GCM :class:`AesGcm` uses for 256-bit keys with 12-byte
    nonces, or None (OpenSSL then serves those too)."""
    return _sodium_path if compiled_gcm() is not None and sodium_bound() else None


_sodium_path: str | None = None


def _bind_sodium() -> None:
    """Bind libsodium's AES-256-GCM from PyNaCl's own library, when PyNaCl is installed,
    this CPU runs it and it gives the known answer's bytes (every :class:`AesGcm` made
    after this uses it); else leave OpenSSL to serve every key."""
    global _sodium_path
    try:
        import nacl._sodium
    except ImportError:
        return
    try:
        load_sodium(str(nacl._sodium.__file__), _KAT)
    except (OSError, ValueError) as exc:
        log.debug("AES-256-GCM through OpenSSL only: %s", exc)
        return
    _sodium_path = str(nacl._sodium.__file__)


def _libcrypto() -> str | None:
    """The libcrypto that Python's own ``_hashlib`` loaded into this process (so no
    second OpenSSL is read from disk), on Linux; None elsewhere, or for an interpreter
    whose OpenSSL is linked in statically. (Other platforms are left to
    ``cryptography``: macOS, for one, ends a process that loads its system libcrypto
    by an unversioned name.)"""
    if not sys.platform.startswith("linux"):
        return None
    try:
        import _hashlib  # noqa: F401  (loads libcrypto into this process)
    except ImportError:
        return None
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                fields = line.split()
                if len(fields) >= 6 and "/libcrypto" in fields[5]:
                    return fields[5]
    except OSError:
        pass
    return None
