"""The compiled check of Produce answers (``produce_answer_untagged``) against the general
scan it stands in front of.

It may say True only where the general code would find a well-formed answer with no
tagged field (nothing to rewrite): then the answer is forwarded as it came. Where it
says False the general code decides, so False is always safe; the tests hold it to
True for the answers brokers send, and to False for everything else.
"""

from __future__ import annotations

import dataclasses
import datetime
import struct
import sys
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kio.schema.errors import ErrorCode

from kiproxy.protocol._codec import produce_answer_untagged
from kiproxy.protocol.errors import MalformedMessage
from kiproxy.protocol.messages import (
    ApiKey,
    parse_response,
    response_type,
    serialize,
)
from kiproxy.proxy.brokers.addresses import rewrite_response_frame
from kiproxy.proxy.produce.pipeline import _node_rewriter

VERSIONS = range(10, 14)
HEADER = struct.pack(">i", 7) + b"\x00"  # correlation id, no tagged fields (header v1)


def _types(version: int) -> Any:
    return sys.modules[response_type(ApiKey.PRODUCE, version).__module__]


def _answer(version: int, *, message: str | None = None, record_errors: int = 0,
            topics: int = 2, partitions: int = 3) -> Any:
    """A ProduceResponse as brokers send it (no tagged field), with what is asked for."""
    import uuid

    m = _types(version)
    parts = tuple(m.PartitionProduceResponse(
        index=p, error_code=ErrorCode.none, base_offset=1000 + p, log_append_time=None,
        log_start_offset=0, error_message=message,
        record_errors=tuple(m.BatchIndexAndErrorMessage(
            batch_index=i, batch_index_error_message=None if i % 2 else f"bad {i}")
            for i in range(record_errors)))
        for p in range(partitions))

    def named(t: int) -> dict[str, Any]:
        if version >= 13:
            return {"topic_id": uuid.UUID(int=t + 1)}
        return {"name": f"topic-{t}" + "x" * 150 * t}  # the second past a one-byte varint

    return m.ProduceResponse(
        responses=tuple(m.TopicProduceResponse(partition_responses=parts, **named(t))
                        for t in range(topics)),
        throttle_time=datetime.timedelta(0))


def _forwarded_as_it_came(version: int, frame: bytes) -> bool:
    """What the general code does with the answer: passes it on as it came (True), or
    rewrites or refuses it (False)."""
    try:
        return rewrite_response_frame(ApiKey.PRODUCE, version, frame, _advertise) is frame
    except MalformedMessage:
        return False


def _advertise(node_id: int, host: str, port: int) -> tuple[str, int]:
    return "proxy", 30000 + node_id


def _has_tagged_fields(version: int, message: Any) -> bool:
    """Whether kio writes a tagged field anywhere in ``message`` (one not at its default)."""
    if version < 10:
        return False
    default = _types(version).LeaderIdAndEpoch()
    return bool(message.node_endpoints) or any(
        p.current_leader != default for t in message.responses for p in t.partition_responses)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize(("message", "record_errors"), [(None, 0), ("throttled", 2)])
def test_answers_brokers_send_pass_and_every_mutation_agrees_with_the_general_code(
        version: int, message: str | None, record_errors: int) -> None:
    frame = HEADER + serialize(_answer(version, message=message, record_errors=record_errors))
    assert produce_answer_untagged(frame, version)
    assert _forwarded_as_it_came(version, frame)
    # Cut anywhere, grown by a byte: never passed.
    for end in range(len(frame)):
        assert not produce_answer_untagged(frame[:end], version)
    assert not produce_answer_untagged(frame + b"\x00", version)
    # Any one byte changed: passed only where the general code finds it untagged too.
    for pos in range(len(frame)):
        for value in (0x00, 0x01, 0x02, 0x7F, 0x80, 0xFF, frame[pos] ^ 0x01):
            mutated = frame[:pos] + bytes([value]) + frame[pos + 1:]
            if produce_answer_untagged(mutated, version):
                assert _forwarded_as_it_came(version, mutated), (pos, value)


@pytest.mark.parametrize("version", VERSIONS)
@settings(max_examples=25, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_any_answer_passes_exactly_when_it_has_no_tagged_field(
        version: int, data: st.DataObject) -> None:
    message = data.draw(st.from_type(response_type(ApiKey.PRODUCE, version)))
    if data.draw(st.booleans()):
        message = dataclasses.replace(message, node_endpoints=())
    frame = HEADER + serialize(message)
    passed = produce_answer_untagged(frame, version)
    assert passed == (not _has_tagged_fields(version, message))
    if passed:
        assert _forwarded_as_it_came(version, frame)


def test_other_versions_and_tagged_headers_are_left_to_the_general_code() -> None:
    frame = HEADER + serialize(_answer(11))
    assert not produce_answer_untagged(frame, 9)
    assert not produce_answer_untagged(frame, 14)
    tagged_header = frame[:4] + b"\x01\x05\x00" + frame[5:]
    assert not produce_answer_untagged(tagged_header, 11)


def test_the_pipeline_passes_a_plain_answer_as_it_came_and_rewrites_node_endpoints() -> None:
    m = _types(11)
    rewrite = _node_rewriter(11, _advertise)
    assert rewrite is not None
    plain = HEADER + serialize(_answer(11))
    assert rewrite(plain) is plain
    named = HEADER + serialize(dataclasses.replace(_answer(11), node_endpoints=(
        m.NodeEndpoint(node_id=111, host="broker-111.internal", port=9092, rack=None),)))
    rewritten = parse_response(ApiKey.PRODUCE, 11, rewrite(named), 5)
    assert [(e.host, e.port) for e in rewritten.node_endpoints] == [("proxy", 30111)]
    assert _node_rewriter(9, lambda node, host, port: ("proxy", port)) is None
