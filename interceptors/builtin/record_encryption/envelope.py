"""The envelope: how an encrypted record is laid out, sealed and opened (no I/O).

Contract. An encrypted record is the original record with

* a **marker header** ``kiproxy.encryption`` whose value is the *descriptor* (below):
  the format version, the KEK that wrapped the data key, the wrapped data key itself,
  whether the value is sealed and the names of the sealed headers;
* its **value** replaced by a *sealed field* (unless it was null: a tombstone stays a
  tombstone, and the descriptor says so);
* the value of each **chosen header** (when not null) replaced by a sealed field.

Key, timestamp, offset delta and every other header are left as they were. Byte layout
(integers big-endian)::

    descriptor (value of the kiproxy.encryption header)
      0     u8     format version: 1
      1     u8     flags: bit 0 set = the value is sealed (clear = the value is null)
      2     u16    n, then n bytes: the KEK id, UTF-8 (an AWS key ARN, a key file's name)
      ..    u16    m, then m bytes: the wrapped data key, as the KMS returned it
      ..    u8     h, then h times: u16 length + UTF-8 name of a sealed header
      (at most 8 KiB in all)

    sealed field (the value, a sealed header's value)
      0     12     nonce, random per field
      12    ..     AES-256-GCM ciphertext of the original bytes
      -16   16     GCM tag

    associated data of a sealed field
      b"kiproxy.encryption\\x00" u16+topic  u8 kind (0 value, 1 header)
      u16+header name (empty for the value)  u16 occurrence of that name
      the whole descriptor

The associated data binds each field to its topic (a value copied to another topic
does not open), to its place (a header value does not open as the value or as
another header) and to the descriptor (the KEK id, the wrapped key and the list of
sealed fields cannot be swapped or trimmed). The record key is not bound: a tool
that rewrites keys does not break decryption, and a value moved to another record of
the same topic still opens.

Why a marker header rather than a magic byte in the value: a plaintext value can start
with any byte, so only a header tells plaintext from ciphertext with certainty - a
record without it passes :func:`open_record` unchanged, whatever its value is; the
header carries the wrapped key once per record however many fields are sealed, and
also for a tombstone whose headers are sealed; and a consumer or tool reading the
topic directly sees which records are encrypted, and under which KEK, without
parsing values. Why the whole wrapped key in every record rather than a reference to
one stored elsewhere: a record stays decryptable alone after compaction removes its
neighbours, a consumer seeks into the middle of a batch or a mirror copies it record
by record; the repeated bytes cost little once the batch is compressed.

A record that carries the marker header but does not open (unknown version, cut or
changed bytes, another topic, a value where the descriptor says null) is an
:class:`EnvelopeError`, never passed on as it is. :func:`seal_record` refuses a
record that already carries the marker header, so a producer cannot pass plaintext
off as sealed.
"""

from __future__ import annotations

import functools
import os
import struct
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from cryptography.exceptions import InvalidTag

from kiproxy.interceptors import Header, Record
from kiproxy.interceptors.sealing import (
    Aead,
    open_block,
    open_blocks,
    open_values,
    seal_values,
)

__all__ = [
    "FORMAT_VERSION",
    "MARKER_HEADER",
    "Descriptor",
    "EnvelopeError",
    "open_record",
    "open_value",
    "opens_by_value",
    "read_descriptor",
    "seal_record",
    "sealed_fields",
    "value_aad",
    "value_sealer",
]

MARKER_HEADER = "kiproxy.encryption"
FORMAT_VERSION = 1
NONCE_BYTES = 12
TAG_BYTES = 16
MAX_DESCRIPTOR_BYTES = 8192
"""A longer marker is refused (a KMS ciphertext blob is at most 6 KiB), which also
bounds the memory of the parsed descriptors kept."""
_VALUE_SEALED = 0x01
_U16 = struct.Struct(">H")
_AAD_PREFIX = MARKER_HEADER.encode() + b"\x00"
_KIND_VALUE = b"\x00"
_KIND_HEADER = b"\x01"


class EnvelopeError(Exception):
    """A record marked encrypted that does not open: the message names the topic and
    field; the record was changed, moved from another topic, or cut."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Descriptor:
    """The parsed marker header of a sealed record."""

    key_id: str
    """The KEK that wrapped the data key."""
    wrapped_key: bytes
    """The data key, wrapped."""
    value_sealed: bool
    """False when the value was null (a tombstone)."""
    headers: tuple[str, ...]
    """The names of the sealed headers."""


def sealed_fields(record: Record, header_names: Collection[str]) -> int:
    """How many fields :func:`seal_record` will seal in ``record`` (data key uses)."""
    count = int(record.value is not None)
    if header_names:
        count += sum(1 for h in record.headers if h.key in header_names and h.value is not None)
    return count


@functools.lru_cache(maxsize=256)  # the same few per data key: built once
def _pack_descriptor(key_id: str, wrapped_key: bytes, value_sealed: bool,
                     headers: tuple[str, ...]) -> bytes:
    kid = key_id.encode()
    parts = [bytes((FORMAT_VERSION, _VALUE_SEALED if value_sealed else 0)),
             _U16.pack(len(kid)), kid, _U16.pack(len(wrapped_key)), wrapped_key,
             bytes((len(headers),))]
    for name in headers:
        raw = name.encode()
        parts += (_U16.pack(len(raw)), raw)
    return b"".join(parts)


@functools.lru_cache(maxsize=256)  # the same few per data key: built once
def _aad(topic: bytes, kind: bytes, name: bytes, occurrence: int, descriptor: bytes) -> bytes:
    return b"".join((_AAD_PREFIX, _U16.pack(len(topic)), topic, kind, _U16.pack(len(name)),
                     name, _U16.pack(occurrence), descriptor))


def seal_record(record: Record, *, topic: str, aead: Aead, key_id: str, wrapped_key: bytes,
                header_names: Collection[str] = ()) -> Record:
    """``record`` with its value and the non-null values of the headers named in
    ``header_names`` sealed under ``aead`` (the data key whose wrapped form is
    ``wrapped_key``, under KEK ``key_id``), and the marker header added last."""
    if any(h.key == MARKER_HEADER for h in record.headers):
        raise EnvelopeError(f"topic {topic!r}: a record already carries the {MARKER_HEADER} "
                            "header; it is not encrypted again (remove the header, or "
                            "produce the plaintext)")
    value = record.value
    present = tuple(dict.fromkeys(
        h.key for h in record.headers if h.key in header_names and h.value is not None))
    if len(present) > 255:
        raise EnvelopeError(f"topic {topic!r}: at most 255 distinct header names are "
                            f"sealed per record, not {len(present)}")
    descriptor = _pack_descriptor(key_id, wrapped_key, value is not None, present)
    if len(descriptor) > MAX_DESCRIPTOR_BYTES:
        raise EnvelopeError(f"topic {topic!r}: the {MARKER_HEADER} header would be "
                            f"{len(descriptor)} bytes, over {MAX_DESCRIPTOR_BYTES} (seal "
                            "fewer header names)")
    tb = topic.encode()
    if value is not None:
        nonce = os.urandom(NONCE_BYTES)
        value = nonce + aead.encrypt(nonce, value, _aad(tb, _KIND_VALUE, b"", 0, descriptor))
    headers = list(record.headers)
    if present:
        seen: dict[str, int] = {}
        for i, header in enumerate(headers):
            if header.key in present and header.value is not None:
                occurrence = seen[header.key] = seen.get(header.key, -1) + 1
                nonce = os.urandom(NONCE_BYTES)
                aad = _aad(tb, _KIND_HEADER, header.key.encode(), occurrence, descriptor)
                headers[i] = Header(header.key, nonce + aead.encrypt(nonce, header.value, aad))
    headers.append(Header(MARKER_HEADER, descriptor))
    return Record(key=record.key, value=value, headers=headers, timestamp=record.timestamp,
                  offset_delta=record.offset_delta)


def value_sealer(*, topic: str, aead: Aead, key_id: str, wrapped_key: bytes
                 ) -> Callable[[Sequence[Record]], tuple[Record, ...]]:
    """:func:`seal_record` with no header to seal, over a run of records (the caller
    checked: no marker header): the descriptor and its associated data built once, and
    the per-record loop compiled (:func:`~kiproxy.protocol.records.seal_values`, with
    ``cryptography``'s AES-GCM as the cipher). A record with a null value is kept."""
    descriptor = _pack_descriptor(key_id, wrapped_key, True, ())
    if len(descriptor) > MAX_DESCRIPTOR_BYTES:
        raise EnvelopeError(f"topic {topic!r}: the {MARKER_HEADER} header would be "
                            f"{len(descriptor)} bytes, over {MAX_DESCRIPTOR_BYTES}")
    marker = Header(MARKER_HEADER, descriptor)
    aad = _aad(topic.encode(), _KIND_VALUE, b"", 0, descriptor)
    encrypt = aead.encrypt

    def seal(records: Sequence[Record]) -> tuple[Record, ...]:
        run = tuple(records)
        return seal_values(run, encrypt, aad, marker, os.urandom(NONCE_BYTES * len(run)),
                           NONCE_BYTES)

    return seal


def read_descriptor(record: Record, *, topic: str) -> tuple[Descriptor, bytes] | None:
    """The descriptor of a sealed record and its bytes, or None for a plaintext record
    (no marker header). Raises :class:`EnvelopeError` for a marker that does not parse."""
    raw = None
    for header in record.headers:
        if header.key == MARKER_HEADER:
            if raw is not None:
                raise EnvelopeError(f"topic {topic!r}: a record carries the {MARKER_HEADER} "
                                    "header twice")
            raw = header.value
            if raw is None:
                raise EnvelopeError(f"topic {topic!r}: the {MARKER_HEADER} header is null")
    if raw is None:
        return None
    return descriptor_of(raw, topic=topic), raw


def descriptor_of(raw: bytes, *, topic: str) -> Descriptor:
    """The descriptor a marker header's value ``raw`` holds. Raises :class:`EnvelopeError`
    for one that does not parse."""
    if len(raw) > MAX_DESCRIPTOR_BYTES:
        raise EnvelopeError(f"topic {topic!r}: the {MARKER_HEADER} header is {len(raw)} "
                            f"bytes, over {MAX_DESCRIPTOR_BYTES}")
    return _parse_descriptor(raw, topic)


@functools.lru_cache(maxsize=256)  # the same few per data key: built once
def _parse_descriptor(raw: bytes, topic: str) -> Descriptor:
    where = f"topic {topic!r}: the {MARKER_HEADER} header"
    if not raw:
        raise EnvelopeError(f"{where} is empty: cut or damaged")
    if raw[0] != FORMAT_VERSION:
        newer = (", or the record was sealed by a newer kiproxy (upgrade to read it)"
                 if raw[0] > FORMAT_VERSION else "")
        raise EnvelopeError(f"{where} has format version {raw[0]}, which this kiproxy (format "
                            f"version {FORMAT_VERSION}) does not read: the header is "
                            f"damaged{newer}")
    try:
        flags = raw[1]
        (n,) = _U16.unpack_from(raw, 2)
        key_id = raw[4:4 + n].decode()
        pos = 4 + n
        (m,) = _U16.unpack_from(raw, pos)
        wrapped = raw[pos + 2:pos + 2 + m]
        pos += 2 + m
        count = raw[pos]
        pos += 1
        names = []
        for _ in range(count):
            (length,) = _U16.unpack_from(raw, pos)
            names.append(raw[pos + 2:pos + 2 + length].decode())
            pos += 2 + length
    except (IndexError, struct.error, UnicodeDecodeError):
        raise EnvelopeError(f"{where} is cut or damaged") from None
    if pos != len(raw) or len(key_id.encode()) != n or len(wrapped) != m or flags & ~1:
        raise EnvelopeError(f"{where} is cut or damaged")
    return Descriptor(key_id=key_id, wrapped_key=wrapped, value_sealed=bool(flags & 1),
                      headers=tuple(names))


def open_record(record: Record, *, topic: str, descriptor: Descriptor, raw_descriptor: bytes,
                aead: Aead) -> Record:
    """The original of a sealed ``record``: fields opened with ``aead`` (the data key
    ``descriptor`` names), the marker header removed. Raises :class:`EnvelopeError`."""
    tb = topic.encode()
    value = record.value
    if descriptor.value_sealed != (value is not None):
        raise EnvelopeError(f"topic {topic!r}: the record's value is "
                            f"{'null' if value is None else 'set'}, but its "
                            f"{MARKER_HEADER} header says otherwise")
    if value is not None:
        value = _open(aead, value, _aad(tb, _KIND_VALUE, b"", 0, raw_descriptor), topic, "value")
    headers: list[Header] = []
    seen: dict[str, int] = {}
    for header in record.headers:
        if header.key == MARKER_HEADER:
            continue
        if header.key in descriptor.headers and header.value is not None:
            occurrence = seen[header.key] = seen.get(header.key, -1) + 1
            aad = _aad(tb, _KIND_HEADER, header.key.encode(), occurrence, raw_descriptor)
            header = Header(header.key, _open(aead, header.value, aad, topic,
                                              f"header {header.key!r}"))
        headers.append(header)
    if any(name not in seen for name in descriptor.headers):
        missing = sorted(set(descriptor.headers) - set(seen))
        raise EnvelopeError(f"topic {topic!r}: sealed header(s) {missing} are missing")
    return Record(key=record.key, value=value, headers=headers, timestamp=record.timestamp,
                  offset_delta=record.offset_delta)


def opens_by_value(record: Record, descriptor: Descriptor) -> bool:
    """Whether ``record`` has the common shape :func:`open_value` opens: its value sealed,
    no header sealed, and the marker header last (as :func:`seal_record` leaves it)."""
    headers = record.headers
    return (descriptor.value_sealed and not descriptor.headers and record.value is not None
            and bool(headers) and headers[-1].key == MARKER_HEADER)


def value_aad(topic: str, raw_descriptor: bytes) -> bytes:
    """The associated data of the value of a record of ``topic`` with this descriptor."""
    return _aad(topic.encode(), _KIND_VALUE, b"", 0, raw_descriptor)


def open_values_fast(records: Sequence[Record], *, raw_descriptor: bytes, aad: bytes,
                     aead: Aead) -> tuple[Record, ...] | None:
    """Every record of ``records`` opened in one compiled loop
    (:func:`~kiproxy.protocol.records.open_values`) when each has the shape
    :func:`opens_by_value` accepts under this one descriptor and opens; else None (the
    caller's general path then names the record that does not)."""
    return open_values(tuple(records), MARKER_HEADER, raw_descriptor, aead.decrypt, aad,
                       NONCE_BYTES, TAG_BYTES)


def open_values_block(data: memoryview, count: int, *, raw_descriptor: bytes, aad: bytes,
                      aead: Aead) -> bytes | None:
    """:func:`open_values_fast` from records block to records block
    (:func:`~kiproxy.protocol.records.open_block`): the ``count`` records of ``data``
    opened without a record object each; None as it says (then records are read one by
    one)."""
    opened: bytes | None = open_block(data, count, MARKER_HEADER, raw_descriptor,
                                      aead.decrypt, aad, NONCE_BYTES)
    return opened


def open_values_blocks(blocks: Sequence[tuple[memoryview, int]], *, raw_descriptor: bytes,
                       aad: bytes, aead: Aead) -> list[bytes | None]:
    """:func:`open_values_block` of each ``(data, count)`` of ``blocks``, all sealed
    under this one descriptor, their cipher calls spread over threads
    (:func:`~kiproxy.interceptors.sealing.open_blocks`): each opened block, or None."""
    return open_blocks([data for data, _ in blocks], [count for _, count in blocks],
                       MARKER_HEADER, raw_descriptor, aead.decrypt, aad, NONCE_BYTES)


def open_value(record: Record, *, topic: str, aad: bytes, aead: Aead) -> Record:
    """:func:`open_record` of a record of the shape :func:`opens_by_value` accepts, given
    its value's associated data (:func:`value_aad`, the same for every record sealed
    with one descriptor): what a batch of one data key costs per record, once the
    descriptor and its associated data are found. Raises :class:`EnvelopeError`."""
    assert record.value is not None
    return Record(key=record.key, value=_open(aead, record.value, aad, topic, "value"),
                  headers=record.headers[:-1], timestamp=record.timestamp,
                  offset_delta=record.offset_delta)


def _open(aead: Aead, sealed: bytes, aad: bytes, topic: str, field: str) -> bytes:
    if len(sealed) < NONCE_BYTES + TAG_BYTES:
        raise EnvelopeError(f"topic {topic!r}: the sealed {field} is {len(sealed)} bytes, "
                            f"shorter than a nonce and a tag")
    try:
        return aead.decrypt(sealed[:NONCE_BYTES], sealed[NONCE_BYTES:], aad)
    except (InvalidTag, ValueError):  # AESGCM's, AesGcm's
        raise EnvelopeError(f"topic {topic!r}: the sealed {field} does not open: it was "
                            "changed, cut, or encrypted for another topic") from None
