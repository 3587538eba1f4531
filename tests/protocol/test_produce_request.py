"""Reading a Produce request in one pass: the same fields kio reads, records in place."""

from __future__ import annotations

import datetime
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from kio.static.primitive import i16, i32, i32Timedelta
from support.produce_requests import HEAD, produce_requests, produce_types

from kiproxy.protocol.errors import MalformedMessage
from kiproxy.protocol.messages import ApiKey, parse_request, serialize
from kiproxy.protocol.produce_request import read_produce_request


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=produce_requests())
def test_the_reader_reads_what_kio_reads(case: tuple[int, Any]) -> None:
    version, request = case
    frame = HEAD + serialize(request)
    layout = read_produce_request(frame, len(HEAD), version)
    parsed = parse_request(ApiKey.PRODUCE, version, frame, len(HEAD))
    assert layout.transactional_id == parsed.transactional_id
    assert layout.acks == parsed.acks
    assert layout.timeout_ms == parsed.timeout // datetime.timedelta(milliseconds=1)
    assert len(layout.topics) == len(parsed.topic_data)
    for topic, kio_topic in zip(layout.topics, parsed.topic_data, strict=True):
        if version >= 13:
            assert (topic.name, topic.topic_id) == (None, kio_topic.topic_id)
        else:
            assert (topic.name, topic.topic_id) == (kio_topic.name, None)
        assert [p.partition for p in topic.partitions] == [
            p.index for p in kio_topic.partition_data]
        assert [frame[p.data_start:p.data_end] for p in topic.partitions] == [
            p.records or b"" for p in kio_topic.partition_data]
    assert layout.end == len(frame)


def _one_topic(version: int, name: str = "t") -> bytes:
    request_cls, topic_cls, part_cls = produce_types(version)
    parts = (part_cls(index=i32(3), records=b"abc"),)
    topic = (topic_cls(topic_id=uuid.UUID(int=7), partition_data=parts) if version >= 13
             else topic_cls(name=name, partition_data=parts))
    return HEAD + serialize(request_cls(
        transactional_id=None, acks=i16(1),
        timeout=i32Timedelta.parse(datetime.timedelta(seconds=1)), topic_data=(topic,)))


@pytest.mark.parametrize("version", [3, 9, 13])
def test_bytes_after_the_body_are_malformed(version: int) -> None:
    with pytest.raises(MalformedMessage, match="1 unread bytes after the body"):
        read_produce_request(_one_topic(version) + b"\x00", len(HEAD), version)


@pytest.mark.parametrize("version", [3, 9])
def test_a_topic_name_that_is_not_utf8_is_malformed(version: int) -> None:
    frame = _one_topic(version, name="tz").replace(b"tz", b"t\xff")
    with pytest.raises(MalformedMessage, match=r"topic name at byte \d+ is not UTF-8"):
        read_produce_request(frame, len(HEAD), version)


def test_a_null_topic_name_is_malformed() -> None:
    frame = _one_topic(3, name="t").replace(b"\x00\x01t", b"\xff\xff")
    with pytest.raises(MalformedMessage, match="null topic name"):
        read_produce_request(frame, len(HEAD), 3)


def test_a_null_partition_array_is_malformed() -> None:
    frame = bytearray(_one_topic(9))
    layout = read_produce_request(bytes(frame), len(HEAD), 9)
    frame[layout.topics[0].count_at] = 0  # compact array length 0: null
    with pytest.raises(MalformedMessage, match="partition count is null or negative"):
        read_produce_request(bytes(frame), len(HEAD), 9)


def test_a_transactional_id_length_below_minus_one_is_malformed() -> None:
    frame = bytearray(_one_topic(3))
    frame[len(HEAD):len(HEAD) + 2] = (-5).to_bytes(2, "big", signed=True)
    with pytest.raises(MalformedMessage, match="transactional_id length -5 at byte 11"):
        read_produce_request(bytes(frame), len(HEAD), 3)


def test_a_varint_past_32_bits_is_malformed() -> None:
    frame = bytearray(_one_topic(9))
    # transactional_id length (compact, null = 0) replaced by a five-byte varint of 2**35
    frame[len(HEAD):len(HEAD) + 1] = b"\x80\x80\x80\x80\x20"
    with pytest.raises(MalformedMessage, match="varint at byte 11 overflows 32 bits"):
        read_produce_request(bytes(frame), len(HEAD), 9)
