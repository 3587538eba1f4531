"""Golden ProduceRequest frames captured from confluent-kafka (librdkafka) against Tansu.

``tests/fixtures/golden/produce_<codec>.bin`` are whole request frames (without the
length prefix) as an idempotent producer sent them, one per codec; the JSON sidecars
say what was produced. Regenerate them with ``tests/fixtures/capture_golden.py``.

For every frame: the request header and Produce body parse, the records decode to
exactly what was produced, re-encoding a batch keeps every header field and every
record, re-serializing the body gives the original bytes, and for the uncompressed
frame re-encoding gives the original batch bytes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kiproxy.protocol.compression import XERIAL_MAGIC, Compression
from kiproxy.protocol.framing import encode_request_header, parse_request_header
from kiproxy.protocol.messages import parse_request, serialize
from kiproxy.protocol.records import (
    BATCH_HEADER_SIZE,
    DecodedBatch,
    RecordBatchHeader,
    decode_batches,
    encode_batch,
)

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden"
CODECS = ("none", "gzip", "snappy", "lz4", "zstd")
CODEC_IDS = {"none": Compression.NONE, "gzip": Compression.GZIP,
             "snappy": Compression.SNAPPY, "lz4": Compression.LZ4, "zstd": Compression.ZSTD}

RecordTuple = tuple[bytes | None, bytes | None, tuple[tuple[str, bytes | None], ...], int]


@dataclass(frozen=True)
class Golden:
    """One captured frame and what its sidecar says was produced."""

    codec: str
    frame: bytes
    meta: dict[str, Any]

    @property
    def expected(self) -> list[RecordTuple]:
        """The produced records as ``(key, value, headers, timestamp)``."""

        def unhex(v: str | None) -> bytes | None:
            return None if v is None else bytes.fromhex(v)

        return [
            (unhex(r["key"]), unhex(r["value"]),
             tuple((k, unhex(v)) for k, v in r["headers"]), r["timestamp"])
            for r in self.meta["records"]
        ]


def _load(codec: str) -> Golden:
    frame = (GOLDEN / f"produce_{codec}.bin").read_bytes()
    meta = json.loads((GOLDEN / f"produce_{codec}.json").read_text())
    return Golden(codec, frame, meta)


@pytest.fixture(params=CODECS)
def golden(request: pytest.FixtureRequest) -> Golden:
    """Each captured frame in turn."""
    return _load(request.param)


def _parse(g: Golden) -> tuple[int, Any]:
    header = parse_request_header(g.frame)
    assert header.body_offset is not None
    return header.body_offset, parse_request(header.api_key, header.api_version, g.frame,
                                             header.body_offset)


def _batches(g: Golden) -> list[DecodedBatch]:
    _, body = _parse(g)
    out: list[DecodedBatch] = []
    for topic in body.topic_data:
        for partition in topic.partition_data:
            assert partition.records is not None
            out += decode_batches(partition.records)
    return out


def _as_tuples(batches: list[DecodedBatch]) -> list[RecordTuple]:
    return [
        (r.key, r.value, tuple((h.key, h.value) for h in r.headers), r.timestamp)
        for b in batches
        for r in b.records
    ]


def _header_fields(h: RecordBatchHeader) -> dict[str, int]:
    """Every header field that must survive a re-encode (batch length and CRC may not)."""
    return {
        "base_offset": h.base_offset,
        "partition_leader_epoch": h.partition_leader_epoch,
        "attributes": h.attributes,
        "last_offset_delta": h.last_offset_delta,
        "base_timestamp": h.base_timestamp,
        "max_timestamp": h.max_timestamp,
        "producer_id": h.producer_id,
        "producer_epoch": h.producer_epoch,
        "base_sequence": h.base_sequence,
        "record_count": h.record_count,
    }


def test_fixture_covers_the_edge_cases() -> None:
    """The produced records include null/empty keys and values, duplicate and null headers."""
    expected = _load("none").expected
    assert len(expected) >= 20
    assert any(k is None for k, _, _, _ in expected)
    assert any(k == b"" for k, _, _, _ in expected)
    assert any(v is None for _, v, _, _ in expected)
    assert any(v is None for _, _, hs, _ in expected for _, v in hs)
    assert any(len({k for k, _ in hs}) < len(hs) for _, _, hs, _ in expected)
    for codec in CODECS:
        assert _load(codec).expected == expected


def test_request_header(golden: Golden) -> None:
    """The frame is a Produce request at the version the sidecar names."""
    header = parse_request_header(golden.frame)
    assert header.api_key == 0 == golden.meta["api_key"]
    assert header.api_version == golden.meta["api_version"]
    assert header.api_version >= 3
    assert header.header_version == (2 if header.api_version >= 9 else 1)
    assert header.body_offset is not None
    rebuilt = encode_request_header(header.api_key, header.api_version, header.correlation_id,
                                    header.client_id, header.header_version)
    assert golden.frame[: header.body_offset] == rebuilt


def test_body_reserializes_to_the_same_bytes(golden: Golden) -> None:
    """serialize(parse(body)) == body, byte for byte."""
    offset, body = _parse(golden)
    assert body.transactional_id is None
    (topic,) = body.topic_data
    assert topic.name == golden.meta["topic"]
    (partition,) = topic.partition_data
    assert partition.index == golden.meta["partition"]
    assert serialize(body) == golden.frame[offset:]


def test_records_are_what_was_produced(golden: Golden) -> None:
    """Keys, values, headers (order, duplicates, nulls) and timestamps all match."""
    batches = _batches(golden)
    assert _as_tuples(batches) == golden.expected


def test_batch_header_fields(golden: Golden) -> None:
    """Codec bits, idempotent producer fields and the counts are what the producer sets."""
    batches = _batches(golden)
    offset_total = 0
    for batch in batches:
        h = batch.header
        assert h.compression is CODEC_IDS[golden.codec]
        assert h.producer_id >= 0  # enable.idempotence=true
        assert h.producer_epoch >= 0
        assert h.base_sequence >= 0
        assert not h.is_transactional and not h.is_control
        assert h.timestamp_type == 0
        assert h.record_count == len(batch.records) == h.last_offset_delta + 1
        assert [r.offset_delta for r in batch.records] == list(range(h.record_count))
        assert h.max_timestamp == max(r.timestamp for r in batch.records)
        assert h.base_timestamp == batch.records[0].timestamp
        assert h.batch_length == len(batch.raw) - 12
        offset_total += h.record_count
    assert offset_total == len(golden.expected)


def test_reencode_keeps_every_field_and_record(golden: Golden) -> None:
    """encode_batch(header, records) decodes back to the same header fields and records."""
    for batch in _batches(golden):
        encoded = encode_batch(batch.header, batch.records)
        (again,) = decode_batches(encoded)
        assert _header_fields(again.header) == _header_fields(batch.header)
        assert again.header.compression is CODEC_IDS[golden.codec]
        assert again.records == batch.records
        assert _as_tuples([again]) == _as_tuples([batch])
        if golden.codec == "snappy":  # librdkafka may send raw snappy; we write Xerial framing
            assert encoded[BATCH_HEADER_SIZE:].startswith(XERIAL_MAGIC)


def test_uncompressed_reencode_is_byte_identical() -> None:
    """Without compression, re-encoding a batch reproduces the client's bytes exactly."""
    g = _load("none")
    batches = _batches(g)
    assert batches
    for batch in batches:
        assert encode_batch(batch.header, batch.records) == batch.raw
    _, body = _parse(g)
    (partition,) = body.topic_data[0].partition_data
    assert b"".join(encode_batch(b.header, b.records) for b in batches) == partition.records
