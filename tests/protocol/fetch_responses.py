"""Random Fetch v4-v18 responses (kio messages) for the layout and splice tests.

``fetch_responses()`` draws a version and a response of zero to three topics (names
before v13, ids from v13), each with one to three partitions whose every field is
drawn: error code, offsets, aborted transactions (null, empty or some), preferred read
replica (v11+), the tagged ``diverging_epoch``, ``current_leader`` and ``snapshot_id``
(v12+, each present or left at its default, which kio then leaves out), the response's
``node_endpoints`` (v16+), and records that are null, empty, random bytes or real
batches. ``head(version)`` stands in for the response header.
"""

from __future__ import annotations

import dataclasses
import datetime
import typing
from typing import Any

from hypothesis import strategies as st
from kio.schema.errors import ErrorCode
from kio.static.primitive import i32Timedelta

from kiproxy.protocol.messages import ApiKey, response_type
from kiproxy.protocol.records import Compression, Record, build_batch

VERSIONS = range(4, 19)
ERRORS = (ErrorCode.none, ErrorCode.offset_out_of_range, ErrorCode.not_leader_or_follower,
          ErrorCode.fenced_leader_epoch, ErrorCode.unknown_topic_id)

_I32 = st.integers(-(2**31), 2**31 - 1)
_I64 = st.integers(-(2**63), 2**63 - 1)


def head(version: int) -> bytes:
    """A response header: the correlation id, and an empty tagged section from v12."""
    return b"\x00\x00\x00\x07" + (b"\x00" if version >= 12 else b"")


def fetch_types(version: int) -> Any:
    """The module of kio's Fetch response classes for ``version``."""
    return __import__(response_type(ApiKey.FETCH, version).__module__, fromlist=["x"])


def field_names(cls: Any) -> set[str]:
    return {f.name for f in dataclasses.fields(cls)}


@st.composite
def batches(draw: st.DrawFn) -> bytes:
    """One to three real record batches, the last one maybe cut short."""
    out = b""
    offset = draw(st.integers(0, 2**40))
    for _ in range(draw(st.integers(1, 3))):
        n = draw(st.integers(1, 4))
        records = [Record(key=draw(st.one_of(st.none(), st.binary(max_size=8))),
                          value=draw(st.binary(max_size=30)), timestamp=1_700_000_000_000 + i,
                          headers=[("h", b"x")] if i % 2 else ())
                   for i in range(n)]
        out += build_batch(records, base_offset=offset,
                           compression=draw(st.sampled_from(list(Compression))),
                           control=draw(st.booleans()) and n == 1)
        offset += n
    if draw(st.booleans()):
        out = out[:draw(st.integers(1, len(out)))]
    return out


def records_field() -> st.SearchStrategy[bytes | None]:
    return st.one_of(st.none(), st.just(b""), st.binary(max_size=200), batches())


@st.composite
def partitions(draw: st.DrawFn, version: int) -> Any:
    types = fetch_types(version)
    cls = types.PartitionData
    names = field_names(cls)
    aborted = draw(st.one_of(st.none(), st.lists(
        st.builds(lambda p, o: types.AbortedTransaction(producer_id=p, first_offset=o),
                  _I64, _I64), max_size=3).map(tuple)))
    kw: dict[str, Any] = dict(
        partition_index=draw(_I32), error_code=draw(st.sampled_from(ERRORS)),
        high_watermark=draw(_I64), last_stable_offset=draw(_I64),
        aborted_transactions=aborted, records=draw(records_field()))
    if "log_start_offset" in names:
        kw["log_start_offset"] = draw(_I64)
    if "preferred_read_replica" in names:
        kw["preferred_read_replica"] = draw(_I32)
    if "diverging_epoch" in names:
        if draw(st.booleans()):
            kw["diverging_epoch"] = types.EpochEndOffset(epoch=draw(_I32), end_offset=draw(_I64))
        if draw(st.booleans()):
            kw["current_leader"] = types.LeaderIdAndEpoch(leader_id=draw(_I32),
                                                          leader_epoch=draw(_I32))
        if draw(st.booleans()):
            kw["snapshot_id"] = types.SnapshotId(end_offset=draw(_I64), epoch=draw(_I32))
    return cls(**kw)


@st.composite
def fetch_responses(draw: st.DrawFn, versions: typing.Sequence[int] = VERSIONS
                    ) -> tuple[int, Any]:
    version = draw(st.sampled_from(versions))
    types = fetch_types(version)
    topics = []
    for _ in range(draw(st.integers(0, 3))):
        parts = tuple(draw(partitions(version)) for _ in range(draw(st.integers(1, 3))))
        if version >= 13:
            topic = types.FetchableTopicResponse(
                topic_id=draw(st.one_of(st.none(), st.uuids())),
                partitions=parts)
        else:
            topic = types.FetchableTopicResponse(topic=draw(st.text(max_size=20)),
                                                 partitions=parts)
        topics.append(topic)
    cls = types.FetchResponse
    names = field_names(cls)
    kw: dict[str, Any] = dict(
        throttle_time=i32Timedelta.parse(datetime.timedelta(
            milliseconds=draw(st.integers(0, 2**31 - 1)))),
        responses=tuple(topics))
    if "error_code" in names:
        kw["error_code"] = draw(st.sampled_from(ERRORS))
        kw["session_id"] = draw(_I32)
    if "node_endpoints" in names and draw(st.booleans()):
        kw["node_endpoints"] = tuple(
            types.NodeEndpoint(node_id=draw(_I32), host=draw(st.text(max_size=10)),
                               port=draw(st.integers(0, 65535)),
                               rack=draw(st.one_of(st.none(), st.text(max_size=5))))
            for _ in range(draw(st.integers(1, 2))))
    return version, cls(**kw)
