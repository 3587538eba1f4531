"""Interop: our record batches against two independent Kafka client implementations.

aiokafka (its compiled record module and its pure-Python one) and kafka-python each
build batches for every codec that we must decode to the same records, and each must
read the batches we build. kafka-python decompresses with its own libraries
(python-snappy, lz4, zstandard, stdlib gzip), so it also checks our compressed
payloads with code that shares nothing with cramjam.
"""

from __future__ import annotations

import random
import struct
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import cramjam
import lz4.block
import lz4.frame
import pytest
from aiokafka.record import default_records as aiokafka_records
from hypothesis import given, settings
from hypothesis import strategies as st
from kafka.record.default_records import DefaultRecordBatchBuilder as KafkaPythonBuilder
from kafka.record.memory_records import MemoryRecords as KafkaPythonMemoryRecords

from kiproxy.protocol.compression import Compression, CompressionLevels, compress, decompress
from kiproxy.protocol.records import (
    BATCH_HEADER_SIZE,
    Record,
    build_batch,
    decode_batch,
    decode_batches,
    encode_batch,
)

CODECS = tuple(Compression)
CODEC_IDS = [c.name.lower() for c in CODECS]

# Records as plain tuples, the common language of all three implementations.
Plain = tuple[int, int, bytes | None, bytes | None, tuple[tuple[str, bytes | None], ...]]


@dataclass(frozen=True)
class Producer:
    """Producer facts a batch carries."""

    producer_id: int
    producer_epoch: int
    base_sequence: int
    transactional: bool


def _b(v: Any) -> bytes | None:
    return None if v is None else bytes(v)


def plain_ours(record: Record, base_offset: int = 0) -> Plain:
    return (base_offset + record.offset_delta, record.timestamp, record.key, record.value,
            tuple((h.key, h.value) for h in record.headers))


def plain_theirs(record: Any) -> Plain:
    return (record.offset, record.timestamp, _b(record.key), _b(record.value),
            tuple((k, _b(v)) for k, v in record.headers))


# ------------------------------------------------------------- their builders

BUILDERS: dict[str, Callable[..., Any]] = {
    "aiokafka-c": aiokafka_records.DefaultRecordBatchBuilder,
    "aiokafka-py": aiokafka_records._DefaultRecordBatchBuilderPy,
    "kafka-python": KafkaPythonBuilder,
}


def build_theirs(builder: str, codec: Compression, records: list[Plain],
                 producer: Producer) -> bytes:
    b = BUILDERS[builder](
        magic=2, compression_type=int(codec), is_transactional=int(producer.transactional),
        producer_id=producer.producer_id, producer_epoch=producer.producer_epoch,
        base_sequence=producer.base_sequence, batch_size=1 << 24,
    )
    for offset, timestamp, key, value, headers in records:
        assert b.append(offset, timestamp, key, value, list(headers)) is not None
    return bytes(b.build())


# ------------------------------------------------------------- their readers


def read_aiokafka(data: bytes, compiled: bool) -> tuple[Any, list[Plain]]:
    cls = (aiokafka_records.DefaultRecordBatch if compiled
           else aiokafka_records._DefaultRecordBatchPy)
    batch = cls(data)
    assert batch.validate_crc()
    return batch, [plain_theirs(r) for r in batch]


def read_kafka_python(data: bytes) -> list[tuple[Any, list[Any]]]:
    memory = KafkaPythonMemoryRecords(data)
    out = []
    while memory.has_next():
        batch = memory.next_batch()
        assert batch.validate_crc()
        out.append((batch, list(batch)))
    assert memory.valid_bytes() == len(data)
    return out


# ------------------------------------------------------------- strategies

NULLABLE = st.none() | st.binary(max_size=40)
HEADER_KEY = st.sampled_from(["id", "id", "trace", "ß"]) | st.text(max_size=8)
# One record with a large repetitive value, so every builder finds compression worth it
# (they silently fall back to no compression otherwise).
PADDING: Plain = (0, 0, b"pad", b"0123456789abcdef" * 256, (("pad", None),))


@st.composite
def plain_records(draw: st.DrawFn) -> list[Plain]:
    base = draw(st.integers(0, 2**41))
    n = draw(st.integers(0, 10))
    out: list[Plain] = []
    for i in range(n):
        headers = tuple(draw(st.lists(st.tuples(HEADER_KEY, NULLABLE), max_size=3)))
        out.append((i, base + draw(st.integers(-(2**20), 2**20)), draw(NULLABLE),
                    draw(NULLABLE), headers))
    last_ts = out[-1][1] if out else base
    out.append((n, last_ts, PADDING[2], PADDING[3], PADDING[4]))
    return out


producers = st.one_of(
    st.just(Producer(-1, -1, -1, False)),
    st.builds(Producer, st.integers(0, 2**63 - 1), st.integers(0, 2**15 - 1),
              st.integers(0, 2**31 - 1), st.booleans()),
)


# ------------------------------------------------------------- theirs -> ours


@pytest.mark.parametrize("builder", list(BUILDERS))
@pytest.mark.parametrize("codec", CODECS, ids=CODEC_IDS)
@settings(max_examples=20, deadline=None)
@given(records=plain_records(), producer=producers)
def test_their_batches_decode_with_ours(builder: str, codec: Compression,
                                        records: list[Plain], producer: Producer) -> None:
    data = build_theirs(builder, codec, records, producer)

    [batch] = decode_batches(data)
    assert batch.header.compression is codec, "the builder skipped compression"
    assert [plain_ours(r) for r in batch.records] == records
    assert batch.header.producer_id == producer.producer_id
    assert batch.header.producer_epoch == producer.producer_epoch
    assert batch.header.base_sequence == producer.base_sequence
    assert batch.header.is_transactional == producer.transactional
    assert batch.header.record_count == len(records)
    assert batch.header.last_offset_delta == len(records) - 1
    assert batch.header.base_timestamp == records[0][1]
    assert batch.header.max_timestamp == max(r[1] for r in records)


@pytest.mark.parametrize("builder", list(BUILDERS))
def test_their_batches_back_to_back_decode_with_ours(builder: str) -> None:
    parts = []
    expected = []
    for i, codec in enumerate(CODECS):
        headers = (("c", codec.name.encode()),)
        records: list[Plain] = [(0, 1_000 + i, b"k%d" % i, b"v" * 300, headers)]
        parts.append(build_theirs(builder, codec, records, Producer(7, 1, 10 * i, False)))
        expected.append(records)
    batches = decode_batches(b"".join(parts))
    assert [[plain_ours(r) for r in b.records] for b in batches] == expected
    assert [b.header.base_sequence for b in batches] == [0, 10, 20, 30, 40]


# ------------------------------------------------------------- ours -> theirs


def _ours(codec: Compression, records: list[Plain], producer: Producer,
          base_offset: int = 0) -> bytes:
    data = build_batch(
        [Record(key=k, value=v, headers=h, timestamp=ts) for _o, ts, k, v, h in records],
        compression=codec, base_offset=base_offset, producer_id=producer.producer_id,
        producer_epoch=producer.producer_epoch, base_sequence=producer.base_sequence,
        transactional=producer.transactional,
    )
    assert data[21:23] == struct.pack(">h", int(codec) | (0x10 if producer.transactional else 0))
    return data


@pytest.mark.parametrize("compiled", [True, False], ids=["aiokafka-c", "aiokafka-py"])
@pytest.mark.parametrize("codec", CODECS, ids=CODEC_IDS)
@settings(max_examples=20, deadline=None)
@given(records=plain_records(), producer=producers)
def test_our_batches_decode_with_aiokafka(compiled: bool, codec: Compression,
                                          records: list[Plain], producer: Producer) -> None:
    data = _ours(codec, records, producer)
    batch, got = read_aiokafka(data, compiled)
    assert got == records
    assert batch.compression_type == int(codec)
    assert batch.producer_id == producer.producer_id
    assert batch.producer_epoch == producer.producer_epoch
    assert batch.base_sequence == producer.base_sequence
    assert batch.is_transactional == producer.transactional
    assert not batch.is_control_batch
    assert batch.last_offset_delta == len(records) - 1
    assert batch.first_timestamp == records[0][1]
    assert batch.max_timestamp == max(r[1] for r in records)


@pytest.mark.parametrize("codec", CODECS, ids=CODEC_IDS)
@settings(max_examples=20, deadline=None)
@given(records=plain_records(), producer=producers, base_offset=st.integers(0, 2**40))
def test_our_batches_decode_with_kafka_python(codec: Compression, records: list[Plain],
                                              producer: Producer, base_offset: int) -> None:
    data = _ours(codec, records, producer, base_offset)
    [(batch, got)] = read_kafka_python(data)
    assert [plain_theirs(r) for r in got] == [
        (base_offset + o, ts, k, v, h) for o, ts, k, v, h in records
    ]
    assert batch.compression_type == int(codec)
    assert batch.base_offset == base_offset
    assert batch.leader_epoch == -1
    assert batch.producer_id == producer.producer_id
    assert batch.producer_epoch == producer.producer_epoch
    assert batch.base_sequence == producer.base_sequence
    assert batch.is_transactional == producer.transactional
    assert batch.records_count == len(records)


def test_our_batches_back_to_back_decode_with_kafka_python() -> None:
    records: list[Plain] = [(0, 5, b"k", b"value" * 100, ())]
    data = b"".join(_ours(codec, records, Producer(-1, -1, -1, False), base_offset=i * 10)
                    for i, codec in enumerate(CODECS))
    batches = read_kafka_python(data)
    assert [b.compression_type for b, _ in batches] == [int(c) for c in CODECS]
    assert [[r.offset for r in rs] for _, rs in batches] == [[0], [10], [20], [30], [40]]


@pytest.mark.parametrize("commit", [True, False], ids=["commit", "abort"])
def test_our_control_batch_reads_as_a_transaction_marker(commit: bool) -> None:
    marker = Record(key=struct.pack(">hh", 0, int(commit)), value=struct.pack(">hi", 0, 5),
                    timestamp=99)
    data = build_batch([marker], control=True, transactional=True, producer_id=12,
                       producer_epoch=3, base_offset=40)
    [(batch, [record])] = read_kafka_python(data)
    assert batch.is_control_batch and batch.is_transactional
    assert record.commit is commit and record.abort is not commit
    assert record.offset == 40
    aio_batch, _ = read_aiokafka(data, compiled=True)
    assert aio_batch.is_control_batch


# ------------------------------------------------------------- LZ4 framing (KIP-57)

LZ4_MAGIC = b"\x04\x22\x4d\x18"
_BLOCK_MAX = {4: 64 * 1024, 5: 256 * 1024, 6: 1024 * 1024, 7: 4 * 1024 * 1024}


def _lz4_blocks(frame: bytes) -> tuple[int, list[tuple[bytes, bool]]]:
    """``(max block size, [(block, is_compressed), ...])`` of one LZ4 frame."""
    flg, bd = frame[4], frame[5]
    pos = 6 + (8 if flg & 0x08 else 0) + (4 if flg & 0x01 else 0) + 1  # + header checksum
    blocks = []
    while True:
        (size,) = struct.unpack_from("<I", frame, pos)
        pos += 4
        if size == 0:
            break
        n = size & 0x7FFFFFFF
        blocks.append((frame[pos : pos + n], not size & 0x80000000))
        pos += n + (4 if flg & 0x10 else 0)
    pos += 4 if flg & 0x04 else 0
    assert pos == len(frame), "trailing bytes after the LZ4 frame"
    return _BLOCK_MAX[(bd >> 4) & 0x07], blocks


def _varied_bytes(size: int) -> bytes:
    rng = random.Random(57)
    words = [bytes(rng.choice(b"abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(2, 12)))
             for _ in range(3_000)]
    out = bytearray()
    while len(out) < size:
        out += rng.choice(words) + bytes([rng.randint(32, 126)])
    return bytes(out[:size])


def test_lz4_records_block_is_a_frame_with_independent_blocks() -> None:
    records = [Record(key=b"%d" % i, value=_varied_bytes(3_100 + i), timestamp=i)
               for i in range(100)]
    data = build_batch(records, compression=Compression.LZ4)
    frame = data[BATCH_HEADER_SIZE:]
    [decoded] = decode_batches(data)
    assert decoded.records == tuple(r.with_offset_delta(i) for i, r in enumerate(records))

    assert frame[:4] == LZ4_MAGIC
    flg = frame[4]
    assert flg >> 6 == 0b01, "LZ4 frame version must be 01"
    assert flg & 0x20, "block independence (FLG bit 5) must be set: Java reads no linked blocks"
    assert not flg & 0x01, "no dictionary id"

    block = lz4.frame.decompress(frame)
    assert len(block) > 300 * 1024
    # Independent blocks: each one decompresses on its own, without the previous
    # block as a dictionary, and together they are the records block.
    max_block, blocks = _lz4_blocks(frame)
    assert len(blocks) > 1
    pieces = [lz4.block.decompress(b, uncompressed_size=max_block) if compressed else b
              for b, compressed in blocks]
    assert b"".join(pieces) == block


def test_lz4_compress_of_300_kib_varied_data() -> None:
    raw = _varied_bytes(300 * 1024)
    frame = compress(Compression.LZ4, raw)
    assert frame[:4] == LZ4_MAGIC
    assert frame[4] & 0x20
    assert lz4.frame.decompress(frame) == raw
    max_block, blocks = _lz4_blocks(frame)
    assert len(blocks) >= 300 * 1024 // max_block
    assert b"".join(lz4.block.decompress(b, uncompressed_size=max_block) if c else b
                    for b, c in blocks) == raw


def _cramjam_lz4_frame(data: bytes, level: int) -> bytes:
    """The LZ4 frame cramjam's streaming compressor writes (what kiproxy wrote at first)."""
    compressor = cramjam.lz4.Compressor(level=level, content_checksum=False, block_linked=False)
    compressor.compress(data)
    return bytes(compressor.finish())


@settings(max_examples=60, deadline=None)
@given(data=st.one_of(st.binary(max_size=3_000),
                      st.integers(0, 200_000).map(_varied_bytes)),
       level=st.integers(1, 17).filter(lambda lv: lv != 2))
def test_lz4_frames_are_byte_identical_to_cramjams(data: bytes, level: int) -> None:
    """LZ4 is written by python-lz4 (it releases the GIL; cramjam's compressor does not):
    the frames are the ones cramjam wrote, byte for byte, at every level but 2."""
    assert compress(Compression.LZ4, data, CompressionLevels(lz4=level)) == \
        _cramjam_lz4_frame(data, level)


def test_lz4_level_2_is_lz4s_middle_mode() -> None:
    """Level 2 stays with cramjam, whose liblz4 has the middle mode (smaller than fast)."""
    raw = _varied_bytes(200 * 1024)
    middle = compress(Compression.LZ4, raw, CompressionLevels(lz4=2))
    assert middle == _cramjam_lz4_frame(raw, 2)
    assert len(middle) < len(compress(Compression.LZ4, raw, CompressionLevels(lz4=1)))
    assert lz4.frame.decompress(middle) == raw


# ------------------------------------------------------------- compression levels

# (codec, low, high): the extremes operators are likely to pick, plus LZ4's middle mode
# and zstd's fast mode, which are separate code paths in their libraries.
LEVEL_CASES = [
    (Compression.GZIP, 1, 9), (Compression.LZ4, 1, 12), (Compression.LZ4, 2, 9),
    (Compression.ZSTD, 1, 19), (Compression.ZSTD, -5, 3),
]


@pytest.mark.parametrize(("codec", "low", "high"), LEVEL_CASES,
                         ids=[f"{c.name.lower()}-{lo}-{hi}" for c, lo, hi in LEVEL_CASES])
def test_levels_reach_the_compressor_and_every_reader_reads_both(
        codec: Compression, low: int, high: int) -> None:
    name = codec.name.lower()
    raw = _varied_bytes(200 * 1024)
    small = compress(codec, raw, CompressionLevels(**{name: high}))
    fast = compress(codec, raw, CompressionLevels(**{name: low}))
    assert len(small) < len(fast), f"{name} level {high} is no smaller than level {low}"
    for block in (small, fast):
        assert decompress(codec, block, len(raw)) == raw
        if codec is Compression.LZ4:  # independent blocks at every level (KIP-57)
            assert block[:4] == LZ4_MAGIC and block[4] & 0x20

    records = [Record(key=b"%d" % i, value=_varied_bytes(2_000 + i), timestamp=1_000 + i,
                      headers=(("h", b"%d" % i),)) for i in range(60)]
    header = decode_batch(build_batch(records, compression=codec, producer_id=9,
                                      producer_epoch=1, base_sequence=5)).header
    expected = [(i, 1_000 + i, b"%d" % i, _varied_bytes(2_000 + i), (("h", b"%d" % i),))
                for i in range(60)]
    batches = [encode_batch(header, tuple(records), levels=CompressionLevels(**{name: lv}))
               for lv in (low, high)]
    assert len(batches[1]) < len(batches[0])
    for data in batches:
        assert [plain_ours(r) for r in decode_batches(data)[0].records] == expected
        for compiled in (True, False):
            batch, got = read_aiokafka(data, compiled)
            assert got == expected and batch.compression_type == int(codec)
        [(kp_batch, kp_records)] = read_kafka_python(data)
        assert [plain_theirs(r) for r in kp_records] == expected
        assert kp_batch.compression_type == int(codec)
