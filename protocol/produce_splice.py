"""Rewriting a Produce request's partitions by splicing bytes, never by re-serializing.

Contract:

* :func:`scan_produce_request` walks the body of a Produce v3-v13 request (Kafka's
  ``ProduceRequest.json``: transactional_id, acks, timeout, then topics, each with its
  partitions, each with its ``records``; tagged fields after every struct on the
  flexible versions, v9+) and returns where each topic entry, each partition entry
  and each ``records`` field lies in the frame. It reads lengths only: no record,
  name or id is decoded, nothing is copied. A body that runs short raises
  :class:`~kiproxy.protocol.errors.MalformedMessage`; nothing is read past the frame.
* :func:`splice_produce_request` returns the frame with some partitions edited, each
  edit keyed by its ``(topic position, partition position)`` in the request: new
  ``records`` bytes replace the old ones (with a new length prefix), ``None`` removes
  the partition. A topic whose partitions were all removed is removed; array lengths
  that changed are rewritten. Every other byte - request header, transactional id,
  acks, timeout, topic names or ids, untouched partitions, tagged fields - is copied
  as it came.
* For a request kio writes back byte for byte (canonical varints, no unknown tagged
  fields), the result equals re-serializing the edited kio message
  (``tests/protocol/test_produce_splice.py`` checks it on random requests). Tagged
  fields are copied where they were (kio's reader refuses unknown ones, so a request
  the proxy parsed has none).
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import dataclass

from kiproxy.protocol.errors import MalformedMessage

__all__ = [
    "PartitionSpan",
    "ProduceLayout",
    "TopicSpan",
    "scan_produce_request",
    "splice_produce_request",
]

FIRST_FLEXIBLE_VERSION = 9
"""Produce v9 is the first version with compact lengths and tagged fields."""
FIRST_TOPIC_ID_VERSION = 13
"""Produce v13 names topics by a 16-byte id instead of a string."""

_INT32 = struct.Struct(">i")
_INT16 = struct.Struct(">h")


@dataclass(frozen=True, slots=True)
class PartitionSpan:
    """Where one partition entry lies in the frame (absolute byte positions)."""

    start: int
    """The partition entry's first byte (its ``index``)."""
    records_at: int
    """The first byte of the ``records`` length prefix."""
    data_start: int
    """The first byte of the records themselves."""
    data_end: int
    """One past the records' last byte (``data_start`` for null or empty records)."""
    end: int
    """One past the entry's last byte (after its tagged fields on v9+)."""


@dataclass(frozen=True, slots=True)
class TopicSpan:
    """Where one topic entry and its partition array lie in the frame."""

    start: int
    """The topic entry's first byte (its name or id)."""
    count_at: int
    """The first byte of the partition array's length."""
    partitions: tuple[PartitionSpan, ...]
    """Each partition entry, in request order."""
    end: int
    """One past the entry's last byte (after its tagged fields on v9+)."""


@dataclass(frozen=True, slots=True)
class ProduceLayout:
    """Where the topic array and every entry in it lie in a Produce request frame."""

    count_at: int
    """The first byte of the topic array's length (after acks and timeout)."""
    topics: tuple[TopicSpan, ...]
    """Each topic entry, in request order."""
    end: int
    """One past the request body's last byte (after its tagged fields on v9+)."""


class _Reader:
    """A cursor over the frame that never reads past ``end``."""

    __slots__ = ("data", "end", "pos", "version")

    def __init__(self, data: bytes | bytearray | memoryview, pos: int, version: int) -> None:
        self.data = data
        self.pos = pos
        self.end = len(data)
        self.version = version

    def fail(self, what: str) -> MalformedMessage:
        return MalformedMessage(
            f"Produce request v{self.version} does not parse: {what} at byte {self.pos} "
            f"runs past the {self.end}-byte frame")

    def skip(self, n: int, what: str) -> None:
        if n < 0 or self.pos + n > self.end:
            raise self.fail(what)
        self.pos += n

    def int16(self, what: str) -> int:
        if self.pos + 2 > self.end:
            raise self.fail(what)
        (value,) = _INT16.unpack_from(self.data, self.pos)
        self.pos += 2
        return int(value)

    def int32(self, what: str) -> int:
        if self.pos + 4 > self.end:
            raise self.fail(what)
        (value,) = _INT32.unpack_from(self.data, self.pos)
        self.pos += 4
        return int(value)

    def uvarint(self, what: str) -> int:
        result = 0
        shift = 0
        data = self.data
        while True:
            if self.pos >= self.end:
                raise self.fail(what)
            b = data[self.pos]
            self.pos += 1
            result |= (b & 0x7F) << shift
            if not b & 0x80:
                return result
            shift += 7
            if shift > 28:
                raise MalformedMessage(
                    f"Produce request v{self.version} does not parse: {what} varint at "
                    f"byte {self.pos} overflows 32 bits")

    def tagged_fields(self) -> None:
        for _ in range(self.uvarint("tagged field count")):
            self.uvarint("tagged field tag")
            self.skip(self.uvarint("tagged field size"), "tagged field")

    def array_length(self, flexible: bool, what: str) -> int:
        n = self.uvarint(what) - 1 if flexible else self.int32(what)
        if n < 0:
            raise MalformedMessage(
                f"Produce request v{self.version} does not parse: {what} is null or "
                f"negative at byte {self.pos}")
        return n


def scan_produce_request(frame: bytes | bytearray | memoryview, body_offset: int,
                         version: int) -> ProduceLayout:
    """Where every topic, partition and ``records`` field of a Produce v3+ body lies.

    ``body_offset`` is where the body starts (after the request header). Raises
    :class:`MalformedMessage` for a body that runs short or holds a null array.
    """
    flexible = version >= FIRST_FLEXIBLE_VERSION
    r = _Reader(frame, body_offset, version)
    if flexible:  # transactional_id: compact nullable string
        r.skip(max(r.uvarint("transactional_id length") - 1, 0), "transactional_id")
    else:
        r.skip(max(r.int16("transactional_id length"), 0), "transactional_id")
    r.skip(6, "acks and timeout")
    count_at = r.pos
    topics = []
    for _ in range(r.array_length(flexible, "topic count")):
        start = r.pos
        if version >= FIRST_TOPIC_ID_VERSION:
            r.skip(16, "topic_id")
        elif flexible:
            r.skip(max(r.uvarint("topic name length") - 1, 0), "topic name")
        else:
            r.skip(max(r.int16("topic name length"), 0), "topic name")
        part_count_at = r.pos
        partitions = []
        for _ in range(r.array_length(flexible, "partition count")):
            part_start = r.pos
            r.skip(4, "partition index")
            records_at = r.pos
            size = r.uvarint("records length") - 1 if flexible else r.int32("records length")
            data_start = r.pos
            r.skip(max(size, 0), "records")
            data_end = r.pos
            if flexible:
                r.tagged_fields()
            partitions.append(PartitionSpan(part_start, records_at, data_start, data_end, r.pos))
        if flexible:
            r.tagged_fields()
        topics.append(TopicSpan(start, part_count_at, tuple(partitions), r.pos))
    if flexible:
        r.tagged_fields()
    return ProduceLayout(count_at, tuple(topics), r.pos)


def _uvarint(value: int) -> bytes:
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def _array_length(n: int, flexible: bool) -> bytes:
    return _uvarint(n + 1) if flexible else _INT32.pack(n)


def splice_produce_request(
    frame: bytes | bytearray | memoryview,
    body_offset: int,
    version: int,
    edits: Mapping[tuple[int, int], bytes | None],
    layout: ProduceLayout | None = None,
) -> bytes:
    """``frame`` with the partitions named in ``edits`` replaced or removed.

    ``edits`` maps ``(topic position, partition position)`` to the partition's new
    ``records`` bytes, or to ``None`` to remove the partition (see the module contract).
    ``layout`` is the frame's :func:`scan_produce_request`, scanned here when not given.
    """
    if layout is None:
        layout = scan_produce_request(frame, body_offset, version)
    flexible = version >= FIRST_FLEXIBLE_VERSION
    view = memoryview(frame)
    topics_left = len(layout.topics)
    count_end = layout.topics[0].start if layout.topics else layout.end
    # Header, transactional id, acks, timeout; then the topic count, set at the end.
    pieces: list[bytes | memoryview] = [view[:layout.count_at], b""]
    copied = count_end  # frame[copied:] is neither emitted nor skipped yet
    for ti, topic in enumerate(layout.topics):
        touched = [(pj, edits[ti, pj]) for pj in range(len(topic.partitions))
                   if (ti, pj) in edits]
        if not touched:
            continue  # copied with whatever follows, in one piece
        kept = len(topic.partitions) - sum(1 for _, new in touched if new is None)
        if kept == 0:
            pieces.append(view[copied:topic.start])
            copied = topic.end
            topics_left -= 1
            continue
        first = topic.partitions[0].start if topic.partitions else topic.end
        if kept != len(topic.partitions):
            pieces.append(view[copied:topic.count_at])
            pieces.append(_array_length(kept, flexible))
            copied = first
        for pj, new in touched:
            part = topic.partitions[pj]
            pieces.append(view[copied:part.start if new is None else part.records_at])
            if new is None:
                copied = part.end
                continue
            pieces.append(_uvarint(len(new) + 1) if flexible else _INT32.pack(len(new)))
            pieces.append(new)
            copied = part.data_end
    pieces.append(view[copied:])
    if topics_left != len(layout.topics):
        pieces[1] = _array_length(topics_left, flexible)
    else:
        pieces[1] = view[layout.count_at:count_end]
    return b"".join(pieces)
