"""Reading a Fetch v4-v18 response in one pass, without decoding its records.

Contract: :func:`read_fetch_response` walks the body of a Fetch response (Kafka's
``FetchResponse.json``: throttle time, error code and session id, then topics, each
with its partitions; tagged fields after every struct on the flexible versions, v12+)
and returns a :class:`FetchLayout`: every field a consumer-side hook acts on, read as
values - each topic's name (v4-v12) or id (v13+), each partition's index, error code,
high watermark, last stable offset, log start offset (v5+), aborted transactions and
preferred read replica (v11+) - and where every topic entry, partition entry,
``records`` field and tagged-field section lies in the frame (absolute positions).

What is never decoded: the ``records`` bytes (a partition's records are
``frame[data_start:data_end]``; :mod:`~kiproxy.protocol.fetch_batches` splits them
into batches, still without decoding a record) and the tagged fields (a partition's
``diverging_epoch`` (tag 0), ``current_leader`` (1) and ``snapshot_id`` (2), and the
response's ``node_endpoints`` (tag 0, v16+)), whose tags and spans are kept so that
they are copied as they came. :mod:`~kiproxy.protocol.fetch_splice` cuts the frame
where this layout says.

What does not parse raises :class:`~kiproxy.protocol.errors.MalformedMessage` naming
the field and the byte: a length running past the frame, a null or negative array
where the schema has none, a null topic name, a name that is not UTF-8, bytes left
after the body. Nothing is read past the frame and nothing is allocated from a length
before that length is checked against the bytes that remain.

Why not kio: its reader (which :mod:`~kiproxy.protocol.messages` uses for the messages
the proxy rewrites) builds every field, copies every ``records`` field and reports no
positions, and a splice needs positions. This reader follows ``FetchResponse.json``
field by field instead; the tests check it against kio's serializer on every version.
"""

from __future__ import annotations

import struct
import uuid
from typing import NamedTuple

from kiproxy.protocol.errors import MalformedMessage
from kiproxy.protocol.wire import BadVarint, read_records_field, read_uvarint, short_read

__all__ = [
    "FIRST_FLEXIBLE_VERSION",
    "FIRST_TOPIC_ID_VERSION",
    "AbortedTransaction",
    "FetchLayout",
    "FetchPartition",
    "FetchTopic",
    "TaggedField",
    "read_fetch_response",
]

OLDEST_VERSION = 4
"""Fetch v4 (transactional consumption) is the oldest version read here (and Kafka 4's)."""
LATEST_VERSION = 18
"""The newest Fetch response version this reader knows (its layout is v16's)."""
FIRST_FLEXIBLE_VERSION = 12
"""Fetch v12 is the first version with compact lengths and tagged fields."""
FIRST_TOPIC_ID_VERSION = 13
"""Fetch v13 names topics by a 16-byte id instead of a string."""
_FIRST_LOG_START_VERSION = 5
_FIRST_SESSION_VERSION = 7
_FIRST_READ_REPLICA_VERSION = 11

_INT32 = struct.Struct(">i")
_INT16 = struct.Struct(">h")
_SESSION = struct.Struct(">ihi")  # throttle_time_ms, error_code, session_id (v7+)
_PARTITION_V4 = struct.Struct(">ihqq")  # index, error, high watermark, last stable offset
_PARTITION_V5 = struct.Struct(">ihqqq")  # ... and log start offset
_ABORTED = struct.Struct(">qq")
_ZERO_ID = bytes(16)
_NO_TAGS: tuple[TaggedField, ...] = ()


class TaggedField(NamedTuple):
    """One tagged field, kept undecoded: its tag and where its value lies."""

    tag: int
    """The field's tag (a partition's 0 diverging_epoch, 1 current_leader, 2 snapshot_id;
    the response's 0 node_endpoints)."""
    start: int
    """The value's first byte (after its tag and size varints)."""
    end: int
    """One past the value's last byte."""


class AbortedTransaction(NamedTuple):
    """A transaction aborted within the fetched range (read_committed consumers drop its
    records)."""

    producer_id: int
    """The producer id of the aborted transaction."""
    first_offset: int
    """The first offset in the aborted transaction."""


class FetchPartition(NamedTuple):
    """One partition entry: its fields and where it lies in the frame (absolute positions)."""

    partition: int
    """The partition index."""
    error_code: int
    """The error code, or 0."""
    high_watermark: int
    """The high watermark."""
    last_stable_offset: int
    """The last stable offset (-1 when the broker does not know it)."""
    log_start_offset: int
    """The log start offset (v5+; -1 before)."""
    aborted_transactions: tuple[AbortedTransaction, ...] | None
    """The aborted transactions (None when the field is null)."""
    preferred_read_replica: int
    """The replica to fetch from next (v11+; -1 for none and before v11)."""
    start: int
    """The partition entry's first byte (its index)."""
    records_at: int
    """The first byte of the ``records`` length prefix."""
    data_start: int
    """The first byte of the records themselves."""
    data_end: int
    """One past the records' last byte (``data_start`` for null or empty records)."""
    records_null: bool
    """Whether ``records`` is null (as opposed to empty)."""
    tagged: tuple[TaggedField, ...]
    """The entry's tagged fields (v12+), undecoded."""
    end: int
    """One past the entry's last byte (after its tagged fields on v12+)."""


class FetchTopic(NamedTuple):
    """One topic entry: its name (v4-v12) or id (v13+) and its partitions."""

    name: str | None
    """The topic name; None on v13+, which names the topic by ``topic_id``."""
    topic_id: uuid.UUID | None
    """The topic id on v13+ (None for the all-zero id); None before."""
    start: int
    """The topic entry's first byte (its name or id)."""
    partitions: tuple[FetchPartition, ...]
    """Each partition entry, in response order."""
    end: int
    """One past the entry's last byte (after its tagged fields on v12+)."""


class FetchLayout(NamedTuple):
    """A Fetch response's fields and where its entries lie."""

    version: int
    """The response version the layout was read at."""
    throttle_time_ms: int
    """The time the broker throttled the request for."""
    error_code: int
    """The top-level error code (v7+; 0 before)."""
    session_id: int
    """The fetch session id (v7+; 0 before and outside a session)."""
    topics: tuple[FetchTopic, ...]
    """Each topic entry, in response order."""
    tagged_at: int
    """The first byte of the top-level tagged fields (``end`` before v12)."""
    tagged: tuple[TaggedField, ...]
    """The top-level tagged fields (v12+; ``node_endpoints`` is tag 0 from v16), undecoded."""
    end: int
    """One past the body's last byte (the end of the frame)."""


def _short(version: int, what: str, pos: int, end: int) -> MalformedMessage:
    return short_read(f"Fetch response v{version}", what, pos, end)


def _tagged_fields(data: bytes | bytearray, pos: int, end: int, version: int
                   ) -> tuple[tuple[TaggedField, ...], int]:
    if pos < end and data[pos] == 0:  # no tagged fields: the common case
        return _NO_TAGS, pos + 1
    count, pos = read_uvarint(data, pos, end, "tagged field count", BadVarint)
    fields = []
    for _ in range(count):  # each field takes 2+ bytes: a lying count runs out of frame
        tag, pos = read_uvarint(data, pos, end, "tagged field tag", BadVarint)
        size, pos = read_uvarint(data, pos, end, "tagged field size", BadVarint)
        if pos + size > end:
            raise _short(version, f"tagged field {tag}", pos, end)
        fields.append(TaggedField(tag, pos, pos + size))
        pos += size
    return tuple(fields), pos


def _array_length(data: bytes | bytearray, pos: int, end: int, version: int, flexible: bool,
                  what: str) -> tuple[int, int]:
    """An array's length (-1 for null) and the position after it."""
    if flexible:
        n, pos = read_uvarint(data, pos, end, what, BadVarint)
        return n - 1, pos
    if pos + 4 > end:
        raise _short(version, what, pos, end)
    (n,) = _INT32.unpack_from(data, pos)
    if n < -1:
        raise MalformedMessage(f"Fetch response v{version} does not parse: {what} {n} at "
                               f"byte {pos} is negative")
    return n, pos + 4


def _topic_name(data: bytes | bytearray, pos: int, end: int, version: int, flexible: bool
                ) -> tuple[str, int]:
    start = pos
    if flexible:
        size, pos = read_uvarint(data, pos, end, "topic name length", BadVarint)
        size -= 1
    else:
        if pos + 2 > end:
            raise _short(version, "topic name length", pos, end)
        (size,) = _INT16.unpack_from(data, pos)
        pos += 2
    if size < 0:
        raise MalformedMessage(f"Fetch response v{version} does not parse: a null or "
                               f"negative topic name length at byte {start}")
    if pos + size > end:
        raise _short(version, "topic name", pos, end)
    try:
        return data[pos:pos + size].decode(), pos + size
    except UnicodeDecodeError:
        raise MalformedMessage(f"Fetch response v{version} does not parse: topic name at "
                               f"byte {pos} is not UTF-8") from None


def read_fetch_response(frame: bytes | bytearray, body_offset: int, version: int
                        ) -> FetchLayout:
    """The fields and layout of the Fetch v4-v18 body at ``frame[body_offset:]``.

    ``frame`` is the response without its length prefix (as the frame assembler hands
    it); ``body_offset`` is where the body starts after the response header. Raises
    :class:`MalformedMessage` for a body that does not parse (see the module contract),
    including one followed by bytes it does not account for, and for a version outside
    v4-v18.
    """
    if not OLDEST_VERSION <= version <= LATEST_VERSION:
        raise MalformedMessage(f"Fetch response v{version}: only v{OLDEST_VERSION}-"
                               f"v{LATEST_VERSION} are read")
    try:
        return _read(frame, body_offset, version)
    except BadVarint as exc:
        raise MalformedMessage(f"Fetch response v{version} does not parse: {exc}") from None


def _read(data: bytes | bytearray, pos: int, version: int) -> FetchLayout:
    context = f"Fetch response v{version}"
    flexible = version >= FIRST_FLEXIBLE_VERSION
    by_id = version >= FIRST_TOPIC_ID_VERSION
    end = len(data)
    if version >= _FIRST_SESSION_VERSION:
        if pos + 10 > end:
            raise _short(version, "throttle_time_ms, error_code and session_id", pos, end)
        throttle, top_error, session_id = _SESSION.unpack_from(data, pos)
        pos += 10
    else:
        if pos + 4 > end:
            raise _short(version, "throttle_time_ms", pos, end)
        (throttle,) = _INT32.unpack_from(data, pos)
        top_error = session_id = 0
        pos += 4
    fixed = _PARTITION_V5 if version >= _FIRST_LOG_START_VERSION else _PARTITION_V4
    fixed_size = fixed.size
    read_replica = version >= _FIRST_READ_REPLICA_VERSION
    n_topics, pos = _array_length(data, pos, end, version, flexible, "topic count")
    if n_topics < 0:
        raise MalformedMessage(f"Fetch response v{version} does not parse: a null topic "
                               f"array before byte {pos}")
    topics = []
    for _ in range(n_topics):  # each entry takes bytes: a lying count runs out of frame
        start = pos
        name: str | None = None
        topic_id: uuid.UUID | None = None
        if by_id:
            if pos + 16 > end:
                raise _short(version, "topic_id", pos, end)
            raw_id = bytes(data[pos:pos + 16])
            pos += 16
            # The all-zero id is Kafka's "no id"; kio reads it as None.
            topic_id = uuid.UUID(bytes=raw_id) if raw_id != _ZERO_ID else None
        else:
            name, pos = _topic_name(data, pos, end, version, flexible)
        n_parts, pos = _array_length(data, pos, end, version, flexible, "partition count")
        if n_parts < 0:
            raise MalformedMessage(f"Fetch response v{version} does not parse: a null "
                                   f"partition array before byte {pos}")
        partitions = []
        for _ in range(n_parts):
            part_start = pos
            if pos + fixed_size > end:
                raise _short(version, "partition fields", pos, end)
            if fixed_size == 30:
                index, error, hwm, lso, log_start = _PARTITION_V5.unpack_from(data, pos)
            else:
                index, error, hwm, lso = _PARTITION_V4.unpack_from(data, pos)
                log_start = -1
            pos += fixed_size
            n_aborted, pos = _array_length(data, pos, end, version, flexible,
                                           "aborted transaction count")
            aborted: tuple[AbortedTransaction, ...] | None = None
            if n_aborted >= 0:
                step = 17 if flexible else 16  # flexible entries end in a tagged section
                if pos + n_aborted * step > end:
                    raise _short(version, f"{n_aborted} aborted transactions", pos, end)
                items = []
                for _ in range(n_aborted):
                    if pos + 16 > end:
                        raise _short(version, "aborted transaction", pos, end)
                    producer_id, first_offset = _ABORTED.unpack_from(data, pos)
                    pos += 16
                    if flexible:
                        _, pos = _tagged_fields(data, pos, end, version)
                    items.append(AbortedTransaction(producer_id, first_offset))
                aborted = tuple(items)
            replica = -1
            if read_replica:
                if pos + 4 > end:
                    raise _short(version, "preferred_read_replica", pos, end)
                (replica,) = _INT32.unpack_from(data, pos)
                pos += 4
            records_at = pos
            size, data_start, pos = read_records_field(data, pos, end, flexible, context,
                                                       "records ({size} bytes)")
            data_end = pos
            tagged = _NO_TAGS
            if flexible:
                tagged, pos = _tagged_fields(data, pos, end, version)
            partitions.append(FetchPartition(
                index, error, hwm, lso, log_start, aborted, replica, part_start, records_at,
                data_start, data_end, size == -1, tagged, pos))
        if flexible:
            _, pos = _tagged_fields(data, pos, end, version)
        topics.append(FetchTopic(name, topic_id, start, tuple(partitions), pos))
    tagged_at = pos
    top_tagged = _NO_TAGS
    if flexible:
        top_tagged, pos = _tagged_fields(data, pos, end, version)
    if pos != end:
        raise MalformedMessage(f"Fetch response v{version}: {end - pos} unread bytes after "
                               f"the body (byte {pos})")
    return FetchLayout(version, throttle, top_error, session_id, tuple(topics), tagged_at,
                       top_tagged, pos)
