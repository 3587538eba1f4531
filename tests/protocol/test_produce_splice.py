"""Splicing a Produce request: the same bytes as re-serializing the edited message.

For random Produce v3-v13 requests (several topics and partitions, null and empty
records, a nullable transactional id) and random edits (records replaced, partitions
removed, whole topics emptied), :func:`splice_produce_request` gives exactly the bytes
kio writes for the edited message. Unknown tagged fields on the flexible versions
(which the proxy's reader skips, as Kafka's does) are kept where they were: on every
partition, topic and the request itself. The reader never reads past a cut body.
"""

from __future__ import annotations

import dataclasses
import datetime
import uuid
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kio.static.primitive import i16, i32, i32Timedelta
from support.produce_requests import HEAD, edits_for, produce_requests, produce_types

from kiproxy.protocol.errors import MalformedMessage
from kiproxy.protocol.messages import serialize
from kiproxy.protocol.produce_request import read_produce_request
from kiproxy.protocol.produce_splice import splice_produce_request


def _edited(request: Any, edits: dict[tuple[int, int], bytes | None]) -> Any:
    """The slow way: the edited kio message (a topic left empty is removed)."""
    topics = []
    for ti, topic in enumerate(request.topic_data):
        parts = []
        for pj, part in enumerate(topic.partition_data):
            if (ti, pj) not in edits:
                parts.append(part)
            elif edits[ti, pj] is not None:
                parts.append(dataclasses.replace(part, records=edits[ti, pj]))
        if parts:
            topics.append(dataclasses.replace(topic, partition_data=tuple(parts)))
    return dataclasses.replace(request, topic_data=tuple(topics))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), case=produce_requests())
def test_splice_is_byte_identical_to_reserializing(data: st.DataObject,
                                                     case: tuple[int, Any]) -> None:
    version, request = case
    frame = HEAD + serialize(request)
    edits = data.draw(edits_for([len(t.partition_data) for t in request.topic_data]))
    spliced = splice_produce_request(frame, len(HEAD), version, edits)
    assert spliced == HEAD + serialize(_edited(request, edits))


@settings(max_examples=100, deadline=None)
@given(case=produce_requests())
def test_no_edits_give_the_frame_back(case: tuple[int, Any]) -> None:
    version, request = case
    frame = HEAD + serialize(request)
    assert splice_produce_request(frame, len(HEAD), version, {}) == frame


def _with_unknown_tags(frame: bytes, version: int, tag: bytes) -> bytes:
    """``frame`` with one unknown tagged field on every partition, topic and the request."""
    layout = read_produce_request(frame, len(HEAD), version)
    ends = [p.end for t in layout.topics for p in t.partitions]
    ends += [t.end for t in layout.topics] + [layout.end]
    out = bytearray(frame)
    for end in sorted(ends, reverse=True):
        assert out[end - 1] == 0  # kio wrote no tagged fields
        out[end - 1 : end] = b"\x01\x07" + bytes([len(tag)]) + tag
    return bytes(out)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), case=produce_requests(), tag=st.binary(min_size=0, max_size=20))
def test_unknown_tagged_fields_are_kept(data: st.DataObject, case: tuple[int, Any],
                                        tag: bytes) -> None:
    version, request = case
    if version < 9:
        return
    frame = _with_unknown_tags(HEAD + serialize(request), version, tag)
    edits = data.draw(edits_for([len(t.partition_data) for t in request.topic_data]))
    spliced = splice_produce_request(frame, len(HEAD), version, edits)
    expected = _with_unknown_tags(HEAD + serialize(_edited(request, edits)), version, tag)
    assert spliced == expected


def test_records_offsets_point_at_each_partitions_records() -> None:
    _, topic_cls, part_cls = produce_types(9)
    request = produce_types(9)[0](
        transactional_id="tx", acks=i16(-1),
        timeout=i32Timedelta.parse(datetime.timedelta(seconds=1)),
        topic_data=(topic_cls(name="a", partition_data=(
            part_cls(index=i32(0), records=b"first"), part_cls(index=i32(1), records=None))),
            topic_cls(name="b", partition_data=(part_cls(index=i32(5), records=b""),))))
    frame = HEAD + serialize(request)
    layout = read_produce_request(frame, len(HEAD), 9)
    spans = [(frame[p.data_start:p.data_end]) for t in layout.topics for p in t.partitions]
    assert spans == [b"first", b"", b""]
    assert layout.end == len(frame)


@pytest.mark.parametrize("version", [3, 8, 9, 13])
def test_a_cut_body_is_malformed_never_an_over_read(version: int) -> None:
    request_cls, topic_cls, part_cls = produce_types(version)
    topic = (topic_cls(topic_id=uuid.uuid4(), partition_data=(
        part_cls(index=i32(0), records=b"x" * 40),)) if version >= 13 else
        topic_cls(name="t", partition_data=(part_cls(index=i32(0), records=b"x" * 40),)))
    request = request_cls(transactional_id=None, acks=i16(1),
                          timeout=i32Timedelta.parse(datetime.timedelta(seconds=1)),
                          topic_data=(topic,))
    frame = HEAD + serialize(request)
    for cut in range(len(HEAD), len(frame)):
        with pytest.raises(MalformedMessage):
            read_produce_request(frame[:cut], len(HEAD), version)
