"""Damaged input: every decoder fails with a typed ProtocolError, never anything else.

A corpus of hand-made faults (truncations, lying lengths, bad varints, wrong CRCs,
unknown codecs, old magic, corrupt compressed payloads, decompression bombs), then
hypothesis fuzzing of batches, request headers, frames and legacy Produce bodies:
the only acceptable outcomes are a result or a :class:`kiproxy.protocol.errors.ProtocolError`.
Bombs are also run in a child process with a capped address space, so a decoder
that allocates what the attacker asks for is caught as a crash, not as slowness.
"""

from __future__ import annotations

import contextlib
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path

import cramjam
import pytest
from crc32c import crc32c
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kio.static.primitive import Records

from kiproxy.protocol.compression import XERIAL_MAGIC, Compression, compress, decompress
from kiproxy.protocol.errors import (
    CorruptBatch,
    MalformedFrame,
    MalformedMessage,
    ProtocolError,
    UnsupportedCompression,
    UnsupportedMagic,
    UnsupportedVersion,
)
from kiproxy.protocol.framing import (
    FrameDecoder,
    encode_frame,
    encode_request_header,
    parse_request_header,
    parse_response_header,
)
from kiproxy.protocol.legacy_produce import (
    legacy_produce_acks_and_partitions,
    legacy_produce_error_response,
)
from kiproxy.protocol.messages import (
    ApiKey,
    parse_request,
    parse_response,
    request_type,
    response_type,
    serialize,
)
from kiproxy.protocol.records import (
    BATCH_HEADER_SIZE,
    DecompressionLimits,
    Record,
    build_batch,
    decode_batch,
    decode_batches,
    read_batch_headers,
)

ROOT = Path(__file__).resolve().parents[2]
CODECS = tuple(Compression)
COMPRESSED = CODECS[1:]
CODEC_IDS = [c.name.lower() for c in CODECS]
FUZZ = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def varint(n: int) -> bytes:
    z = (n << 1) ^ (n >> 63)
    out = bytearray()
    while z >= 0x80:
        out.append((z & 0x7F) | 0x80)
        z >>= 7
    out.append(z)
    return bytes(out)


def batch_from_block(block: bytes, count: int, *, attributes: int = 0, base_timestamp: int = 0,
                     magic: int = 2, batch_length: int | None = None) -> bytes:
    """A batch around an arbitrary records block, with a correct CRC unless told otherwise."""
    after_crc = struct.pack(">hiqqqhii", attributes, max(count - 1, 0), base_timestamp,
                            base_timestamp, -1, -1, -1, count) + block
    length = 49 + len(block) if batch_length is None else batch_length
    return struct.pack(">qiibI", 0, length, -1, magic, crc32c(after_crc)) + after_crc


def with_fixed_crc(batch: bytes) -> bytes:
    """Recompute the CRC of a (possibly damaged) batch, so decoding gets past it."""
    if len(batch) < 21:
        return batch
    return batch[:17] + struct.pack(">I", crc32c(batch[21:])) + batch[21:]


def record_bytes(*fields: bytes) -> bytes:
    """A record: length varint then the given fields verbatim."""
    body = b"".join(fields)
    return varint(len(body)) + body


def good_record_fields(key: bytes = b"k", value: bytes = b"v") -> list[bytes]:
    return [b"\x00", varint(0), varint(0), varint(len(key)), key, varint(len(value)), value,
            varint(0)]


RECORDS = [
    Record(key=b"key-%d" % i, value=(b"value %d " % i) * 8,
           headers=[("h", b"1"), ("h", None)], timestamp=1_700_000_000_000 + i)
    for i in range(5)
] + [Record(key=None, value=None, timestamp=1_700_000_000_000)]
VALID = {codec: build_batch(RECORDS, compression=codec, producer_id=3, producer_epoch=1,
                            base_sequence=0)
         for codec in CODECS}


def test_the_corpus_starts_from_valid_batches() -> None:
    for codec, data in VALID.items():
        assert len(decode_batch(data).records) == len(RECORDS), codec


# ------------------------------------------------------------- truncation and lengths


@pytest.mark.parametrize("codec", CODECS, ids=CODEC_IDS)
def test_every_truncation_is_a_corrupt_batch(codec: Compression) -> None:
    data = VALID[codec]
    for cut in range(len(data)):
        with pytest.raises(CorruptBatch):
            decode_batch(data[:cut])
        if cut:
            with pytest.raises(CorruptBatch):
                decode_batches(data[:cut])


def test_truncated_header_messages_say_where() -> None:
    data = VALID[Compression.NONE]
    with pytest.raises(CorruptBatch, match="cannot hold"):
        decode_batch(data[:16])
    with pytest.raises(CorruptBatch, match="header alone needs 61"):
        decode_batch(data[:60])
    with pytest.raises(CorruptBatch, match=r"at byte 0: batchLength .* runs past"):
        decode_batch(data[:-1])
    with pytest.raises(CorruptBatch, match=f"at byte {len(data)}"):
        decode_batches(data + data[:30])


def test_batch_length_past_the_end() -> None:
    data = bytearray(VALID[Compression.NONE])
    struct.pack_into(">i", data, 8, len(data) - 12 + 1)
    with pytest.raises(CorruptBatch, match="runs past"):
        decode_batch(bytes(data))
    with pytest.raises(CorruptBatch, match="runs past"):
        read_batch_headers(bytes(data))
    struct.pack_into(">i", data, 8, 2**31 - 1)
    with pytest.raises(CorruptBatch, match="runs past"):
        decode_batches(bytes(data))


@pytest.mark.parametrize("length", [-1, 0, 48, -(2**31)])
def test_batch_length_shorter_than_the_header(length: int) -> None:
    data = bytearray(VALID[Compression.NONE])
    struct.pack_into(">i", data, 8, length)
    with pytest.raises(CorruptBatch, match="smaller than the header"):
        decode_batches(bytes(data))
    with pytest.raises(CorruptBatch):
        read_batch_headers(bytes(data))


def test_batch_length_shorter_than_the_records() -> None:
    # The declared length stops inside the records: the rest is not a batch.
    data = bytearray(VALID[Compression.NONE])
    struct.pack_into(">i", data, 8, len(data) - 12 - 5)
    with pytest.raises(CorruptBatch):
        decode_batches(with_fixed_crc(bytes(data)[:-5]) + bytes(data)[-5:])


# ------------------------------------------------------------- CRC


@pytest.mark.parametrize("codec", CODECS, ids=CODEC_IDS)
def test_wrong_crc(codec: Compression) -> None:
    data = bytearray(VALID[codec])
    data[17] ^= 0x01
    with pytest.raises(CorruptBatch, match="CRC-32C mismatch"):
        decode_batch(bytes(data))


@pytest.mark.parametrize("position", [21, 30, 60, -1], ids=["attributes", "timestamp",
                                                            "record-count", "last-byte"])
def test_any_change_after_the_crc_field_breaks_the_crc(position: int) -> None:
    data = bytearray(VALID[Compression.NONE])
    data[position] ^= 0x40
    with pytest.raises(CorruptBatch, match="CRC-32C mismatch"):
        decode_batch(bytes(data))


def test_bytes_before_the_crc_field_are_not_covered_by_it() -> None:
    # baseOffset and partitionLeaderEpoch are outside the CRC: the broker rewrites them.
    data = bytearray(VALID[Compression.NONE])
    struct.pack_into(">q", data, 0, 12345)
    struct.pack_into(">i", data, 12, 9)
    decoded = decode_batch(bytes(data))
    assert (decoded.header.base_offset, decoded.header.partition_leader_epoch) == (12345, 9)


def test_crc_check_can_be_skipped() -> None:
    data = bytearray(VALID[Compression.NONE])
    index = bytes(data).index(b"value 0")
    data[index] = ord("V")
    with pytest.raises(CorruptBatch, match="CRC"):
        decode_batch(bytes(data))
    assert decode_batch(bytes(data), verify_crc=False).records[0].value.startswith(b"Value 0")


# ------------------------------------------------------------- magic and codec ids


@pytest.mark.parametrize("magic", [0, 1, 3, -1])
def test_magic_other_than_2_is_unsupported(magic: int) -> None:
    data = bytearray(VALID[Compression.NONE])
    data[16] = magic & 0xFF
    with pytest.raises(UnsupportedMagic, match=f"magic {magic & 0xFF}"):
        decode_batch(bytes(data))
    with pytest.raises(UnsupportedMagic):
        read_batch_headers(bytes(data))


@pytest.mark.parametrize("magic", [0, 1])
def test_old_message_format_is_refused_even_when_short(magic: int) -> None:
    # A magic 0/1 message set is shorter than a v2 header; it is still named as such.
    message = struct.pack(">qiIbb", 0, 14, 0, magic, 0) + b"\xff\xff\xff\xff" + b"\x00" * 4
    with pytest.raises(UnsupportedMagic, match="old message format"):
        decode_batches(message)


@pytest.mark.parametrize("codec_id", [5, 6, 7])
def test_unknown_codec_id(codec_id: int) -> None:
    data = batch_from_block(record_bytes(*good_record_fields()), 1, attributes=codec_id)
    with pytest.raises(UnsupportedCompression, match=f"codec id {codec_id}"):
        decode_batch(data)
    with pytest.raises(UnsupportedCompression):
        read_batch_headers(data)
    assert issubclass(UnsupportedCompression, CorruptBatch)


# ------------------------------------------------------------- records block


def _decode_block(block: bytes, count: int) -> None:
    decode_batch(batch_from_block(block, count))


def test_record_count_larger_than_the_records() -> None:
    one = record_bytes(*good_record_fields())
    with pytest.raises(CorruptBatch, match="record 1: record length varint truncated"):
        _decode_block(one, 2)


def test_record_count_smaller_than_the_records() -> None:
    one = record_bytes(*good_record_fields())
    with pytest.raises(CorruptBatch, match="left over after the batch's 1 records"):
        _decode_block(one + one, 1)


@pytest.mark.parametrize("count", [2**31 - 1, 1_000_000])
def test_absurd_record_count_is_refused_before_allocating(count: int) -> None:
    with pytest.raises(CorruptBatch, match=f"record count {count} cannot fit"):
        _decode_block(record_bytes(*good_record_fields()), count)


def test_negative_record_count() -> None:
    with pytest.raises(CorruptBatch, match="recordCount -1 is negative"):
        _decode_block(b"", -1)


BAD_RECORDS = {
    "length varint overflows": (b"\xff\xff\xff\xff\x7f", "overflows 32 bits"),
    "length varint too long": (b"\x80\x80\x80\x80\x80\x01", "overflows 32 bits"),
    "length varint truncated": (b"\x80", "truncated"),
    "negative record length": (varint(-5), "does not fit"),
    "record length past the end": (varint(50) + b"\x00" * 10, "does not fit"),
    "empty record": (varint(0), "attributes missing"),
    "timestamp varlong too long": (record_bytes(b"\x00", b"\xff" * 10 + b"\x01", b"\x00" * 5),
                                   "longer than 10 bytes"),
    "timestamp varlong truncated": (record_bytes(b"\x00", b"\xff\xff"), "timestamp delta"),
    "offset delta truncated": (record_bytes(b"\x00", varint(0)), "offset delta"),
    "key length below -1": (record_bytes(b"\x00", varint(0), varint(0), varint(-2)),
                            "key length -2 .* is negative"),
    "key past the record": (record_bytes(b"\x00", varint(0), varint(0), varint(9), b"abc"),
                            "key length 9 .* exceeds"),
    "value past the record": (record_bytes(b"\x00", varint(0), varint(0), varint(-1),
                                           varint(4), b"ab"), "value length 4"),
    "header count negative": (record_bytes(*good_record_fields()[:-1], varint(-3)),
                              "header count -3"),
    "header count too large": (record_bytes(*good_record_fields()[:-1], varint(1000)),
                               "header count 1000"),
    "header key length negative": (record_bytes(*good_record_fields()[:-1], varint(1),
                                                varint(-1)), "header 0 key length -1"),
    "header value past the record": (record_bytes(*good_record_fields()[:-1], varint(1),
                                                  varint(1), b"h", varint(7)),
                                     "header value length 7"),
    "fields shorter than the length": (varint(10) + b"".join(good_record_fields()) + b"\x00\x00",
                                       "declared length 10"),
}


@pytest.mark.parametrize("block", list(BAD_RECORDS.values()), ids=list(BAD_RECORDS))
def test_bad_record(block: tuple[bytes, str]) -> None:
    raw, message = block
    with pytest.raises(CorruptBatch, match=message):
        _decode_block(raw, 1)


def test_record_errors_name_the_record_and_the_batch() -> None:
    good = record_bytes(*good_record_fields())
    data = VALID[Compression.NONE] + batch_from_block(good + good + varint(-5), 3)
    with pytest.raises(CorruptBatch, match=f"record batch at byte {len(VALID[Compression.NONE])}"
                                           ": record 2:"):
        decode_batches(data)


# ------------------------------------------------------------- corrupt compressed payloads


def _payload(codec: Compression) -> bytes:
    return VALID[codec][BATCH_HEADER_SIZE:]


def _damaged_payloads(codec: Compression) -> dict[str, bytes]:
    payload = _payload(codec)
    middle = bytearray(payload)
    for i in range(len(middle) // 3, len(middle) // 3 + 8):
        middle[i] ^= 0xA5
    return {
        "truncated": payload[: len(payload) // 2],
        "last-byte-cut": payload[:-1],
        "flipped": bytes(middle),
        "garbage": bytes(range(7, 250, 3)) * 3,
        "empty": b"",
    }


@pytest.mark.parametrize("damage", ["truncated", "last-byte-cut", "flipped", "garbage", "empty"])
@pytest.mark.parametrize("codec", COMPRESSED, ids=CODEC_IDS[1:])
def test_corrupt_compressed_payload(codec: Compression, damage: str) -> None:
    # The CRC is correct: the damage must be caught by decompression or record decoding.
    payload = _damaged_payloads(codec)[damage]
    data = batch_from_block(payload, len(RECORDS), attributes=int(codec))
    with pytest.raises(CorruptBatch):
        decode_batch(data)


@pytest.mark.parametrize("codec", COMPRESSED, ids=CODEC_IDS[1:])
def test_compressed_payload_of_the_wrong_codec(codec: Compression) -> None:
    other = COMPRESSED[(COMPRESSED.index(codec) + 1) % len(COMPRESSED)]
    data = batch_from_block(_payload(other), len(RECORDS), attributes=int(codec))
    with pytest.raises(CorruptBatch):
        decode_batch(data)


@pytest.mark.parametrize("codec", COMPRESSED, ids=CODEC_IDS[1:])
def test_compressed_payload_with_trailing_garbage_is_rejected(codec: Compression) -> None:
    data = batch_from_block(_payload(codec) + b"\x00garbage", len(RECORDS), attributes=int(codec))
    with pytest.raises(CorruptBatch):
        decode_batch(data)


XERIAL_HEADER = XERIAL_MAGIC + struct.pack(">ii", 1, 1)


@pytest.mark.parametrize(
    "payload",
    [
        XERIAL_HEADER[:12],
        XERIAL_HEADER + b"\x00\x00",
        XERIAL_HEADER + struct.pack(">i", -1) + b"abc",
        XERIAL_HEADER + struct.pack(">i", 100) + b"abc",
        XERIAL_HEADER + struct.pack(">i", 3) + b"\xff\xff\xff",
    ],
    ids=["short-header", "short-block-length", "negative-block", "block-past-end",
         "bad-block"],
)
def test_corrupt_xerial_framing(payload: bytes) -> None:
    with pytest.raises(CorruptBatch):
        decode_batch(batch_from_block(payload, 1, attributes=int(Compression.SNAPPY)))


# ------------------------------------------------------------- decompression bombs


@pytest.mark.parametrize("codec", COMPRESSED, ids=CODEC_IDS[1:])
def test_decompression_bomb_over_the_limit(codec: Compression) -> None:
    records = [Record(value=bytes(64 * 1024), timestamp=0)] * 16  # ~1 MiB of zeros
    data = build_batch(records, compression=codec)
    assert len(data) < 200 * 1024
    assert len(decode_batch(data).records) == 16  # fine under the default limit
    with pytest.raises(CorruptBatch, match="max_decompressed_batch_bytes"):
        decode_batch(data, limits=DecompressionLimits(max_bytes=256 * 1024))
    with pytest.raises(CorruptBatch, match="max_decompressed_batch_bytes"):
        decode_batches(data, limits=DecompressionLimits(max_bytes=256 * 1024))


@pytest.mark.parametrize(
    "raw",
    [bytes(range(256)) * 1024, bytes(3 << 20), bytes(range(7)) * 100_000, b"x"],
    ids=["pattern-256k", "zeros-3m", "pattern-700k", "one-byte"],
)
@pytest.mark.parametrize("codec", COMPRESSED, ids=CODEC_IDS[1:])
def test_output_exactly_at_the_limit_is_accepted(codec: Compression, raw: bytes) -> None:
    # Highly compressible inputs make the decoder grow its output buffer several times.
    payload = compress(codec, raw)
    assert decompress(codec, payload, len(raw)) == raw
    assert decompress(codec, payload, len(raw) + 1) == raw
    with pytest.raises(CorruptBatch, match="max_decompressed_batch_bytes"):
        decompress(codec, payload, len(raw) - 1)
    with pytest.raises(CorruptBatch, match="max_decompressed_batch_bytes"):
        decompress(codec, payload, 0)


# Run in a child whose address space is capped: a decoder that inflates the whole bomb
# (or allocates a length read from the input) dies there instead of raising.
_BOMB_CHILD = textwrap.dedent(
    """
    import resource, struct, sys
    import cramjam
    from kiproxy.protocol.compression import XERIAL_MAGIC, Compression, compress, decompress
    from kiproxy.protocol.errors import CorruptBatch

    kind = sys.argv[1]
    if kind == "snappy-raw-length":
        # A raw snappy stream whose length preamble claims 4 GiB.
        codec, bomb = Compression.SNAPPY, b"\\xff\\xff\\xff\\xff\\x0f\\x00\\x01"
    elif kind == "snappy-xerial-length":
        block = b"\\xff\\xff\\xff\\xff\\x0f\\x00\\x01"
        codec = Compression.SNAPPY
        bomb = XERIAL_MAGIC + struct.pack(">iii", 1, 1, len(block)) + block
    else:
        codec = Compression[kind.upper()]
        # Concatenated frames (gzip members) of 64 MiB of zeros: 2 GiB in all.
        bomb = compress(codec, bytes(64 << 20)) * 32

    def vm_size():
        for line in open("/proc/self/status"):
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024

    cap = vm_size() + (768 << 20)
    resource.setrlimit(resource.RLIMIT_AS, (cap, cap))
    try:
        decompress(codec, bomb, 1 << 20)
    except CorruptBatch as exc:
        print("CorruptBatch:", exc)
    else:
        print("decompressed")
    """
)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="needs /proc and RLIMIT_AS")
@pytest.mark.parametrize("kind", ["gzip", "lz4", "zstd", "snappy-raw-length",
                                  "snappy-xerial-length"])
def test_decompression_bomb_is_refused_within_bounded_memory(kind: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "RUST_BACKTRACE": "0"}
    result = subprocess.run([sys.executable, "-c", _BOMB_CHILD, kind], capture_output=True,
                            text=True, env=env, cwd=ROOT, timeout=240, check=False)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.startswith("CorruptBatch:"), result.stdout + result.stderr[-2000:]


# ------------------------------------------------------------- fuzzing: record batches


def _valid_inputs() -> list[bytes]:
    singles = list(VALID.values())
    empty = build_batch([], compression=Compression.GZIP)
    control = build_batch([Record(key=b"\x00\x00\x00\x01", value=b"\x00\x00\x00\x00\x00\x05")],
                          control=True, transactional=True, producer_id=1, producer_epoch=0)
    return [*singles, empty, control, b"".join(singles)]


INPUTS = _valid_inputs()


@st.composite
def damaged(draw: st.DrawFn) -> bytes:
    data = bytearray(draw(st.sampled_from(INPUTS)))
    for _ in range(draw(st.integers(0, 6))):
        op = draw(st.sampled_from(["flip", "set", "insert", "delete"]))
        pos = draw(st.integers(0, max(len(data) - 1, 0)))
        if op == "flip" and data:
            data[pos] ^= 1 << draw(st.integers(0, 7))
        elif op == "set" and data:
            data[pos] = draw(st.sampled_from([0x00, 0x01, 0x7F, 0x80, 0xFF]))
        elif op == "insert":
            data[pos:pos] = draw(st.binary(min_size=1, max_size=8))
        elif op == "delete":
            del data[pos : pos + draw(st.integers(1, 8))]
    if draw(st.booleans()):
        del data[draw(st.integers(0, len(data))):]
    out = bytes(data)
    # Fixing the CRC and the batch length lets the damage reach the record decoder and
    # the decompressors instead of stopping at the checksum.
    if draw(st.booleans()) and len(out) >= 12:
        out = out[:8] + struct.pack(">i", len(out) - 12) + out[12:]
    if draw(st.booleans()):
        out = with_fixed_crc(out)
    return out


def _decode_or_protocol_error(data: bytes, verify_crc: bool) -> None:
    try:
        batches = decode_batches(data, verify_crc=verify_crc,
                                 limits=DecompressionLimits(max_bytes=1 << 20))
    except ProtocolError:
        return
    for batch in batches:
        assert len(batch.records) == batch.header.record_count


@FUZZ
@given(data=damaged(), verify_crc=st.booleans())
def test_fuzzed_batches_raise_only_protocol_errors(data: bytes, verify_crc: bool) -> None:
    _decode_or_protocol_error(data, verify_crc)
    with contextlib.suppress(ProtocolError):
        read_batch_headers(data)


@FUZZ
@given(block=st.binary(max_size=200), count=st.integers(-2, 40),
       codec=st.sampled_from(CODECS), compress_it=st.booleans())
def test_random_records_blocks_raise_only_protocol_errors(block: bytes, count: int,
                                                          codec: Compression,
                                                          compress_it: bool) -> None:
    payload = compress(codec, block) if compress_it else block
    _decode_or_protocol_error(batch_from_block(payload, count, attributes=int(codec)), True)


@FUZZ
@given(payload=st.binary(max_size=300), codec=st.sampled_from(COMPRESSED))
def test_random_compressed_payloads_raise_only_corrupt_batch(payload: bytes,
                                                             codec: Compression) -> None:
    try:
        out = decompress(codec, payload, 1 << 20)
    except CorruptBatch:
        return
    assert len(out) <= 1 << 20


# ------------------------------------------------------------- fuzzing: framing

HEADERS = [
    encode_request_header(ApiKey.PRODUCE, 9, 7, "client-1", 2) + b"body",
    encode_request_header(ApiKey.METADATA, 4, 7, None, 1),
    encode_request_header(ApiKey.API_VERSIONS, 3, 1, "x", 2) + b"\x00",
    encode_request_header(7, 0, 3, None, 0),
    (struct.pack(">hhih", ApiKey.METADATA, 12, 1, 1) + b"c" + b"\x02\x00\x01x\x05\x00"),
]


@st.composite
def damaged_headers(draw: st.DrawFn) -> bytes:
    if draw(st.booleans()):
        return draw(st.binary(max_size=40))
    data = bytearray(draw(st.sampled_from(HEADERS)))
    for _ in range(draw(st.integers(1, 4))):
        if data:
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
    return bytes(data[: draw(st.integers(0, len(data)))])


@FUZZ
@given(frame=damaged_headers())
def test_fuzzed_request_headers_raise_only_malformed_frame(frame: bytes) -> None:
    try:
        header = parse_request_header(frame)
    except MalformedFrame:
        return
    if header.body_offset is not None:
        assert header.body_offset <= len(frame)


@FUZZ
@given(frame=st.binary(max_size=30), version=st.sampled_from([0, 1]))
def test_fuzzed_response_headers_raise_only_malformed_frame(frame: bytes, version: int) -> None:
    try:
        _correlation_id, offset = parse_response_header(frame, version)
    except MalformedFrame:
        return
    assert offset <= len(frame)


@FUZZ
@given(chunks=st.lists(st.binary(max_size=20), max_size=10))
def test_fuzzed_streams_raise_only_frame_errors(chunks: list[bytes]) -> None:
    decoder = FrameDecoder(max_frame_size=64)
    try:
        for chunk in chunks:
            for frame in decoder.feed(chunk):
                assert len(frame) <= 64
    except ProtocolError:
        return


# kio has no strategy for ``Records`` (opaque batch bytes to it); any bytes will do.
st.register_type_strategy(Records, st.binary(max_size=40).map(Records))

MESSAGE_APIS = [("request", ApiKey.PRODUCE, v) for v in range(3, 14)] + [
    ("request", ApiKey.METADATA, 12), ("request", ApiKey.FIND_COORDINATOR, 4),
    ("response", ApiKey.PRODUCE, 11), ("response", ApiKey.METADATA, 12),
    ("response", ApiKey.API_VERSIONS, 3), ("response", ApiKey.FETCH, 16),
]


@settings(max_examples=150, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data(), api=st.sampled_from(MESSAGE_APIS))
def test_fuzzed_message_bodies_raise_only_malformed_message(data: st.DataObject,
                                                            api: tuple[str, int, int]) -> None:
    kind, api_key, api_version = api
    if data.draw(st.booleans()):
        body = bytearray(data.draw(st.binary(max_size=80)))
    else:
        message_type = (request_type if kind == "request" else response_type)(api_key,
                                                                            api_version)
        body = bytearray(serialize(data.draw(st.from_type(message_type))))
        for _ in range(data.draw(st.integers(1, 4))):
            if body:
                body[data.draw(st.integers(0, len(body) - 1))] = data.draw(
                    st.sampled_from([0x00, 0x01, 0x7F, 0x80, 0xFE, 0xFF]))
    parse = parse_request if kind == "request" else parse_response
    with contextlib.suppress(MalformedMessage):
        parse(api_key, api_version, bytes(body))


def _uvarint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


# Bodies whose array lengths claim billions of elements. kio's native reader sizes
# its arrays from these before reading them, and a failed allocation aborts the
# process; they must be refused before kio sees them.
HOSTILE_BODIES = {
    "produce-v9-topics": ("request", ApiKey.PRODUCE, 9,
                          b"\x00" + struct.pack(">hi", 1, 1000) + _uvarint(2**32 - 1)),
    "produce-v13-topics": ("request", ApiKey.PRODUCE, 13,
                           b"\x00" + struct.pack(">hi", -1, 1000) + _uvarint(2**32 - 1)),
    "produce-v9-partitions": ("request", ApiKey.PRODUCE, 9,
                              b"\x00" + struct.pack(">hi", 1, 1000) + _uvarint(2) + _uvarint(2)
                              + b"t" + _uvarint(2**32 - 1)),
    "produce-v3-topics": ("request", ApiKey.PRODUCE, 3,
                          struct.pack(">hhii", -1, 1, 1000, 2**31 - 1)),
    "metadata-v12-topics": ("request", ApiKey.METADATA, 12, _uvarint(2**32 - 1)),
    "find-coordinator-v4-keys": ("request", ApiKey.FIND_COORDINATOR, 4,
                                 b"\x00" + _uvarint(2**32 - 1)),
    "produce-v10-response-tagged-endpoints": (
        "response", ApiKey.PRODUCE, 10,
        _uvarint(1) + struct.pack(">i", 0) + _uvarint(1) + _uvarint(0) + _uvarint(5)
        + _uvarint(2**32 - 1)),
}


_HOSTILE_CHILD = textwrap.dedent(
    """
    import json, sys
    from kiproxy.protocol.errors import MalformedMessage
    from kiproxy.protocol.messages import parse_request, parse_response

    for name, (kind, api_key, api_version, body) in json.loads(sys.stdin.read()).items():
        parse = parse_request if kind == "request" else parse_response
        try:
            parse(api_key, api_version, bytes.fromhex(body))
            outcome = "parsed"
        except MalformedMessage as exc:
            outcome = f"MalformedMessage: {exc}"
        print(json.dumps([name, outcome]), flush=True)
    """
)


@pytest.fixture(scope="module")
def hostile_outcomes() -> tuple[dict[str, str], str]:
    """Parse every hostile body in a child process: an abort there fails the tests, not pytest."""
    cases = {name: [k, key, v, body.hex()] for name, (k, key, v, body) in HOSTILE_BODIES.items()}
    result = subprocess.run(
        [sys.executable, "-c", _HOSTILE_CHILD], input=json.dumps(cases), capture_output=True,
        text=True, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120,
        check=False,
    )
    outcomes = dict(json.loads(line) for line in result.stdout.splitlines())
    return outcomes, f"exit {result.returncode}: {result.stderr[-1500:]}"


@pytest.mark.parametrize("name", list(HOSTILE_BODIES))
def test_huge_array_lengths_are_refused_before_kio(
    name: str, hostile_outcomes: tuple[dict[str, str], str]
) -> None:
    outcomes, child = hostile_outcomes
    assert name in outcomes, f"the parser crashed the process ({child})"
    assert outcomes[name].startswith("MalformedMessage:"), outcomes[name]
    assert "runs past" in outcomes[name] or "overflows" in outcomes[name]


# ------------------------------------------------------------- legacy Produce v0-v2


def legacy_produce_request(api_version: int, acks: int,
                           topics: list[tuple[str, list[tuple[int, bytes]]]]) -> bytes:
    """A whole Produce v0-v2 request frame (header v1 + body)."""
    out = [encode_request_header(ApiKey.PRODUCE, api_version, 11, "old-client", 1),
           struct.pack(">hii", acks, 1500, len(topics))]
    for name, partitions in topics:
        raw = name.encode()
        out.append(struct.pack(">h", len(raw)) + raw + struct.pack(">i", len(partitions)))
        for index, message_set in partitions:
            out.append(struct.pack(">ii", index, len(message_set)) + message_set)
    return b"".join(out)


LEGACY_MESSAGE_SET = struct.pack(">qiIbb", 0, 14, 0, 0, 0) + b"\xff\xff\xff\xff\x00\x00\x00\x01v"
LEGACY = legacy_produce_request(2, -1, [("orders", [(0, LEGACY_MESSAGE_SET), (3, b"")]),
                                       ("audit", [(1, LEGACY_MESSAGE_SET)])])


def test_legacy_produce_is_read_far_enough_to_refuse_it() -> None:
    header = parse_request_header(LEGACY)
    with pytest.raises(UnsupportedVersion):
        parse_request(ApiKey.PRODUCE, 2, LEGACY, 0)  # kio has no Produce v0-v2 schema
    # ... but the request header is the plain v1 header, and the body starts after it.
    assert header.header_version == 1
    assert header.client_id == "old-client"
    assert header.body_offset == len(encode_request_header(ApiKey.PRODUCE, 2, 11,
                                                           "old-client", 1))
    acks, topics = legacy_produce_acks_and_partitions(LEGACY, header.body_offset)
    assert acks == -1
    assert topics == [("orders", [0, 3]), ("audit", [1])]


@pytest.mark.parametrize("api_version", [0, 1, 2])
def test_legacy_produce_error_response_layout(api_version: int) -> None:
    body = legacy_produce_error_response(api_version, [("t", [0, 5])], 35)
    expected = struct.pack(">ih", 1, 1) + b"t" + struct.pack(">i", 2)
    for index in (0, 5):
        expected += struct.pack(">ihq", index, 35, -1)
        if api_version >= 2:
            expected += struct.pack(">q", -1)
    if api_version >= 1:
        expected += struct.pack(">i", 0)
    assert body == expected


@pytest.mark.parametrize(
    "body",
    [
        b"",
        b"\xff\xff\x00\x00",
        struct.pack(">hii", 1, 0, -1),
        struct.pack(">hii", 1, 0, 2**31 - 1),
        struct.pack(">hii", 1, 0, 1) + b"\x00\x05ab",
        struct.pack(">hii", 1, 0, 1) + b"\xff\xff",
        struct.pack(">hii", 1, 0, 1) + b"\x00\x01t" + struct.pack(">i", -7),
        struct.pack(">hii", 1, 0, 1) + b"\x00\x01t" + struct.pack(">iii", 1, 0, 99),
    ],
    ids=["empty", "truncated-timeout", "negative-topics", "huge-topics", "name-past-end",
         "null-name", "negative-partitions", "message-set-past-end"],
)
def test_malformed_legacy_produce(body: bytes) -> None:
    with pytest.raises(MalformedMessage, match="Produce v0-v2"):
        legacy_produce_acks_and_partitions(body, 0)


@FUZZ
@given(data=st.data())
def test_fuzzed_legacy_produce_raises_only_malformed_message(data: st.DataObject) -> None:
    frame = bytearray(LEGACY)
    body_offset = len(encode_request_header(ApiKey.PRODUCE, 2, 11, "old-client", 1))
    for _ in range(data.draw(st.integers(1, 6))):
        pos = data.draw(st.integers(body_offset, len(frame) - 1))
        frame[pos] = data.draw(st.sampled_from([0x00, 0x01, 0x7F, 0x80, 0xFF, frame[pos] ^ 4]))
    cut = data.draw(st.integers(body_offset, len(frame)))
    try:
        acks, topics = legacy_produce_acks_and_partitions(bytes(frame[:cut]), body_offset)
    except MalformedMessage:
        return
    assert isinstance(acks, int)
    assert all(isinstance(name, str) for name, _ in topics)


@FUZZ
@given(body=st.binary(max_size=60))
def test_random_legacy_produce_bodies_raise_only_malformed_message(body: bytes) -> None:
    with contextlib.suppress(MalformedMessage):
        legacy_produce_acks_and_partitions(body, 0)


def test_frames_from_a_stream_feed_the_header_parser() -> None:
    # End to end through the sans-IO pieces: a damaged frame never escapes as a crash.
    stream = b"".join(encode_frame(h) for h in HEADERS) + encode_frame(b"\x00\x00")
    frames = FrameDecoder().feed(stream)
    assert len(frames) == len(HEADERS) + 1
    for frame in frames[:-1]:
        parse_request_header(frame)
    with pytest.raises(MalformedFrame):
        parse_request_header(frames[-1])


def test_cramjam_is_what_the_bomb_test_assumes() -> None:
    # The concatenated-frame bomb relies on multi-frame input decoding as one stream.
    chunk = compress(Compression.ZSTD, b"ab" * 10)
    assert bytes(cramjam.zstd.decompress(chunk * 3)) == b"ab" * 30
