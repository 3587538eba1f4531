"""Record batches (magic 2): what goes in comes back out, field for field and byte for byte.

The batches here are generated (hypothesis) across the whole space the wire format
allows: any base offset, leader epoch, producer id/epoch/sequence, timestamp type,
transactional and control bits, null and empty keys, values and header values,
repeated header keys, negative timestamp deltas, several batches back to back, and
every codec. A small reference encoder written from the protocol guide (and a
bit-by-bit CRC-32C) checks that our bytes are the spec's bytes, not merely bytes
our own decoder agrees with.
"""

from __future__ import annotations

import random
import struct
from dataclasses import dataclass

import cramjam
import pytest
import snappy as python_snappy
from crc32c import crc32c
from hypothesis import given, settings
from hypothesis import strategies as st

from kiproxy.protocol.compression import (
    XERIAL_MAGIC,
    Compression,
    DecompressionLimits,
    compress,
    decompress,
)
from kiproxy.protocol.errors import CorruptBatch
from kiproxy.protocol.records import (
    BATCH_HEADER_SIZE,
    DEFAULT_DECOMPRESSION_LIMITS,
    DecodedBatch,
    Header,
    Record,
    RecordBatchHeader,
    TimestampType,
    build_batch,
    decode_batch,
    decode_batches,
    decompress_block,
    encode_batch,
    read_batch_headers,
)

CODECS = tuple(Compression)
INT64 = st.integers(-(2**63), 2**63 - 1)
INT32 = st.integers(-(2**31), 2**31 - 1)
INT16 = st.integers(-(2**15), 2**15 - 1)
# Record timestamps are base + delta; both halves are kept small enough that the sum
# is an int64, as it is on the wire.
TIMESTAMP = st.integers(-(2**62), 2**62 - 1)
NULLABLE_BYTES = st.none() | st.binary(max_size=48)
# A few fixed keys make repeated header keys common; arbitrary text covers UTF-8.
HEADER_KEY = st.sampled_from(["trace-id", "a", "", "ключ", "🔑"]) | st.text(max_size=12)

TIMESTAMP_TYPE_BIT = 0x08
TRANSACTIONAL_BIT = 0x10
CONTROL_BIT = 0x20
DELETE_HORIZON_BIT = 0x40


# ------------------------------------------------------------- reference encoding


def _crc32c_table() -> list[int]:
    table = []
    for n in range(256):
        c = n
        for _ in range(8):
            c = (c >> 1) ^ 0x82F63B78 if c & 1 else c >> 1
        table.append(c)
    return table


_CRC_TABLE = _crc32c_table()


def reference_crc32c(data: bytes) -> int:
    """CRC-32C (Castagnoli), reflected, the checksum Kafka puts in a batch header."""
    crc = 0xFFFFFFFF
    for byte in data:
        crc = _CRC_TABLE[(crc ^ byte) & 0xFF] ^ (crc >> 8)
    return crc ^ 0xFFFFFFFF


def uvarint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def varint(n: int) -> bytes:
    """Kafka's zigzag varint/varlong."""
    return uvarint((n << 1) ^ (n >> 63))


def _nullable(b: bytes | None) -> bytes:
    return varint(-1) if b is None else varint(len(b)) + b


def reference_record(record: Record, base_timestamp: int) -> bytes:
    """One record exactly as the protocol guide lays it out."""
    body = b"".join(
        [
            b"\x00",  # record attributes
            varint(record.timestamp - base_timestamp),
            varint(record.offset_delta),
            _nullable(record.key),
            _nullable(record.value),
            varint(len(record.headers)),
            *(varint(len(h.key.encode())) + h.key.encode() + _nullable(h.value)
              for h in record.headers),
        ]
    )
    return varint(len(body)) + body


@dataclass(frozen=True)
class BatchSpec:
    """Everything that defines one batch; the batch bytes follow from it."""

    base_offset: int
    partition_leader_epoch: int
    attributes: int
    base_timestamp: int
    max_timestamp: int
    producer_id: int
    producer_epoch: int
    base_sequence: int
    last_offset_delta: int
    records: tuple[Record, ...]

    @property
    def codec(self) -> Compression:
        return Compression(self.attributes & 0x07)

    def header(self) -> RecordBatchHeader:
        """A header to hand to ``encode_batch`` (length and CRC are recomputed)."""
        return RecordBatchHeader(
            base_offset=self.base_offset, batch_length=0,
            partition_leader_epoch=self.partition_leader_epoch, crc=0,
            attributes=self.attributes, last_offset_delta=self.last_offset_delta,
            base_timestamp=self.base_timestamp, max_timestamp=self.max_timestamp,
            producer_id=self.producer_id, producer_epoch=self.producer_epoch,
            base_sequence=self.base_sequence, record_count=len(self.records),
        )

    def records_block(self) -> bytes:
        return b"".join(reference_record(r, self.base_timestamp) for r in self.records)

    def reference_bytes(self, compressed_block: bytes | None = None) -> bytes:
        """The batch per the spec; ``compressed_block`` replaces the records block."""
        block = self.records_block() if compressed_block is None else compressed_block
        after_crc = struct.pack(
            ">hiqqqhii", self.attributes, self.last_offset_delta, self.base_timestamp,
            self.max_timestamp, self.producer_id, self.producer_epoch, self.base_sequence,
            len(self.records),
        )
        crc = reference_crc32c(after_crc + block)
        prefix = struct.pack(">qiibI", self.base_offset, 49 + len(block),
                             self.partition_leader_epoch, 2, crc)
        return prefix + after_crc + block


def assert_header_matches(header: RecordBatchHeader, spec: BatchSpec, data: bytes) -> None:
    assert header.base_offset == spec.base_offset
    assert header.partition_leader_epoch == spec.partition_leader_epoch
    assert header.attributes == spec.attributes
    assert header.compression is spec.codec
    assert header.timestamp_type == (1 if spec.attributes & TIMESTAMP_TYPE_BIT else 0)
    assert header.is_transactional == bool(spec.attributes & TRANSACTIONAL_BIT)
    assert header.is_control == bool(spec.attributes & CONTROL_BIT)
    assert header.has_delete_horizon == bool(spec.attributes & DELETE_HORIZON_BIT)
    assert header.last_offset_delta == spec.last_offset_delta
    assert header.base_timestamp == spec.base_timestamp
    assert header.max_timestamp == spec.max_timestamp
    assert header.producer_id == spec.producer_id
    assert header.producer_epoch == spec.producer_epoch
    assert header.base_sequence == spec.base_sequence
    assert header.record_count == len(spec.records)
    assert header.batch_length == len(data) - 12


def assert_crc_valid(data: bytes) -> None:
    """The declared CRC is CRC-32C over attributes..end, by two implementations."""
    (declared,) = struct.unpack_from(">I", data, 17)
    assert declared == crc32c(data[21:])
    if len(data) < 4096:  # the pure-Python reference is slow on big batches
        assert declared == reference_crc32c(data[21:])


# ------------------------------------------------------------- strategies


@st.composite
def headers(draw: st.DrawFn) -> tuple[Header, ...]:
    pairs = draw(st.lists(st.tuples(HEADER_KEY, NULLABLE_BYTES), max_size=4))
    return tuple(Header(k, v) for k, v in pairs)


@st.composite
def batch_specs(draw: st.DrawFn, codec: Compression | None = None,
                max_records: int = 8) -> BatchSpec:
    codec = draw(st.sampled_from(CODECS)) if codec is None else codec
    base_timestamp = draw(TIMESTAMP)
    n = draw(st.integers(0, max_records))
    offsets = draw(st.lists(INT32, min_size=n, max_size=n)
                   | st.just(list(range(n))))
    records = tuple(
        Record(
            key=draw(NULLABLE_BYTES), value=draw(NULLABLE_BYTES), headers=draw(headers()),
            timestamp=base_timestamp + draw(TIMESTAMP), offset_delta=offsets[i],
        )
        for i in range(n)
    )
    attributes = int(codec)
    for bit in (TIMESTAMP_TYPE_BIT, TRANSACTIONAL_BIT, CONTROL_BIT, DELETE_HORIZON_BIT):
        if draw(st.booleans()):
            attributes |= bit
    log_append = bool(attributes & TIMESTAMP_TYPE_BIT)
    # CreateTime batches carry the largest record timestamp; LogAppendTime and empty
    # batches carry whatever the header said.
    max_timestamp = (max(r.timestamp for r in records) if records and not log_append
                     else draw(INT64))
    # The encoder derives lastOffsetDelta from the last record; an empty batch keeps it.
    last_offset_delta = records[-1].offset_delta if records else draw(INT32)
    return BatchSpec(
        base_offset=draw(INT64), partition_leader_epoch=draw(INT32), attributes=attributes,
        base_timestamp=base_timestamp, max_timestamp=max_timestamp,
        producer_id=draw(INT64), producer_epoch=draw(INT16), base_sequence=draw(INT32),
        last_offset_delta=last_offset_delta, records=records,
    )


def encode(spec: BatchSpec) -> bytes:
    return encode_batch(spec.header(), spec.records, renumber=False)


# ------------------------------------------------------------- round trips


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name.lower())
@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_every_field_survives_a_round_trip(codec: Compression, data: st.DataObject) -> None:
    spec = data.draw(batch_specs(codec))
    encoded = encode(spec)

    assert_crc_valid(encoded)
    decoded = decode_batch(encoded)
    assert_header_matches(decoded.header, spec, encoded)
    assert decoded.records == spec.records
    for got, want in zip(decoded.records, spec.records, strict=True):
        # Record equality is field-wise; spell out the two that are easiest to lose.
        assert [h.key for h in got.headers] == [h.key for h in want.headers]
        assert (got.key is None) == (want.key is None)
    assert decoded.raw == encoded


@settings(max_examples=150, deadline=None)
@given(spec=batch_specs(Compression.NONE))
def test_uncompressed_encoding_is_the_spec_encoding(spec: BatchSpec) -> None:
    encoded = encode(spec)
    assert encoded == spec.reference_bytes()


@settings(max_examples=150, deadline=None)
@given(spec=batch_specs(Compression.NONE))
def test_unchanged_uncompressed_batch_reencodes_to_identical_bytes(spec: BatchSpec) -> None:
    original = spec.reference_bytes()
    decoded = decode_batch(original)
    assert encode_batch(decoded.header, decoded.records, renumber=False) == original
    if [r.offset_delta for r in decoded.records] == list(range(len(decoded.records))):
        # A producer's batch (deltas 0..n-1) also survives the produce path's renumbering.
        assert encode_batch(decoded.header, decoded.records, renumber=True) == original


@pytest.mark.parametrize("codec", CODECS[1:], ids=lambda c: c.name.lower())
@settings(max_examples=40, deadline=None)
@given(data=st.data())
def test_compressed_records_block_is_the_spec_block(codec: Compression,
                                                    data: st.DataObject) -> None:
    spec = data.draw(batch_specs(codec))
    encoded = encode(spec)
    block = decompress(codec, encoded[BATCH_HEADER_SIZE:], 1 << 24)
    assert block == spec.records_block()
    assert encoded == spec.reference_bytes(compressed_block=encoded[BATCH_HEADER_SIZE:])


@settings(max_examples=60, deadline=None)
@given(specs=st.lists(batch_specs(max_records=4), min_size=1, max_size=5))
def test_several_batches_in_one_partition_records(specs: list[BatchSpec]) -> None:
    parts = [encode(s) for s in specs]
    data = b"".join(parts)

    decoded = decode_batches(data)
    assert len(decoded) == len(specs)
    for batch, spec, part in zip(decoded, specs, parts, strict=True):
        assert_header_matches(batch.header, spec, part)
        assert batch.records == spec.records
        assert batch.raw == part
    assert [h.base_offset for h in read_batch_headers(data)] == [s.base_offset for s in specs]
    assert read_batch_headers(data) == [b.header for b in decoded]


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name.lower())
def test_large_batch_round_trips_and_really_is_compressed(codec: Compression) -> None:
    rng = random.Random(7)
    words = [bytes(rng.choice(b"abcdefghij") for _ in range(rng.randint(3, 9)))
             for _ in range(200)]
    records = [
        Record(key=f"key-{i}".encode(), value=b" ".join(rng.choices(words, k=60)),
               headers=[("seq", str(i).encode()), ("seq", None)], timestamp=1_700_000_000_000 + i)
        for i in range(2_000)
    ]
    encoded = build_batch(records, compression=codec, producer_id=9, producer_epoch=2,
                          base_sequence=100)
    [decoded] = decode_batches(encoded)
    assert decoded.records == tuple(r.with_offset_delta(i) for i, r in enumerate(records))
    assert decoded.header.compression is codec
    block_size = len(b"".join(reference_record(r.with_offset_delta(i), records[0].timestamp)
                              for i, r in enumerate(records)))
    if codec is Compression.NONE:
        assert len(encoded) == BATCH_HEADER_SIZE + block_size
    else:
        assert len(encoded) < BATCH_HEADER_SIZE + block_size // 2
    assert_crc_valid(encoded)


# ------------------------------------------------------------- producer-side facts


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name.lower())
def test_build_batch_writes_what_an_idempotent_producer_writes(codec: Compression) -> None:
    records = [Record(value=b"x", timestamp=1_000), Record(value=b"y", timestamp=999),
               Record(value=b"z", timestamp=1_005)]
    encoded = build_batch(records, compression=codec, producer_id=4242, producer_epoch=3,
                          base_sequence=17, transactional=True)
    header = decode_batch(encoded).header
    assert header.base_offset == 0
    assert header.partition_leader_epoch == -1
    assert header.producer_id == 4242
    assert header.producer_epoch == 3
    assert header.base_sequence == 17
    assert header.is_transactional and not header.is_control
    assert header.record_count == 3
    assert header.last_offset_delta == 2  # count - 1, or the broker's sequence check fails
    assert header.base_timestamp == 1_000
    assert header.max_timestamp == 1_005  # recomputed from the records (CreateTime)
    assert header.timestamp_type == TimestampType.CREATE_TIME


def test_renumbering_rewrites_offset_deltas_and_last_offset_delta() -> None:
    records = tuple(Record(value=bytes([i]), timestamp=5, offset_delta=10 * i + 3)
                    for i in range(4))
    original = decode_batch(build_batch(records)).header
    encoded = encode_batch(original, records, renumber=True)
    decoded = decode_batch(encoded)
    assert [r.offset_delta for r in decoded.records] == [0, 1, 2, 3]
    assert decoded.header.last_offset_delta == 3
    kept = decode_batch(encode_batch(original, records, renumber=False))
    assert [r.offset_delta for r in kept.records] == [3, 13, 23, 33]
    assert kept.header.last_offset_delta == 33


def test_log_append_time_keeps_the_declared_max_timestamp() -> None:
    records = [Record(value=b"a", timestamp=10), Record(value=b"b", timestamp=20)]
    encoded = build_batch(records, timestamp_type=TimestampType.LOG_APPEND_TIME,
                          base_timestamp=10, max_timestamp=12345)
    header = decode_batch(encoded).header
    assert header.timestamp_type == TimestampType.LOG_APPEND_TIME
    assert header.max_timestamp == 12345


def test_create_time_max_timestamp_is_recomputed_after_a_change() -> None:
    decoded = decode_batch(build_batch([Record(value=b"a", timestamp=10)]))
    changed = (decoded.records[0].with_timestamp(1_700_000_000_123),)
    header = decode_batch(encode_batch(decoded.header, changed)).header
    assert header.max_timestamp == 1_700_000_000_123
    assert header.base_timestamp == 10  # kept; the record carries the delta


def test_compression_override_changes_only_the_codec_bits() -> None:
    original = decode_batch(build_batch([Record(value=b"v" * 500, timestamp=1)],
                                        transactional=True, producer_id=1, producer_epoch=0,
                                        base_sequence=0))
    for codec in CODECS:
        encoded = encode_batch(original.header, original.records, compression=codec)
        decoded = decode_batch(encoded)
        assert decoded.header.compression is codec
        assert decoded.header.attributes & ~0x07 == original.header.attributes & ~0x07
        assert decoded.records == original.records


def test_millisecond_timestamps_are_never_rounded() -> None:
    stamps = [1_700_000_000_001, 1_700_000_000_999, 1_699_999_999_999, 2**62, -(2**62)]
    records = [Record(value=b"t", timestamp=t) for t in stamps]
    decoded = decode_batch(build_batch(records, base_timestamp=0))
    assert [r.timestamp for r in decoded.records] == stamps


# ------------------------------------------------------------- nulls, empties, headers


def test_null_and_empty_keys_values_and_header_values_are_distinct() -> None:
    records = [
        Record(key=None, value=None, headers=[("h", None)]),
        Record(key=b"", value=b"", headers=[("h", b"")]),
        Record(key=b"k", value=None),
        Record(key=None, value=b""),
    ]
    decoded = decode_batch(build_batch(records)).records
    assert [(r.key, r.value) for r in decoded] == [(None, None), (b"", b""), (b"k", None),
                                                   (None, b"")]
    assert decoded[0].headers == (Header("h", None),)
    assert decoded[1].headers == (Header("h", b""),)
    assert Record(key=b"") != Record(key=None)
    assert Header("h", b"") != Header("h", None)


def test_repeated_header_keys_keep_their_order() -> None:
    hdrs = [("x", b"1"), ("y", b"2"), ("x", None), ("x", b"3"), ("y", b"")]
    [record] = decode_batch(build_batch([Record(value=b"v", headers=hdrs)])).records
    assert [tuple(h) for h in record.headers] == hdrs
    assert record.header_values("x") == [b"1", None, b"3"]
    assert record.header_values("y") == [b"2", b""]


# ------------------------------------------------------------- control and empty batches


def _control_record(commit: bool, coordinator_epoch: int) -> Record:
    # Control record key: version int16, type int16 (0 abort, 1 commit);
    # value: version int16, coordinator epoch int32.
    return Record(key=struct.pack(">hh", 0, 1 if commit else 0),
                  value=struct.pack(">hi", 0, coordinator_epoch), timestamp=1_234)


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "abort"])
def test_control_batch_with_a_transaction_marker(commit: bool) -> None:
    encoded = build_batch([_control_record(commit, 77)], control=True, transactional=True,
                          producer_id=31, producer_epoch=4, base_offset=1_000,
                          partition_leader_epoch=6)
    assert_crc_valid(encoded)
    decoded = decode_batch(encoded)
    assert decoded.header.is_control and decoded.header.is_transactional
    assert decoded.header.base_offset == 1_000
    assert decoded.header.partition_leader_epoch == 6
    [marker] = decoded.records
    assert marker.key is not None and marker.value is not None
    assert struct.unpack(">hh", marker.key) == (0, 1 if commit else 0)
    assert struct.unpack(">hi", marker.value) == (0, 77)
    # A control batch survives re-encoding byte for byte.
    assert encode_batch(decoded.header, decoded.records) == encoded


@pytest.mark.parametrize("codec", CODECS, ids=lambda c: c.name.lower())
def test_empty_batch(codec: Compression) -> None:
    encoded = build_batch([], compression=codec, producer_id=8, producer_epoch=1,
                          base_sequence=5)
    assert_crc_valid(encoded)
    decoded = decode_batch(encoded)
    assert decoded.records == ()
    assert decoded.header.record_count == 0
    assert decoded.header.compression is codec
    assert decoded.header.producer_id == 8
    reencoded = encode_batch(decoded.header, decoded.records)
    assert decode_batch(reencoded).header == decoded.header
    if codec is Compression.NONE:
        assert len(encoded) == BATCH_HEADER_SIZE
        assert reencoded == encoded


def test_decoded_batch_is_immutable() -> None:
    decoded = decode_batch(build_batch([Record(value=b"v")]))
    assert isinstance(decoded, DecodedBatch)
    with pytest.raises(AttributeError):
        decoded.records = ()  # type: ignore[misc]
    with pytest.raises(AttributeError):
        decoded.records[0].value = b"w"  # type: ignore[misc]


# ------------------------------------------------------------- snappy framing


def _snappy_batch(block: bytes, records: list[Record]) -> bytes:
    spec = BatchSpec(base_offset=0, partition_leader_epoch=-1, attributes=int(Compression.SNAPPY),
                     base_timestamp=records[0].timestamp,
                     max_timestamp=max(r.timestamp for r in records), producer_id=-1,
                     producer_epoch=-1, base_sequence=-1,
                     last_offset_delta=len(records) - 1, records=tuple(records))
    return spec.reference_bytes(compressed_block=block)


def _snappy_records() -> tuple[list[Record], bytes]:
    records = [Record(key=str(i).encode(), value=(b"snappy %d " % i) * (i % 50 + 1),
                      headers=[("n", str(i).encode())], timestamp=1_000 + i, offset_delta=i)
               for i in range(600)]
    block = b"".join(reference_record(r, 1_000) for r in records)
    assert len(block) > 3 * 32 * 1024  # several xerial blocks
    return records, block


def test_snappy_we_write_the_xerial_framing() -> None:
    records, block = _snappy_records()
    encoded = build_batch(records, compression=Compression.SNAPPY)
    payload = encoded[BATCH_HEADER_SIZE:]
    assert payload.startswith(XERIAL_MAGIC + struct.pack(">ii", 1, 1))
    # Every xerial block is raw snappy of at most 32 KiB; together they are the records.
    pos, out = 16, b""
    while pos < len(payload):
        (size,) = struct.unpack_from(">i", payload, pos)
        chunk = python_snappy.decompress(payload[pos + 4 : pos + 4 + size])
        assert len(chunk) <= 32 * 1024
        out += chunk
        pos += 4 + size
    assert out == block


@pytest.mark.parametrize(
    "framing",
    ["xerial-ours", "xerial-1k-blocks", "xerial-python-snappy", "raw-cramjam", "raw-python-snappy"],
)
def test_snappy_reads_xerial_framed_and_raw_input(framing: str) -> None:
    records, block = _snappy_records()
    if framing == "xerial-ours":
        payload = compress(Compression.SNAPPY, block)
    elif framing == "xerial-1k-blocks":
        parts = [XERIAL_MAGIC + struct.pack(">ii", 1, 1)]
        for i in range(0, len(block), 1024):
            raw = bytes(cramjam.snappy.compress_raw(block[i : i + 1024]))
            parts.append(struct.pack(">i", len(raw)) + raw)
        payload = b"".join(parts)
    elif framing == "xerial-python-snappy":
        from kafka.codec import snappy_encode

        payload = snappy_encode(block, xerial_compatible=True, xerial_blocksize=8 * 1024)
        assert payload.startswith(XERIAL_MAGIC)
    elif framing == "raw-cramjam":
        payload = bytes(cramjam.snappy.compress_raw(block))
    else:
        payload = python_snappy.compress(block)
    assert (framing.startswith("xerial")) == payload.startswith(XERIAL_MAGIC)
    decoded = decode_batch(_snappy_batch(payload, records))
    assert decoded.records == tuple(records)


def test_snappy_empty_xerial_stream_is_an_empty_block() -> None:
    payload = XERIAL_MAGIC + struct.pack(">ii", 1, 1)
    assert decompress(Compression.SNAPPY, payload, 100) == b""


def test_a_partition_decoded_inside_a_larger_buffer_gives_the_same_errors() -> None:
    """Records decoded where they lie in a request frame: byte positions in errors
    still count from the start of the partition's records."""
    good = build_batch([Record(value=b"v" * 10, timestamp=1)] * 2)
    bad = bytearray(good)
    bad[61] += 2  # the first record's length varint: two bytes more than it holds
    bad[17:21] = struct.pack(">I", crc32c(bytes(bad[21:])))
    with pytest.raises(CorruptBatch) as alone:
        decode_batches(bytes(bad))
    with pytest.raises(CorruptBatch) as inside:
        decode_batches(b"X" * 100 + bytes(bad) + b"Y" * 50, 100, 100 + len(bad))
    assert "at byte 61" in str(alone.value)
    assert str(inside.value) == str(alone.value)
    assert [r.value for b in decode_batches(b"X" * 9 + good + b"Y", 9, 9 + len(good))
            for r in b.records] == [b"v" * 10] * 2


@pytest.mark.parametrize("codec", [c for c in Compression if c is not Compression.NONE])
def test_decompress_block_is_decode_batchs_block_and_fails_as_it_does(codec: Compression) -> None:
    records = [Record(key=b"k%d" % i, value=b"value %d " % i * 20, timestamp=1000 + i,
                      headers=[("h", b"1")]) for i in range(50)]
    batch = b"\x00" * 7 + build_batch(records, compression=codec)  # at byte 7 of a frame
    header = decode_batch(batch, 7).header
    assert decompress_block(batch, 7, header, origin=7) == \
        bytes(decode_batch(batch, 7).records_block())
    broken = bytearray(batch)
    broken[-1] ^= 0xFF
    for bad, limits in ((bytes(broken), DEFAULT_DECOMPRESSION_LIMITS),
                        (batch, DecompressionLimits(max_bytes=100, max_ratio=0))):
        with pytest.raises(CorruptBatch) as decoding:
            decode_batch(bad, 7, origin=7, limits=limits)
        with pytest.raises(CorruptBatch) as decompressing:
            decompress_block(bad, 7, header, origin=7, limits=limits)
        assert type(decompressing.value) is type(decoding.value)
        assert str(decompressing.value) == str(decoding.value)
    with pytest.raises(ValueError, match="not compressed"):
        decompress_block(build_batch(records), 0, decode_batch(build_batch(records)).header)
