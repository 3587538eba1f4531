"""Produce v0-v2 (the old message format), read only far enough to refuse it.

The schemas we ship start at Produce v3. A v0-v2 request carries magic 0/1
message sets, which the proxy cannot hand to an interceptor, so it answers
every partition with an error instead of forwarding data unchecked. This module
reads the topic/partition list of such a request and writes the v0-v2 answer.
"""

from __future__ import annotations

import struct

from kiproxy.protocol.errors import MalformedMessage
from kiproxy.protocol.wire import ByteReader

__all__ = ["legacy_produce_acks_and_partitions", "legacy_produce_error_response"]

_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")


def legacy_produce_acks_and_partitions(
    frame: bytes, body_offset: int
) -> tuple[int, list[tuple[str, list[int]]]]:
    """``(acks, [(topic, [partition, ...]), ...])`` of a Produce v0-v2 request body."""
    r = ByteReader(frame, body_offset, context="Produce v0-v2 request: ")
    acks = r.i16("acks")
    r.i32("timeout")
    topics = []
    n_topics = r.i32("topic count")
    if n_topics < 0 or n_topics > len(frame):
        raise MalformedMessage(f"Produce v0-v2 request: topic count {n_topics} is impossible")
    for _ in range(n_topics):
        name = r.take(r.i16("topic name length"), "topic name").decode("utf-8", "replace")
        parts = []
        n_parts = r.i32("partition count")
        if n_parts < 0 or n_parts > len(frame):
            raise MalformedMessage(
                f"Produce v0-v2 request: partition count {n_parts} is impossible"
            )
        for _ in range(n_parts):
            parts.append(r.i32("partition index"))
            size = r.i32("message set size")
            r.skip(max(size, 0), "message set")
        topics.append((name, parts))
    return acks, topics


def legacy_produce_error_response(
    api_version: int, topics: list[tuple[str, list[int]]], error_code: int
) -> bytes:
    """A Produce v0-v2 response body answering every partition with ``error_code``."""
    out = [_I32.pack(len(topics))]
    for name, parts in topics:
        raw = name.encode()
        out.append(_I16.pack(len(raw)) + raw + _I32.pack(len(parts)))
        for index in parts:
            out.append(_I32.pack(index) + _I16.pack(error_code) + struct.pack(">q", -1))
            if api_version >= 2:
                out.append(struct.pack(">q", -1))  # log_append_time
    if api_version >= 1:
        out.append(_I32.pack(0))  # throttle_time_ms
    return b"".join(out)
