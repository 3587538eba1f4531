"""Splicing a Fetch response: new records in, every other byte as it came.

For random Fetch v4-v18 responses written by kio: no replacement gives back the frame
object itself; replacing records by the same bytes gives equal bytes; replacing some
partitions' records by other bytes (longer or shorter, crossing the compact length's
one-byte boundary) gives exactly what kio writes for the edited message, which kio
reads back with every non-record field equal to the original. A size-prefixed frame
gets its size rewritten. As pieces, the splice is the same bytes, and what it keeps of
the frame is views of the frame itself, not copies.
"""

from __future__ import annotations

import dataclasses
import datetime
import struct
from typing import Any

import pytest
from fetch_responses import fetch_responses, fetch_types, head
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kio.schema.errors import ErrorCode
from kio.static.primitive import i32Timedelta

from kiproxy.protocol.errors import MalformedMessage
from kiproxy.protocol.fetch_response import read_fetch_response
from kiproxy.protocol.fetch_splice import splice_fetch_pieces, splice_fetch_response
from kiproxy.protocol.messages import parse_response, serialize


@st.composite
def replacements_for(draw: st.DrawFn, response: Any) -> dict[tuple[int, int], bytes]:
    out = {}
    for ti, topic in enumerate(response.responses):
        for pj in range(len(topic.partitions)):
            if draw(st.booleans()):
                out[ti, pj] = draw(st.one_of(st.binary(max_size=40),
                                             st.binary(min_size=120, max_size=300)))
    return out


def _edited(response: Any, replacements: dict[tuple[int, int], bytes]) -> Any:
    """The slow way: the kio message with those partitions' records replaced."""
    topics = []
    for ti, topic in enumerate(response.responses):
        parts = tuple(dataclasses.replace(part, records=replacements[ti, pj])
                      if (ti, pj) in replacements else part
                      for pj, part in enumerate(topic.partitions))
        topics.append(dataclasses.replace(topic, partitions=parts))
    return dataclasses.replace(response, responses=tuple(topics))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), case=fetch_responses())
def test_splice_is_what_kio_writes_for_the_edited_response(data: st.DataObject,
                                                           case: tuple[int, Any]) -> None:
    version, response = case
    frame = head(version) + serialize(response)
    replacements = data.draw(replacements_for(response))
    spliced = splice_fetch_response(frame, len(head(version)), version, replacements)
    edited = _edited(response, replacements)
    assert spliced == head(version) + serialize(edited)
    parsed = parse_response(1, version, spliced, len(head(version)))
    assert parsed == edited  # every non-record field equal to the original's
    # the same bytes given as pieces (as the fetch pipeline hands them) splice the same
    cut = {key: [new[:i], memoryview(new)[i:j], new[j:]]
           for key, new in replacements.items()
           for i, j in [(len(new) // 3, 2 * len(new) // 3)]}
    assert splice_fetch_response(frame, len(head(version)), version, cut) == spliced
    pieces = splice_fetch_pieces(frame, len(head(version)), version, cut)
    if replacements:
        assert isinstance(pieces, list)
        assert b"".join(pieces) == spliced
        kept = [p for p in pieces if isinstance(p, memoryview) and p.obj is frame]
        assert kept and sum(map(len, kept)) == len(frame) - sum(
            p.data_end - p.records_at
            for (ti, pj), p in _parts(frame, version).items() if (ti, pj) in replacements)
    else:
        assert pieces is frame


def _parts(frame: bytes, version: int) -> dict[tuple[int, int], Any]:
    layout = read_fetch_response(frame, len(head(version)), version)
    return {(ti, pj): p for ti, t in enumerate(layout.topics)
            for pj, p in enumerate(t.partitions)}


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=fetch_responses())
def test_no_replacement_is_the_same_object_and_same_bytes_are_equal(
        case: tuple[int, Any]) -> None:
    version, response = case
    frame = head(version) + serialize(response)
    assert splice_fetch_response(frame, len(head(version)), version, {}) is frame
    layout = read_fetch_response(frame, len(head(version)), version)
    same = {(ti, pj): frame[p.data_start:p.data_end]
            for ti, t in enumerate(layout.topics) for pj, p in enumerate(t.partitions)
            if not p.records_null}
    assert splice_fetch_response(frame, len(head(version)), version, same, layout) == frame


@pytest.mark.parametrize("version", [4, 12, 13, 16, 18])
def test_a_size_prefixed_frame_gets_its_new_size(version: int) -> None:
    types = fetch_types(version)
    part = types.PartitionData(partition_index=0, error_code=ErrorCode.none,
                               high_watermark=1, last_stable_offset=1,
                               aborted_transactions=None, records=b"old")
    response = dataclasses.replace(
        _minimal(version), responses=(dataclasses.replace(
            _minimal(version).responses[0], partitions=(part,)),))
    payload = head(version) + serialize(response)
    framed = struct.pack(">i", len(payload)) + payload
    new = b"n" * 200  # the compact length grows from one byte to two
    spliced = splice_fetch_response(framed, 4 + len(head(version)), version, {(0, 0): new},
                                    size_prefix=True)
    (size,) = struct.unpack_from(">i", spliced)
    assert size == len(spliced) - 4
    assert spliced[4:] == head(version) + serialize(_edited(response, {(0, 0): new}))


def _minimal(version: int) -> Any:
    types = fetch_types(version)
    topic_kw: dict[str, Any] = ({"topic_id": None} if version >= 13 else {"topic": "t"})
    topic = types.FetchableTopicResponse(partitions=(), **topic_kw)
    kw: dict[str, Any] = {"throttle_time": i32Timedelta.parse(datetime.timedelta(0)),
                          "responses": (topic,)}
    if version >= 7:
        kw["error_code"] = ErrorCode.none
    return types.FetchResponse(**kw)


def test_a_wrong_size_prefix_or_position_is_refused() -> None:
    payload = head(12) + serialize(_minimal(12))
    with pytest.raises(MalformedMessage, match="size prefix"):
        splice_fetch_response(struct.pack(">i", 3) + payload, 4 + len(head(12)), 12,
                              {(0, 0): b"x"}, size_prefix=True)
    with pytest.raises(KeyError, match=r"no partition at position \(0, 0\)"):
        splice_fetch_response(payload, len(head(12)), 12, {(0, 0): b"x"})


def _with_unknown_tags(frame: bytes, version: int, tag: bytes) -> bytes:
    """``frame`` with an unknown tagged field (tag 9) on every partition, topic and the
    response that kio wrote none on (as a newer broker, or Tansu's empty
    ``node_endpoints``, would send)."""
    layout = read_fetch_response(frame, len(head(version)), version)
    ends = [p.end for t in layout.topics for p in t.partitions if not p.tagged]
    ends += [t.end for t in layout.topics] + ([layout.end] if not layout.tagged else [])
    out = bytearray(frame)
    for end in sorted(ends, reverse=True):
        assert out[end - 1] == 0  # an empty tagged section
        out[end - 1:end] = b"\x01\x09" + bytes([len(tag)]) + tag
    return bytes(out)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), case=fetch_responses(versions=range(12, 19)),
       tag=st.binary(max_size=20))
def test_unknown_tagged_fields_are_read_as_spans_and_kept(
        data: st.DataObject, case: tuple[int, Any], tag: bytes) -> None:
    version, response = case
    plain = head(version) + serialize(response)
    before = read_fetch_response(plain, len(head(version)), version)
    frame = _with_unknown_tags(plain, version, tag)
    layout = read_fetch_response(frame, len(head(version)), version)
    for old_topic, topic in zip(before.topics, layout.topics, strict=True):
        for old, part in zip(old_topic.partitions, topic.partitions, strict=True):
            expected = [t.tag for t in old.tagged] or [9]
            assert [t.tag for t in part.tagged] == expected
            if not old.tagged:
                (unknown,) = part.tagged
                assert frame[unknown.start:unknown.end] == tag
    assert [t.tag for t in layout.tagged] == ([t.tag for t in before.tagged] or [9])
    replacements = data.draw(replacements_for(response))
    spliced = splice_fetch_response(frame, len(head(version)), version, replacements, layout)
    edited = head(version) + serialize(_edited(response, replacements))
    assert spliced == _with_unknown_tags(edited, version, tag)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data(), case=fetch_responses())
def test_error_codes_set_the_partition_error_and_empty_its_records(
        data: st.DataObject, case: tuple[int, Any]) -> None:
    version, response = case
    frame = head(version) + serialize(response)
    positions = [(ti, pj) for ti, t in enumerate(response.responses)
                 for pj in range(len(t.partitions))]
    errors = {p: data.draw(st.sampled_from([-1, 100, 56])) for p in positions
              if data.draw(st.booleans())}
    spliced = splice_fetch_response(frame, len(head(version)), version, {}, error_codes=errors)
    topics = []
    for ti, topic in enumerate(response.responses):
        parts = tuple(dataclasses.replace(part, records=b"", error_code=ErrorCode(errors[ti, pj]))
                      if (ti, pj) in errors else part
                      for pj, part in enumerate(topic.partitions))
        topics.append(dataclasses.replace(topic, partitions=parts))
    assert spliced == head(version) + serialize(dataclasses.replace(response,
                                                                    responses=tuple(topics)))
