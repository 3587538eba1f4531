"""The compiled Produce path (``protocol/_produce.pxi``) against the Python it stands in front of.

Each compiled function answers the value the Python code gives, or None, and then the
Python code runs: for random valid Produce v3-v13 requests, edits and record batch
headers the answers are equal (same types, same fields, same bytes); for every byte of
them mutated, for every cut and for bytes appended, the public function gives what the
Python code alone gives - the same value, or the same error, message for message.
"""

from __future__ import annotations

import datetime
import struct
import types
import uuid
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kio.static.primitive import i16, i32, i32Timedelta
from support.produce_requests import HEAD, edits_for, produce_requests, produce_types

from kiproxy.protocol._codec import (
    batch_around,
    read_batch_header,
    read_produce_layout,
    splice_produce,
)
from kiproxy.protocol.compression import Compression
from kiproxy.protocol.messages import serialize
from kiproxy.protocol.produce_request import (
    PartitionSpan,
    ProduceLayout,
    TopicSpan,
    _read_general,
    read_produce_request,
)
from kiproxy.protocol.produce_splice import _splice_general, splice_produce_request
from kiproxy.protocol.records import (
    Record,
    RecordBatchHeader,
    _pieces_general,
    _read_header,
    _read_header_general,
    build_batch,
    encode_block_parts,
)

SETTINGS = settings(max_examples=200, deadline=None,
                    suppress_health_check=[HealthCheck.too_slow])


def outcome(call: Callable[..., Any], *args: Any) -> tuple[str, Any]:
    """What ``call(*args)`` gives: ("value", its value) or (its error type, its message)."""
    try:
        return "value", call(*args)
    except Exception as exc:  # every error, to compare the compiled path's with Python's
        return type(exc).__name__, str(exc)


def _compiled_layout(frame: bytes | bytearray, version: int) -> ProduceLayout | None:
    return read_produce_layout(frame, len(HEAD), version, ProduceLayout, TopicSpan,
                               PartitionSpan, uuid.UUID)


def _same_layout(compiled: ProduceLayout, python: ProduceLayout) -> None:
    assert compiled == python
    assert type(compiled) is ProduceLayout and type(compiled.topics) is tuple
    for topic, expected in zip(compiled.topics, python.topics, strict=True):
        assert type(topic) is TopicSpan and type(topic.partitions) is tuple
        assert type(topic.name) is type(expected.name)
        assert type(topic.topic_id) is type(expected.topic_id)
        assert all(type(p) is PartitionSpan for p in topic.partitions)
    assert [type(f) for f in compiled] == [type(f) for f in python]


# ---------------------------------------------------------------- request layout

@SETTINGS
@given(case=produce_requests())
def test_the_compiled_layout_is_the_python_one(case: tuple[int, Any]) -> None:
    version, request = case
    frame = HEAD + serialize(request)
    compiled = _compiled_layout(frame, version)
    assert compiled is not None  # kio writes no tagged field: the common shape
    _same_layout(compiled, _read_general(frame, len(HEAD), version))
    from_bytearray = _compiled_layout(bytearray(frame), version)
    assert from_bytearray is not None
    _same_layout(from_bytearray, _read_general(frame, len(HEAD), version))


@SETTINGS
@given(case=produce_requests(), data=st.data())
def test_a_mutated_request_reads_or_fails_as_in_python(case: tuple[int, Any],
                                                       data: st.DataObject) -> None:
    version, request = case
    frame = HEAD + serialize(request)
    at = data.draw(st.integers(len(HEAD), len(frame) - 1))
    byte = data.draw(st.integers(0, 255))
    mutated = frame[:at] + bytes([byte]) + frame[at + 1:]
    expected = outcome(_read_general, mutated, len(HEAD), version)
    assert outcome(read_produce_request, mutated, len(HEAD), version) == expected
    if expected[0] != "value":
        assert _compiled_layout(mutated, version) is None


def _example(version: int) -> bytes:
    """A Produce ``version`` request of two topics, one with null, empty and some records."""
    request_cls, topic_cls, part_cls = produce_types(version)

    def topic(name: str, parts: tuple[Any, ...]) -> Any:
        if version >= 13:
            return topic_cls(topic_id=uuid.UUID(int=len(name) << 64 | 5), partition_data=parts)
        return topic_cls(name=name, partition_data=parts)

    request = request_cls(
        transactional_id="tx-é", acks=i16(-1),
        timeout=i32Timedelta.parse(datetime.timedelta(seconds=30)),
        topic_data=(topic("orders", (part_cls(index=i32(0), records=b"r" * 20),
                                     part_cls(index=i32(2), records=None),
                                     part_cls(index=i32(4), records=b""))),
                    topic("ü", (part_cls(index=i32(1), records=b"abc"),))))
    return HEAD + serialize(request)


@pytest.mark.parametrize("version", [3, 8, 9, 12, 13])
def test_every_cut_and_every_byte_of_a_request_fails_as_in_python(version: int) -> None:
    frame = _example(version)
    inputs = [frame[:cut] for cut in range(len(HEAD), len(frame))]
    inputs += [frame + tail for tail in (b"\x00", b"\x01\x02")]
    for at in range(len(HEAD), len(frame)):
        for byte in (0x00, 0x01, 0x02, 0x7F, 0x80, 0xC3, 0xFF, frame[at] ^ 0x40):
            inputs.append(frame[:at] + bytes([byte]) + frame[at + 1:])
    for mutated in inputs:
        expected = outcome(_read_general, mutated, len(HEAD), version)
        assert outcome(read_produce_request, mutated, len(HEAD), version) == expected
        if expected[0] != "value":
            assert _compiled_layout(mutated, version) is None


@pytest.mark.parametrize("version", [9, 13])
def test_a_tagged_field_is_left_to_python(version: int) -> None:
    tagged = _example(version)[:-1] + b"\x01\x07\x02ab"  # an unknown tag on the request
    assert _compiled_layout(tagged, version) is None
    layout = read_produce_request(tagged, len(HEAD), version)
    assert layout == _read_general(tagged, len(HEAD), version)
    assert layout.end == len(tagged)


# ---------------------------------------------------------------- splice

@SETTINGS
@given(case=produce_requests(), data=st.data())
def test_the_compiled_splice_is_the_python_one(case: tuple[int, Any],
                                               data: st.DataObject) -> None:
    version, request = case
    frame = HEAD + serialize(request)
    layout = read_produce_request(frame, len(HEAD), version)
    edits = data.draw(edits_for([len(t.partitions) for t in layout.topics], max_size=300,
                                         stray=True))
    flexible = version >= 9
    expected = _splice_general(frame, flexible, edits, layout)
    assert splice_produce(frame, flexible, edits, layout) == expected
    assert splice_produce_request(frame, len(HEAD), version, edits) == expected


def test_edits_the_compiled_splice_does_not_take_are_spliced_in_python() -> None:
    frame = _example(9)
    layout = read_produce_request(frame, len(HEAD), 9)
    plain = {(0, 0): b"new"}
    expected = _splice_general(frame, True, plain, layout)
    for edits in (types.MappingProxyType(plain), {(0, 0): bytearray(b"new")},
                  {(0.0, 0): b"new"}):
        assert splice_produce(frame, True, edits, layout) is None  # type: ignore[arg-type]
        assert splice_produce_request(frame, len(HEAD), 9, edits) == expected  # type: ignore[arg-type]


# ---------------------------------------------------------------- batch headers

INT = {"q": (-(2**63), 2**63 - 1), "i": (-(2**31), 2**31 - 1), "h": (-(2**15), 2**15 - 1)}


@st.composite
def batch_headers(draw: st.DrawFn) -> bytes:
    """A magic-2 batch header with random fields, mostly valid ones, and a body."""
    body = draw(st.binary(max_size=40))
    length = draw(st.one_of(st.just(49 + len(body)), st.integers(*INT["i"])))
    fields = [draw(st.integers(*INT["q"])), length, draw(st.integers(*INT["i"])),
              draw(st.sampled_from((2, 2, 2, 0, 1, 3, -1))), draw(st.integers(0, 2**32 - 1)),
              draw(st.one_of(st.integers(0, 0x7F), st.integers(*INT["h"]))),
              draw(st.integers(*INT["i"])), draw(st.integers(*INT["q"])),
              draw(st.integers(*INT["q"])), draw(st.integers(*INT["q"])),
              draw(st.integers(*INT["h"])), draw(st.integers(*INT["i"])),
              draw(st.one_of(st.integers(0, 5), st.integers(*INT["i"])))]
    return struct.pack(">qiibIhiqqqhii", *fields) + body


@SETTINGS
@given(data=batch_headers(), lead=st.binary(max_size=3), cut=st.integers(0, 110))
def test_a_batch_header_reads_or_fails_as_in_python(data: bytes, lead: bytes,
                                                   cut: int) -> None:
    buffer = lead + data
    end = min(len(buffer), len(lead) + cut)
    expected = outcome(_read_header_general, buffer, len(lead), end, len(lead))
    assert outcome(_read_header, buffer, len(lead), end, len(lead)) == expected
    for read_from in (buffer, bytearray(buffer)):
        compiled = read_batch_header(read_from, len(lead), end, RecordBatchHeader)
        if expected[0] == "value":
            assert compiled == expected[1]
            assert all(type(getattr(compiled, f)) is int for f in RecordBatchHeader.__slots__)
        else:
            assert compiled is None


def test_every_byte_of_a_batch_header_mutated_reads_or_fails_as_in_python() -> None:
    batch = build_batch([Record(key=b"k", value=b"v" * 20, timestamp=1_700_000_000_000)],
                        producer_id=7, producer_epoch=1, base_sequence=3)
    for at in range(61):
        for byte in range(256):
            mutated = batch[:at] + bytes([byte]) + batch[at + 1:]
            expected = outcome(_read_header_general, mutated, 0, len(mutated))
            assert outcome(_read_header, mutated, 0, len(mutated)) == expected


# ---------------------------------------------------------------- a batch around its block

def _header(**fields: int) -> RecordBatchHeader:
    values = dict(base_offset=0, batch_length=0, partition_leader_epoch=-1, crc=0,
                  attributes=0, last_offset_delta=0, base_timestamp=0, max_timestamp=0,
                  producer_id=-1, producer_epoch=-1, base_sequence=-1, record_count=1)
    values.update(fields)
    return RecordBatchHeader(**values)


WIDE = st.one_of(st.integers(-(2**15), 2**15 - 1), st.integers(-(2**64), 2**64))


@SETTINGS
@given(base_offset=WIDE, leader_epoch=WIDE, base_timestamp=WIDE, producer_id=WIDE,
       producer_epoch=WIDE, base_sequence=WIDE, attributes=WIDE, last_offset_delta=WIDE,
       max_timestamp=WIDE, count=WIDE, block=st.binary(max_size=200))
def test_a_batch_around_its_block_is_the_python_one(
        base_offset: int, leader_epoch: int, base_timestamp: int, producer_id: int,
        producer_epoch: int, base_sequence: int, attributes: int, last_offset_delta: int,
        max_timestamp: int, count: int, block: bytes) -> None:
    header = _header(base_offset=base_offset, partition_leader_epoch=leader_epoch,
                     base_timestamp=base_timestamp, producer_id=producer_id,
                     producer_epoch=producer_epoch, base_sequence=base_sequence)
    args = (header, attributes, last_offset_delta, max_timestamp, count, block)
    expected = outcome(_pieces_general, *args)
    compiled = batch_around(*args)
    if compiled is None:
        assert expected[0] == "error"  # struct.error: a value out of its field's width
    else:
        assert ("value", compiled) == expected


def test_a_block_that_is_not_bytes_is_left_to_python() -> None:
    header = _header()
    assert batch_around(header, 0, 0, 0, 1, bytearray(b"abc")) is None
    assert _pieces_general(header, 0, 0, 0, 1, bytearray(b"abc"))  # type: ignore[arg-type]


@pytest.mark.parametrize("codec", list(Compression))
def test_a_batch_around_a_block_reads_back(codec: Compression) -> None:
    from kiproxy.protocol.records import decode_batch, encode_records
    records = (Record(key=b"k", value=b"value" * 10, timestamp=5),)
    block, _ = encode_records(records, 5, True)
    header = _header(attributes=int(codec), base_timestamp=5, max_timestamp=5)
    batch = b"".join(encode_block_parts(header, block))
    decoded = decode_batch(batch)
    assert decoded.records == records and decoded.header.compression is codec
