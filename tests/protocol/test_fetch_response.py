"""Reading a Fetch response's layout: every field kio wrote, read back, records untouched.

For random Fetch v4-v18 responses written by kio's serializer (topic names before v13,
ids after, null/empty/random/real records, aborted transactions, the three tagged
partition fields and ``node_endpoints``), :func:`read_fetch_response` reads back every
field, and each ``records`` span holds exactly the bytes kio wrote. A body cut at any
byte, or with any byte changed, is a :class:`MalformedMessage` or a layout - never
another exception, an over-read or an allocation sized by a lying count.
"""

from __future__ import annotations

import datetime
import struct
import uuid
from typing import Any

import pytest
from fetch_responses import VERSIONS, fetch_responses, fetch_types, head
from hypothesis import HealthCheck, given, settings
from kio.schema.errors import ErrorCode
from kio.static.primitive import i32Timedelta

from kiproxy.protocol.errors import MalformedMessage
from kiproxy.protocol.fetch_response import (
    AbortedTransaction,
    FetchLayout,
    read_fetch_response,
)
from kiproxy.protocol.messages import serialize

_PARTITION_TAGS = (("diverging_epoch", 0), ("current_leader", 1), ("snapshot_id", 2))


def _tags_kio_writes(message: Any, fields: tuple[tuple[str, int], ...]) -> list[int]:
    """The tags of the fields kio writes: those not at their default."""
    cls = type(message)
    defaults = {f.name: f.default for f in cls.__dataclass_fields__.values()}
    return [tag for name, tag in fields
            if name in defaults and getattr(message, name) != defaults[name]]


def _assert_layout_matches(frame: bytes, layout: FetchLayout, version: int,
                           response: Any) -> None:
    assert layout.version == version
    assert layout.throttle_time_ms == response.throttle_time // datetime.timedelta(milliseconds=1)
    assert layout.error_code == getattr(response, "error_code", 0)
    assert layout.session_id == getattr(response, "session_id", 0)
    assert len(layout.topics) == len(response.responses)
    for topic, expected_topic in zip(layout.topics, response.responses, strict=True):
        if version >= 13:
            assert (topic.name, topic.topic_id) == (None, expected_topic.topic_id)
        else:
            assert (topic.name, topic.topic_id) == (expected_topic.topic, None)
        assert len(topic.partitions) == len(expected_topic.partitions)
        for part, expected in zip(topic.partitions, expected_topic.partitions, strict=True):
            assert part.partition == expected.partition_index
            assert part.error_code == expected.error_code.value
            assert part.high_watermark == expected.high_watermark
            assert part.last_stable_offset == expected.last_stable_offset
            assert part.log_start_offset == getattr(expected, "log_start_offset", -1)
            assert part.preferred_read_replica == getattr(expected, "preferred_read_replica",
                                                          -1)
            if expected.aborted_transactions is None:
                assert part.aborted_transactions is None
            else:
                assert part.aborted_transactions == tuple(
                    AbortedTransaction(a.producer_id, a.first_offset)
                    for a in expected.aborted_transactions)
            assert part.records_null == (expected.records is None)
            assert frame[part.data_start:part.data_end] == (expected.records or b"")
            assert [t.tag for t in part.tagged] == _tags_kio_writes(expected, _PARTITION_TAGS)
            assert topic.start <= part.start < part.records_at < part.data_start
            assert part.data_end <= part.end <= topic.end
    assert [t.tag for t in layout.tagged] == _tags_kio_writes(response,
                                                              (("node_endpoints", 0),))
    assert layout.end == len(frame)


@settings(max_examples=400, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=fetch_responses())
def test_layout_reads_back_every_field_kio_wrote(case: tuple[int, Any]) -> None:
    version, response = case
    frame = head(version) + serialize(response)
    layout = read_fetch_response(frame, len(head(version)), version)
    _assert_layout_matches(frame, layout, version, response)


@pytest.mark.parametrize("version", VERSIONS)
def test_every_version_reads_a_bytearray_frame_too(version: int) -> None:
    frame = head(version) + serialize(_one_partition(version, records=b"abc"))
    layout = read_fetch_response(bytearray(frame), len(head(version)), version)
    (part,) = layout.topics[0].partitions
    assert frame[part.data_start:part.data_end] == b"abc"


def _one_partition(version: int, records: bytes | None, aborted: int = 1) -> Any:
    types = fetch_types(version)
    part = types.PartitionData(
        partition_index=3, error_code=ErrorCode.none, high_watermark=100,
        last_stable_offset=90,
        aborted_transactions=tuple(types.AbortedTransaction(producer_id=7, first_offset=i)
                                   for i in range(aborted)),
        records=records,
        **({"current_leader": types.LeaderIdAndEpoch(leader_id=2, leader_epoch=9)}
           if version >= 12 else {}))
    topic = (types.FetchableTopicResponse(topic_id=uuid.UUID(int=5), partitions=(part,))
             if version >= 13 else types.FetchableTopicResponse(topic="t", partitions=(part,)))
    kw: dict[str, Any] = {"throttle_time": i32Timedelta.parse(datetime.timedelta(0)),
                          "responses": (topic,)}
    if version >= 7:
        kw["error_code"] = ErrorCode.none
    if version >= 16:
        kw["node_endpoints"] = (types.NodeEndpoint(node_id=1, host="h", port=9092),)
    return types.FetchResponse(**kw)


@pytest.mark.parametrize("version", VERSIONS)
def test_a_cut_body_is_malformed_naming_the_byte(version: int) -> None:
    frame = head(version) + serialize(_one_partition(version, records=b"x" * 30))
    for cut in range(len(head(version)), len(frame)):
        with pytest.raises(MalformedMessage, match=r"Fetch response v\d+.*byte \d+"):
            read_fetch_response(frame[:cut], len(head(version)), version)


@pytest.mark.parametrize("version", [4, 11, 12, 13, 16, 18])
def test_any_byte_changed_is_a_layout_or_malformed(version: int) -> None:
    frame = head(version) + serialize(_one_partition(version, records=b"x" * 30, aborted=2))
    for at in range(len(head(version)), len(frame)):
        for value in (0x00, 0x7F, 0x80, 0xFF):
            changed = frame[:at] + bytes([value]) + frame[at + 1:]
            try:
                layout = read_fetch_response(changed, len(head(version)), version)
            except MalformedMessage:
                continue
            assert layout.end == len(changed)
            for topic in layout.topics:
                for part in topic.partitions:
                    assert part.data_end <= len(changed)


@pytest.mark.parametrize("version", [4, 12])
@pytest.mark.parametrize("what", ["topics", "partitions", "aborted"])
def test_a_lying_count_is_malformed_at_once(version: int, what: str) -> None:
    """A count of 2**31 - 1 entries in a few bytes: refused, nothing sized from it."""
    flexible = version >= 12
    count = b"\xff\xff\xff\xff\x07" if flexible else struct.pack(">i", 2**31 - 1)
    body = struct.pack(">i", 0)  # throttle time
    if version >= 7:
        body += struct.pack(">hi", 0, 0)
    if what == "topics":
        body += count
    else:
        body += (b"\x02t\x02" if flexible else b"\x00\x01t\x00\x00\x00\x01")
        if what == "partitions":
            body += count
        else:
            body += struct.pack(">ihqqq", 0, 0, 0, 0, 0) + count
    with pytest.raises(MalformedMessage, match=r"at byte \d+"):
        read_fetch_response(body + b"\x00" * 8, 0, version)


def test_a_version_outside_4_to_18_is_refused() -> None:
    for version in (3, 19):
        with pytest.raises(MalformedMessage, match="v4-v18"):
            read_fetch_response(b"\x00" * 16, 0, version)


def test_bytes_after_the_body_are_malformed() -> None:
    frame = head(12) + serialize(_one_partition(12, records=b"abc")) + b"\x00"
    with pytest.raises(MalformedMessage, match="1 unread bytes"):
        read_fetch_response(frame, len(head(12)), 12)
