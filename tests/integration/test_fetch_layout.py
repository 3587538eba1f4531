"""Fetch responses from real brokers read, split and spliced without decoding records.

On Tansu and on Apache Kafka (the ``upstream`` fixture): confluent-kafka writes one
partition with every codec (none, gzip, snappy, lz4, zstd), a transaction that aborts
and one that commits (so the log holds both markers); a raw Fetch request built with
kio (v4, v11, v12 with names; v13, v17 and, on Kafka, v18 with the topic id from
Metadata) reads it back. The layout agrees with kio's own parse, the records split into
whole batches whose headers name every codec and the control batches, a splice of the same bytes is
the same frame, and a re-encoded batch spliced in reads back at the same offsets. A
byte limit below the partition's size cuts the last batch on Kafka, which is kept as
sent (Tansu sends whole batches only, past the limit). Read committed, Kafka reports the
aborted transaction (Tansu reports none: an expected failure there).
"""

from __future__ import annotations

import datetime
import uuid
from dataclasses import dataclass
from typing import Any

import pytest
from conftest import Upstream, tansu_gap
from kio.static.primitive import i32Timedelta
from support.confluent import confluent_producer
from support.raw_client import RawClient

from kiproxy.protocol.batch_reencode import reencode_batch
from kiproxy.protocol.fetch_batches import split_fetched_records
from kiproxy.protocol.fetch_response import FetchLayout, read_fetch_response
from kiproxy.protocol.fetch_splice import splice_fetch_response
from kiproxy.protocol.framing import parse_response_header, response_header_version
from kiproxy.protocol.messages import ApiKey, parse_response, request_type
from kiproxy.protocol.records import Compression, decode_batch, decode_batches

CODECS = ("none", "gzip", "snappy", "lz4", "zstd")
VERSIONS = (4, 11, 12, 13, 17, 18)
TANSU_LATEST = 17  # Tansu 0.6 advertises Fetch 0-17
READ_COMMITTED = 1


@dataclass(frozen=True)
class Written:
    """What the module wrote: the topic, its id, and its offsets."""

    topic: str
    topic_id: uuid.UUID
    high_watermark: int
    aborted_first_offset: int


def _produce(bootstrap: str, topic: str, conf: dict[str, Any], values: list[bytes],
             transaction: str | None = None) -> None:
    producer = confluent_producer({"bootstrap.servers": bootstrap, "linger.ms": 50,
                                   "message.timeout.ms": 20000, **conf})
    if transaction is not None:
        producer.init_transactions(20)
        producer.begin_transaction()
    for value in values:
        producer.produce(topic, value=value, key=b"k", partition=0,
                         headers=[("h", b"1"), ("h", b"2")])
    if transaction == "abort":
        producer.flush(20)
        producer.abort_transaction(20)
    elif transaction == "commit":
        producer.commit_transaction(20)
    assert producer.flush(20) == 0


def _metadata_topic_id(client: RawClient, topic: str) -> uuid.UUID:
    cls = request_type(ApiKey.METADATA, 12)
    module = __import__(cls.__module__, fromlist=["x"])
    answer = client.request(ApiKey.METADATA, 12, cls(
        topics=(module.MetadataRequestTopic(topic_id=None, name=topic),),
        allow_auto_topic_creation=False, include_topic_authorized_operations=False))
    (found,) = answer.topics
    assert found.topic_id is not None
    return uuid.UUID(str(found.topic_id))


def _fetch_request(version: int, written: Written, max_bytes: int,
                   isolation_level: int = 0) -> Any:
    cls = request_type(ApiKey.FETCH, version)
    module = __import__(cls.__module__, fromlist=["x"])
    part = module.FetchPartition(partition=0, fetch_offset=0, partition_max_bytes=max_bytes)
    topic = (module.FetchTopic(topic_id=written.topic_id, partitions=(part,))
             if version >= 13 else module.FetchTopic(topic=written.topic, partitions=(part,)))
    kwargs: dict[str, Any] = {
        "max_wait": i32Timedelta.parse(datetime.timedelta(milliseconds=500)),
        "min_bytes": 1, "max_bytes": max_bytes, "isolation_level": isolation_level,
        "topics": (topic,)}
    if version >= 7:
        kwargs["forgotten_topics_data"] = ()
    return cls(**kwargs)


def _fetch(bootstrap: str, version: int, written: Written, max_bytes: int = 1 << 20,
           isolation_level: int = 0) -> tuple[bytes, int]:
    """The raw response frame (no size prefix) and where its body starts."""
    with RawClient(bootstrap) as client:
        client.send(client.frame(ApiKey.FETCH, version, 11,
                                 _fetch_request(version, written, max_bytes, isolation_level)))
        frame = client.recv_frame()
    header_version = response_header_version(ApiKey.FETCH, version)
    assert header_version is not None
    correlation_id, body = parse_response_header(frame, header_version)
    assert correlation_id == 11
    return frame, body


@pytest.fixture(scope="module")
def written(upstream: Upstream) -> Written:
    from confluent_kafka.admin import AdminClient, NewTopic

    topic = f"fetch-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": upstream.bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=1, replication_factor=1)],
                        operation_timeout=10)[topic].result(timeout=15)
    for codec in CODECS:
        _produce(upstream.bootstrap, topic, {"compression.type": codec},
                 [f"{codec} value {i} ".encode() * 20 for i in range(5)])
    before_abort = 25
    for outcome in ("abort", "commit"):
        _produce(upstream.bootstrap, topic,
                 {"transactional.id": f"tx-{uuid.uuid4().hex[:8]}", "compression.type": "lz4"},
                 [f"{outcome} {i}".encode() for i in range(3)], transaction=outcome)
    _produce(upstream.bootstrap, topic, {}, [b"after the transactions"])
    with RawClient(upstream.bootstrap) as client:
        topic_id = _metadata_topic_id(client, topic)
    # 25 records, 3 aborted + marker, 3 committed + marker, 1 more.
    return Written(topic, topic_id, 25 + 4 + 4 + 1, before_abort)


def _check_against_kio(frame: bytes, body: int, version: int, layout: FetchLayout) -> Any:
    parsed = parse_response(ApiKey.FETCH, version, frame, body)
    (topic,) = parsed.responses
    (expected,) = topic.partitions
    (part,) = layout.topics[0].partitions
    assert (part.partition, part.error_code, part.high_watermark) == (
        expected.partition_index, expected.error_code.value, expected.high_watermark)
    assert part.last_stable_offset == expected.last_stable_offset
    assert frame[part.data_start:part.data_end] == (expected.records or b"")
    return expected


@pytest.mark.parametrize("version", VERSIONS)
def test_layout_split_and_identity_splice(upstream: Upstream, written: Written,
                                          version: int) -> None:
    if upstream.name == "tansu" and version > TANSU_LATEST:
        pytest.skip(f"Tansu answers Fetch up to v{TANSU_LATEST}")
    frame, body = _fetch(upstream.bootstrap, version, written)
    layout = read_fetch_response(frame, body, version)
    _check_against_kio(frame, body, version, layout)
    (part,) = layout.topics[0].partitions
    assert part.error_code == 0 and part.high_watermark == written.high_watermark
    split = split_fetched_records(frame, part.data_start, part.data_end)
    assert not split.partial and not split.legacy
    headers = [b.header for b in split.batches if b.header is not None]
    codecs = {h.compression for h in headers if not h.is_control}
    assert codecs == set(Compression)
    assert sum(h.is_control for h in headers) == 2  # the abort and the commit markers
    assert headers[-1].base_offset + headers[-1].last_offset_delta + 1 == part.high_watermark
    assert splice_fetch_response(frame, body, version, {}) is frame
    same = {(0, 0): frame[part.data_start:part.data_end]}
    assert splice_fetch_response(frame, body, version, same, layout) == frame


@pytest.mark.parametrize("version", [4, 12, 17])
def test_a_reencoded_batch_spliced_in_keeps_every_offset(upstream: Upstream, written: Written,
                                                         version: int) -> None:
    frame, body = _fetch(upstream.bootstrap, version, written)
    layout = read_fetch_response(frame, body, version)
    (part,) = layout.topics[0].partitions
    split = split_fetched_records(frame, part.data_start, part.data_end)
    new_records = bytearray()
    for batch in split.batches:
        raw = bytes(frame[batch.start:batch.end])
        if batch.is_control:
            new_records += raw
            continue
        decoded = decode_batch(raw)
        new_records += reencode_batch(decoded, [r.with_value(b"sealed:" + (r.value or b""))
                                                for r in decoded.records])
    spliced = splice_fetch_response(frame, body, version, {(0, 0): bytes(new_records)}, layout)
    before = decode_batches(bytes(frame[part.data_start:part.data_end]))
    again = read_fetch_response(spliced, body, version)
    expected = _check_against_kio(spliced, body, version, again)
    after = decode_batches(expected.records)
    assert [(b.header.base_offset, b.header.last_offset_delta, b.header.producer_id,
             b.header.attributes) for b in after] == [
        (b.header.base_offset, b.header.last_offset_delta, b.header.producer_id,
         b.header.attributes) for b in before]
    for old, new in zip(before, after, strict=True):
        assert [(r.offset_delta, r.timestamp, r.key, r.headers) for r in new.records] == [
            (r.offset_delta, r.timestamp, r.key, r.headers) for r in old.records]
        if not old.header.is_control:
            assert all(n.value == b"sealed:" + (o.value or b"")
                       for o, n in zip(old.records, new.records, strict=True))


@pytest.mark.parametrize("version", [4, 12, 17])
def test_a_byte_limit_cuts_the_last_batch_which_is_kept_as_sent(
        upstream: Upstream, written: Written, version: int) -> None:
    full, full_body = _fetch(upstream.bootstrap, version, written)
    (whole,) = read_fetch_response(full, full_body, version).topics[0].partitions
    size = whole.data_end - whole.data_start
    frame, body = _fetch(upstream.bootstrap, version, written, max_bytes=size - 7)
    layout = read_fetch_response(frame, body, version)
    (part,) = layout.topics[0].partitions
    records = frame[part.data_start:part.data_end]
    assert records == full[whole.data_start:whole.data_start + len(records)]
    split = split_fetched_records(frame, part.data_start, part.data_end)
    every = split_fetched_records(full, whole.data_start, whole.data_end)
    assert [(b.start - split.start, b.header) for b in split.batches] == [
        (b.start - every.start, b.header) for b in every.batches[:len(split.batches)]]
    if upstream.name == "kafka":  # Kafka cuts at the byte, Tansu sends whole batches only
        assert split.partial and len(split.batches) == len(every.batches) - 1
        assert split.tail - split.start == every.batches[-1].start - every.start
    assert splice_fetch_response(frame, body, version,
                                 {(0, 0): bytes(records)}, layout) == frame


@pytest.mark.parametrize("version", [4, 12, 17])
def test_read_committed_reports_the_aborted_transaction(
        upstream: Upstream, written: Written, version: int, request: pytest.FixtureRequest) -> None:
    tansu_gap(upstream, request, "Fetch reports no aborted transactions (an empty array)")
    frame, body = _fetch(upstream.bootstrap, version, written, isolation_level=READ_COMMITTED)
    (part,) = read_fetch_response(frame, body, version).topics[0].partitions
    assert part.aborted_transactions is not None
    assert [a.first_offset for a in part.aborted_transactions] == [
        written.aborted_first_offset]
    assert part.last_stable_offset == written.high_watermark
