"""Reading a Produce v3-v13 request in one pass, without copying its records.

Contract: :func:`read_produce_request` walks the body of a Produce request (Kafka's
``ProduceRequest.json``: transactional_id, acks, timeout, then topics, each with its
partitions, each with its ``records``; tagged fields after every struct on the
flexible versions, v9+) and returns a :class:`ProduceLayout`: the fields the proxy
acts on (transactional id, acks, each topic's name or id, each partition's index) and
where every topic entry, partition entry and ``records`` field lies in the frame. The
records stay in the frame: a partition's records are ``frame[data_start:data_end]``,
decoded in place. The same layout tells :mod:`~kiproxy.protocol.produce_splice` where
to cut.

What does not parse raises :class:`~kiproxy.protocol.errors.MalformedMessage` naming
the field and the byte: a length running past the frame, a null or negative array, a
null topic name, a name or transactional id that is not UTF-8, bytes left after the
body. Nothing is read past the frame. Tagged fields are skipped, as Kafka's own
parser skips tags it does not know (a Produce request defines none).

The body clients send (no tagged field, every length in bounds, names UTF-8) is read
by compiled code (``protocol/_produce.pxi``) into the same values; any other body is
read by the Python reader here, which names what is wrong.
"""

from __future__ import annotations

import struct
import uuid
from typing import Any, NamedTuple

from kiproxy.protocol._codec import read_produce_layout
from kiproxy.protocol.errors import MalformedFrame, MalformedMessage, ProtocolError
from kiproxy.protocol.wire import BadVarint, read_records_field, read_uvarint, short_read

__all__ = ["PartitionSpan", "ProduceLayout", "TopicSpan", "read_acks", "read_produce_request",
           "topic_key", "topic_key_field"]

FIRST_FLEXIBLE_VERSION = 9
"""Produce v9 is the first version with compact lengths and tagged fields."""
FIRST_TOPIC_ID_VERSION = 13
"""Produce v13 names topics by a 16-byte id instead of a string."""

_INT16 = struct.Struct(">h")
_INT32 = struct.Struct(">i")
_ACKS_TIMEOUT = struct.Struct(">hi")
_ZERO_ID = bytes(16)


class PartitionSpan(NamedTuple):
    """One partition entry: its index and where it lies in the frame (absolute positions)."""

    partition: int
    """The partition index."""
    start: int
    """The partition entry's first byte (its index)."""
    records_at: int
    """The first byte of the ``records`` length prefix."""
    data_start: int
    """The first byte of the records themselves."""
    data_end: int
    """One past the records' last byte (``data_start`` for null or empty records)."""
    end: int
    """One past the entry's last byte (after its tagged fields on v9+)."""


class TopicSpan(NamedTuple):
    """One topic entry: its name (v3-v12) or id (v13) and where it lies in the frame."""

    name: str | None
    """The topic name; None on v13, which names the topic by ``topic_id``."""
    topic_id: uuid.UUID | None
    """The topic id on v13 (None for the all-zero id); None before."""
    start: int
    """The topic entry's first byte (its name or id)."""
    count_at: int
    """The first byte of the partition array's length."""
    partitions: tuple[PartitionSpan, ...]
    """Each partition entry, in request order."""
    end: int
    """One past the entry's last byte (after its tagged fields on v9+)."""


class ProduceLayout(NamedTuple):
    """A Produce request's fields the proxy acts on, and where its entries lie."""

    transactional_id: str | None
    """The transactional id, for transactional producers."""
    acks: int
    """0, 1 or -1 (all)."""
    timeout_ms: int
    """The broker's wait for acknowledgements."""
    count_at: int
    """The first byte of the topic array's length (after acks and timeout)."""
    topics: tuple[TopicSpan, ...]
    """Each topic entry, in request order."""
    end: int
    """One past the request body's last byte (after its tagged fields on v9+)."""


def topic_key_field(version: int) -> str:
    """The field a Produce request or response ``version`` names its topics by: ``topic_id``
    from v13 (:data:`FIRST_TOPIC_ID_VERSION`), ``name`` before."""
    return "topic_id" if version >= FIRST_TOPIC_ID_VERSION else "name"


def topic_key(topic: Any, version: int) -> Any:
    """How a Produce ``version`` request or response topic entry (a :class:`TopicSpan` or a
    decoded response topic) names its topic: its id from v13, its name before."""
    return getattr(topic, topic_key_field(version))


def read_acks(frame: bytes, body_offset: int, flexible: bool) -> int:
    """acks of a Produce v3+ request without parsing the rest of it.

    Only the transactional_id before acks is skipped; a body cut short raises
    :class:`ProtocolError` (the client is closed with one log line).
    """
    pos = body_offset
    if flexible:
        n, pos = read_uvarint(frame, pos, len(frame),
                              "Produce request transactional_id length", MalformedFrame)
        pos += max(n - 1, 0)
    else:
        size = int.from_bytes(frame[pos : pos + 2], "big", signed=True)
        pos += 2 + max(size, 0)
    if pos + 2 > len(frame):
        raise ProtocolError(f"Produce request truncated before acks (byte {pos})")
    return int.from_bytes(frame[pos : pos + 2], "big", signed=True)


def _short(version: int, what: str, pos: int, end: int) -> MalformedMessage:
    return short_read(f"Produce request v{version}", what, pos, end)


def _tagged_fields(data: bytes, pos: int, end: int, version: int) -> int:
    count, pos = read_uvarint(data, pos, end, "tagged field count", BadVarint)
    for _ in range(count):
        _, pos = read_uvarint(data, pos, end, "tagged field tag", BadVarint)
        size, pos = read_uvarint(data, pos, end, "tagged field size", BadVarint)
        if pos + size > end:
            raise _short(version, "tagged field", pos, end)
        pos += size
    return pos


def _string(data: bytes, pos: int, end: int, version: int,
            what: str) -> tuple[str | None, int]:
    """A (compact, from v9) nullable string: its text, or None for null."""
    flexible = version >= FIRST_FLEXIBLE_VERSION
    if flexible:
        size, pos = read_uvarint(data, pos, end, f"{what} length", BadVarint)
        size -= 1
    else:
        if pos + 2 > end:
            raise _short(version, f"{what} length", pos, end)
        (size,) = _INT16.unpack_from(data, pos)
        pos += 2
    if size == -1:
        return None, pos
    if size < -1:
        raise MalformedMessage(f"Produce request v{version} does not parse: {what} length "
                               f"{size} at byte {pos - 2} is negative")
    if pos + size > end:
        raise _short(version, what, pos, end)
    try:
        return data[pos:pos + size].decode(), pos + size
    except UnicodeDecodeError:
        raise MalformedMessage(f"Produce request v{version} does not parse: {what} at byte "
                               f"{pos} is not UTF-8") from None


def _array_length(data: bytes, pos: int, end: int, version: int,
                  what: str) -> tuple[int, int]:
    """An array's (compact, from v9) length; a null or negative one does not parse."""
    flexible = version >= FIRST_FLEXIBLE_VERSION
    at = pos
    if flexible:
        n, pos = read_uvarint(data, pos, end, what, BadVarint)
        n -= 1
    else:
        if pos + 4 > end:
            raise _short(version, what, pos, end)
        (n,) = _INT32.unpack_from(data, pos)
        pos += 4
    if n < 0:
        raise MalformedMessage(f"Produce request v{version} does not parse: {what} is null "
                               f"or negative at byte {at}")
    return n, pos


def read_produce_request(frame: bytes, body_offset: int, version: int) -> ProduceLayout:
    """The fields and layout of the Produce v3+ body at ``frame[body_offset:]``.

    Raises :class:`MalformedMessage` for a body that does not parse (see the module
    contract), including one followed by bytes it does not account for.
    """
    # The common body (no tagged field, every name UTF-8) is read by compiled code into
    # the same values; anything else is read here, which names what is wrong.
    layout = read_produce_layout(frame, body_offset, version, ProduceLayout, TopicSpan,
                                 PartitionSpan, uuid.UUID)
    if layout is not None:
        return layout
    return _read_general(frame, body_offset, version)


def _read_general(frame: bytes, body_offset: int, version: int) -> ProduceLayout:
    """read_produce_request in Python: every body, and the error of one that does not parse."""
    try:
        return _read(frame, body_offset, version)
    except BadVarint as exc:
        raise MalformedMessage(f"Produce request v{version} does not parse: {exc}") from None


def _read(frame: bytes, body_offset: int, version: int) -> ProduceLayout:
    context = f"Produce request v{version}"
    flexible = version >= FIRST_FLEXIBLE_VERSION
    by_id = version >= FIRST_TOPIC_ID_VERSION
    data = frame
    end = len(data)
    transactional_id, pos = _string(data, body_offset, end, version,
                                    "transactional_id")
    if pos + 6 > end:
        raise _short(version, "acks and timeout", pos, end)
    acks, timeout_ms = _ACKS_TIMEOUT.unpack_from(data, pos)
    pos += 6
    count_at = pos
    n_topics, pos = _array_length(data, pos, end, version, "topic count")
    topics = []
    for _ in range(n_topics):
        start = pos
        name: str | None = None
        topic_id: uuid.UUID | None = None
        if by_id:
            if pos + 16 > end:
                raise _short(version, "topic_id", pos, end)
            raw_id = data[pos:pos + 16]
            pos += 16
            # The all-zero id is Kafka's "no id"; kio reads it as None, and so do answers.
            topic_id = uuid.UUID(bytes=raw_id) if raw_id != _ZERO_ID else None
        else:
            name, pos = _string(data, pos, end, version, "topic name")
            if name is None:
                raise MalformedMessage(f"Produce request v{version} does not parse: a null "
                                       f"topic name at byte {start}")
        part_count_at = pos
        n_parts, pos = _array_length(data, pos, end, version, "partition count")
        partitions = []
        for _ in range(n_parts):
            part_start = pos
            if pos + 4 > end:
                raise _short(version, "partition index", pos, end)
            (index,) = _INT32.unpack_from(data, pos)
            records_at = pos = pos + 4
            _, data_start, pos = read_records_field(data, pos, end, flexible, context)
            data_end = pos
            if flexible:
                pos = _tagged_fields(data, pos, end, version)
            partitions.append(PartitionSpan(index, part_start, records_at, data_start,
                                            data_end, pos))
        if flexible:
            pos = _tagged_fields(data, pos, end, version)
        topics.append(TopicSpan(name, topic_id, start, part_count_at, tuple(partitions), pos))
    if flexible:
        pos = _tagged_fields(data, pos, end, version)
    if pos != end:
        raise MalformedMessage(f"Produce request v{version}: {end - pos} unread bytes after "
                               f"the body (byte {pos})")
    return ProduceLayout(transactional_id, acks, timeout_ms, count_at, tuple(topics), pos)
