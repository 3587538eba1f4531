"""Random Produce v3-v13 requests (kio messages) for the reader and splice tests.

``produce_requests()`` draws a version and a request of one to four topics, each
with one to four partitions whose records are null, empty or random bytes, and a
nullable transactional id; ``HEAD`` stands in for the request header.
``edits_for(partitions)`` draws edits for the splice: each partition kept, replaced or
removed. ``produce_frame(batch)`` is one whole Produce v9 request (header included) of
``batch`` for partition 0 of topic ``t``, acks all, for the pipeline's unit tests.
"""

from __future__ import annotations

import datetime
import uuid
from collections.abc import Sequence
from typing import Any

from hypothesis import strategies as st
from kio.static.primitive import i16, i32, i32Timedelta

from kiproxy.protocol.framing import encode_request_header
from kiproxy.protocol.messages import ApiKey, request_type, serialize

VERSIONS = range(3, 14)
HEAD = b"\x00\x00\x00\x09\x00\x00\x00\x07\xff\xff\x00"  # a header stand-in: kept as is


def produce_types(version: int) -> tuple[Any, Any, Any]:
    request = request_type(ApiKey.PRODUCE, version)
    module = __import__(request.__module__, fromlist=["x"])
    return request, module.TopicProduceData, module.PartitionProduceData


def produce_frame(batch: bytes) -> bytes:
    """A Produce v9 request frame (correlation id 7, client id ``unit``, acks all) of
    ``batch`` for partition 0 of topic ``t``."""
    request_cls, topic_cls, part_cls = produce_types(9)
    request = request_cls(
        transactional_id=None, acks=i16(-1),
        timeout=i32Timedelta.parse(datetime.timedelta(seconds=30)),
        topic_data=(topic_cls(name="t", partition_data=(
            part_cls(index=i32(0), records=batch),)),))
    return encode_request_header(0, 9, 7, "unit", 2) + serialize(request)


@st.composite
def produce_requests(draw: st.DrawFn) -> tuple[int, Any]:
    version = draw(st.sampled_from(VERSIONS))
    request_cls, topic_cls, part_cls = produce_types(version)
    topics = []
    for _ in range(draw(st.integers(1, 4))):
        parts = tuple(
            part_cls(index=i32(draw(st.integers(0, 2**31 - 1))),
                     records=draw(st.one_of(st.none(), st.binary(max_size=300))))
            for _ in range(draw(st.integers(1, 4))))
        if version >= 13:
            topic = topic_cls(topic_id=uuid.UUID(int=draw(st.integers(0, 2**128 - 1))),
                              partition_data=parts)
        else:
            topic = topic_cls(name=draw(st.text(max_size=20)), partition_data=parts)
        topics.append(topic)
    request = request_cls(
        transactional_id=draw(st.one_of(st.none(), st.text(max_size=30))),
        acks=i16(draw(st.sampled_from((-1, 0, 1)))),
        timeout=i32Timedelta.parse(datetime.timedelta(milliseconds=draw(st.integers(0, 60000)))),
        topic_data=tuple(topics))
    return version, request


@st.composite
def edits_for(draw: st.DrawFn, partitions: Sequence[int], max_size: int = 400,
              stray: bool = False) -> dict[tuple[int, int], bytes | None]:
    """Edits of a request whose topic ``t`` holds ``partitions[t]`` partitions, keyed by
    ``(topic position, partition position)``: each partition kept, given new records
    (random bytes of up to ``max_size``) or removed (None); with ``stray``, maybe also
    a key naming no partition."""
    edits: dict[tuple[int, int], bytes | None] = {}
    for ti, count in enumerate(partitions):
        for pj in range(count):
            choice = draw(st.sampled_from(("keep", "keep", "replace", "drop")))
            if choice == "replace":
                edits[ti, pj] = draw(st.binary(max_size=max_size))
            elif choice == "drop":
                edits[ti, pj] = None
    if stray and draw(st.booleans()):  # a key naming no partition is never looked up
        edits[len(partitions), 0] = b"x"
    return edits
