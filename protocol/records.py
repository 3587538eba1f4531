"""Kafka record batches (magic 2): decode a partition's ``records`` bytes and encode them back.

Layout of one batch (61-byte header, then the records block)::

    baseOffset int64 | batchLength int32 | partitionLeaderEpoch int32 | magic int8
    crc uint32 (CRC-32C over attributes..end) | attributes int16 | lastOffsetDelta int32
    baseTimestamp int64 | maxTimestamp int64 | producerId int64 | producerEpoch int16
    baseSequence int32 | recordCount int32 | records

The records block is compressed as a whole when the codec bits of attributes are
set. Decoding keeps every header field, so an encoded batch carries the same
producer id, epoch, base sequence, leader epoch and timestamps as the original.
The per-record loops are compiled (:mod:`protocol._codec`), and so are the header's read
and write for every header that reads and every value that fits (the Python code here
reads the rest and names what is wrong).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from crc32c import crc32c

from kiproxy.protocol._codec import (
    Header,
    Record,
    SlotsMaker,
    batch_around,
    block_carries_header,
    block_header_value,
    block_moved,
    block_of,
    carries_header,
    check_block,
    decode_records,
    encode_records,
    first_moved,
    open_block,
    open_values,
    read_batch_header,
    records_size,
    seal_values,
    upper_values,
    values_present,
)
from kiproxy.protocol.compression import (
    DEFAULT_DECOMPRESSION_LIMITS,
    DEFAULT_LEVELS,
    Compression,
    CompressionLevels,
    DecompressionLimits,
    compress,
    compression_from_attributes,
    decompress,
)
from kiproxy.protocol.errors import CorruptBatch, DecompressionLimitExceeded, UnsupportedMagic

__all__ = [
    "BATCH_HEADER_SIZE",
    "DEFAULT_DECOMPRESSION_LIMITS",
    "Compression",
    "CompressionLevels",
    "DecodedBatch",
    "DecompressionLimits",
    "Header",
    "Record",
    "RecordBatchHeader",
    "TimestampType",
    "block_carries_header",
    "block_header_value",
    "block_moved",
    "build_batch",
    "carries_header",
    "check_block",
    "decode_batch",
    "decode_batches",
    "decode_records",
    "decompress_block",
    "encode_batch",
    "encode_batch_parts",
    "encode_block_parts",
    "encode_records",
    "first_moved",
    "header_key_text",
    "open_block",
    "open_values",
    "read_batch_headers",
    "records_size",
    "seal_values",
    "upper_values",
    "values_present",
    "verify_batch_crc",
]

BATCH_HEADER_SIZE = 61
_LOG_OVERHEAD = 12  # baseOffset + batchLength: the bytes batchLength does not count
_CRC_START = 21
_HEADER = struct.Struct(">qiibIhiqqqhii")
_AFTER_CRC = struct.Struct(">hiqqqhii")

_TIMESTAMP_TYPE_BIT = 0x08
_TRANSACTIONAL_BIT = 0x10
_CONTROL_BIT = 0x20
_DELETE_HORIZON_BIT = 0x40


class TimestampType:
    """Values of attributes bit 3."""

    CREATE_TIME = 0
    LOG_APPEND_TIME = 1


@dataclass(frozen=True, slots=True, kw_only=True)
class RecordBatchHeader:
    """The fixed 61-byte header of a magic-2 record batch, every field kept."""

    base_offset: int
    """Offset of the first record (0 in a produce request)."""
    batch_length: int
    """Bytes after the batchLength field, as declared on the wire."""
    partition_leader_epoch: int
    """Leader epoch stamped by the broker (-1 from producers)."""
    crc: int
    """The declared CRC-32C of attributes..end."""
    attributes: int
    """Bits: 0-2 compression, 3 timestamp type, 4 transactional, 5 control, 6 delete horizon."""
    last_offset_delta: int
    """Offset delta of the last record."""
    base_timestamp: int
    """Timestamp (ms) that record timestamp deltas are relative to."""
    max_timestamp: int
    """Largest record timestamp (ms), or the log-append time."""
    producer_id: int
    """Idempotent/transactional producer id, -1 if none."""
    producer_epoch: int
    """Producer epoch, -1 if none."""
    base_sequence: int
    """Sequence number of the first record, -1 if none."""
    record_count: int
    """Number of records the batch declares."""

    @property
    def compression(self) -> Compression:
        """The compression codec of the records block."""
        return compression_from_attributes(self.attributes)

    @property
    def timestamp_type(self) -> int:
        """:attr:`TimestampType.CREATE_TIME` or :attr:`TimestampType.LOG_APPEND_TIME`."""
        return 1 if self.attributes & _TIMESTAMP_TYPE_BIT else 0

    @property
    def is_transactional(self) -> bool:
        """Whether the batch belongs to a transaction."""
        return bool(self.attributes & _TRANSACTIONAL_BIT)

    @property
    def is_control(self) -> bool:
        """Whether the batch holds control records (transaction markers)."""
        return bool(self.attributes & _CONTROL_BIT)

    @property
    def has_delete_horizon(self) -> bool:
        """Whether base_timestamp is a delete horizon set by compaction."""
        return bool(self.attributes & _DELETE_HORIZON_BIT)


@dataclass(frozen=True, slots=True, kw_only=True)
class DecodedBatch:
    """A decoded record batch: its header, its records and the bytes it came from."""

    header: RecordBatchHeader
    """Every field of the batch header, as read."""
    records: tuple[Record, ...]
    """The records, in order."""
    raw: bytes | memoryview = field(default=b"", repr=False)
    """The batch's original bytes, forwarded as-is when nothing changed (a view into
    the bytes it was decoded from when those hold more than this batch)."""
    block_size: int = 0
    """Bytes of the records block once decompressed (its stored size when uncompressed)."""

    def records_block(self) -> memoryview:
        """The records block: where it lies in :attr:`raw`, or the bytes it was
        decompressed into (which the decoded records read their fields from)."""
        if self.header.compression is Compression.NONE:
            return memoryview(self.raw)[BATCH_HEADER_SIZE:]
        block = block_of(self.records[0]) if self.records else None
        return memoryview(block if block is not None else b"")


# A header read, and the decoded batch around it, are made without the frozen classes'
# __init__ (every field given, in order: the same values; see SlotsMaker).
_header_from_fields = SlotsMaker(RecordBatchHeader)
_decoded_from_fields = SlotsMaker(DecodedBatch)


def header_key_text(key: str) -> str:
    """A header key as text that any output can write: the key itself when it is UTF-8
    text, else (a key stored as bytes that are not UTF-8, read as lone surrogates: see
    :class:`Header`) with those bytes written as ``\\xNN`` escapes."""
    if key.isascii():
        return key
    try:
        key.encode()
    except UnicodeEncodeError:
        try:
            return key.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
        except UnicodeEncodeError:  # a surrogate that stands for no byte
            return key.encode("utf-8", "backslashreplace").decode()
    return key


def _read_header(data: bytes | bytearray, start: int, end: int, origin: int = 0
                 ) -> RecordBatchHeader:
    # A header that reads is read by compiled code into the same value; one that does
    # not is read here, which names what is wrong. Messages count bytes from ``origin``,
    # the start of the partition's records.
    header = read_batch_header(data, start, end, RecordBatchHeader)
    if header is not None:
        return header
    return _read_header_general(data, start, end, origin)


def _read_header_general(data: bytes | bytearray, start: int, end: int, origin: int = 0
                         ) -> RecordBatchHeader:
    """_read_header in Python: any header, and the error of one that does not read."""
    at = start - origin
    remaining = end - start
    if remaining < 17:
        raise CorruptBatch(
            f"record batch at byte {at}: {remaining} bytes cannot hold "
            "baseOffset, batchLength and magic"
        )
    magic = data[start + 16]
    if magic != 2:
        raise UnsupportedMagic(
            f"record batch at byte {at}: magic {magic} (old message format); "
            "only magic 2 record batches are supported"
        )
    if remaining < BATCH_HEADER_SIZE:
        raise CorruptBatch(
            f"record batch at byte {at}: {remaining} bytes, the header alone needs "
            f"{BATCH_HEADER_SIZE}"
        )
    (
        base_offset, batch_length, leader_epoch, _magic, crc, attributes, last_offset_delta,
        base_ts, max_ts, producer_id, producer_epoch, base_sequence, count,
    ) = _HEADER.unpack_from(data, start)
    if batch_length < BATCH_HEADER_SIZE - _LOG_OVERHEAD:
        raise CorruptBatch(
            f"record batch at byte {at}: batchLength {batch_length} is smaller than "
            f"the header ({BATCH_HEADER_SIZE - _LOG_OVERHEAD})"
        )
    if batch_length > remaining - _LOG_OVERHEAD:
        raise CorruptBatch(
            f"record batch at byte {at}: batchLength {batch_length} runs past the "
            f"{remaining - _LOG_OVERHEAD} bytes that follow"
        )
    if count < 0:
        raise CorruptBatch(f"record batch at byte {at}: recordCount {count} is negative")
    compression_from_attributes(attributes, at)
    header: RecordBatchHeader = _header_from_fields(
        base_offset, batch_length, leader_epoch, crc, attributes, last_offset_delta, base_ts,
        max_ts, producer_id, producer_epoch, base_sequence, count)
    return header


def read_batch_headers(data: bytes | bytearray, start: int = 0, end: int | None = None
                       ) -> list[RecordBatchHeader]:
    """Headers of every batch in a partition's ``records`` bytes, without decoding records.

    The records are ``data[start:end]`` (all of ``data`` by default). Checks framing and
    magic but not CRCs; cheap enough for passthrough accounting.
    """
    stop = len(data) if end is None else end
    out = []
    pos = start
    while pos < stop:
        header = _read_header(data, pos, stop, start)
        out.append(header)
        pos += _LOG_OVERHEAD + header.batch_length
    return out


def verify_batch_crc(data: bytes | memoryview, start: int, header: RecordBatchHeader,
                     origin: int = 0) -> None:
    """Raise :class:`~kiproxy.protocol.errors.CorruptBatch` unless the batch at
    ``data[start]``, whose header is ``header``, has the CRC-32C it declares (over its
    bytes from the attributes on). Messages count bytes from ``data[origin]``."""
    end = start + _LOG_OVERHEAD + header.batch_length
    actual = crc32c(memoryview(data)[start + _CRC_START : end])
    if actual != header.crc:
        raise CorruptBatch(
            f"record batch at byte {start - origin}: CRC-32C mismatch (declared "
            f"{header.crc:#010x}, computed {actual:#010x})"
        )


def _decompressed(data: bytes, start: int, header: RecordBatchHeader,
                  limits: DecompressionLimits, origin: int) -> bytes:
    """The records block of the compressed batch at ``data[start]``, decompressed within
    ``limits``; an error names the batch (bytes counted from ``data[origin]``)."""
    body_start = start + BATCH_HEADER_SIZE
    end = start + _LOG_OVERHEAD + header.batch_length
    limit, setting = limits.bound(end - body_start)
    try:
        return decompress(header.compression, memoryview(data)[body_start:end], limit,
                          setting)
    except DecompressionLimitExceeded as exc:
        raise DecompressionLimitExceeded(f"record batch at byte {start - origin}: {exc}",
                                         limit=exc.limit, setting=exc.setting) from None
    except CorruptBatch as exc:
        raise CorruptBatch(f"record batch at byte {start - origin}: {exc}") from None


def decompress_block(data: bytes, start: int, header: RecordBatchHeader, *, origin: int = 0,
                     limits: DecompressionLimits = DEFAULT_DECOMPRESSION_LIMITS) -> bytes:
    """The records block of the compressed batch at ``data[start]`` (whose header is
    ``header``), its CRC checked, decompressed within ``limits``, no record decoded
    (:func:`decode_batch`'s first half). Raises what :func:`decode_batch` raises for
    the same batch, with the same messages (bytes counted from ``data[origin]``)."""
    if header.compression is Compression.NONE:
        raise ValueError("decompress_block: the batch is not compressed")
    verify_batch_crc(data, start, header, origin)
    return _decompressed(data, start, header, limits, origin)


def decode_batch(
    data: bytes,
    start: int = 0,
    *,
    stop: int | None = None,
    origin: int = 0,
    verify_crc: bool = True,
    limits: DecompressionLimits = DEFAULT_DECOMPRESSION_LIMITS,
    header: RecordBatchHeader | None = None,
) -> DecodedBatch:
    """Decode the batch starting at ``data[start]``; it must end by ``data[stop]``
    (the end of ``data`` by default). Error messages count bytes from ``data[origin]``.

    Raises a :class:`kiproxy.protocol.errors.CorruptBatch` subclass for anything malformed:
    truncation, old magic, a CRC mismatch, an unknown codec, a bad record, and
    :class:`~kiproxy.protocol.compression.DecompressionLimitExceeded` for a records block
    that decompresses past ``limits`` (decompression stops there). ``header`` is the
    batch's header when it was read already (by :func:`read_batch_headers`).
    """
    if header is None:
        header = _read_header(data, start, len(data) if stop is None else stop, origin)
    end = start + _LOG_OVERHEAD + header.batch_length
    if verify_crc:
        verify_batch_crc(data, start, header, origin)
    if header.compression is Compression.NONE:  # the records where they lie
        block, at, stop_at, block_origin = data, start + BATCH_HEADER_SIZE, end, origin
    else:
        block = _decompressed(data, start, header, limits, origin)
        at, stop_at, block_origin = 0, len(block), 0
    try:
        records = decode_records(block, at, stop_at, header.record_count,
                                 header.base_timestamp, block_origin)
    except CorruptBatch as exc:
        raise CorruptBatch(f"record batch at byte {start - origin}: {exc}") from None
    block_size = stop_at - at
    del block
    raw = data if start == 0 and end == len(data) else memoryview(data)[start:end]
    decoded: DecodedBatch = _decoded_from_fields(header, records, raw, block_size)
    return decoded


def decode_batches(
    data: bytes,
    start: int = 0,
    end: int | None = None,
    *,
    verify_crc: bool = True,
    limits: DecompressionLimits = DEFAULT_DECOMPRESSION_LIMITS,
    headers: Sequence[RecordBatchHeader] | None = None,
) -> list[DecodedBatch]:
    """Decode every batch in a partition's ``records`` bytes (several may follow each other).

    The records are ``data[start:end]`` (all of ``data`` by default): a partition is
    decoded where it lies in its request frame, without a copy. ``headers`` are the
    batches' headers when :func:`read_batch_headers` read them already (they are not
    read again).
    """
    stop = len(data) if end is None else end
    out = []
    pos = start
    known = headers or ()
    count = len(known)
    index = 0
    while pos < stop:
        batch = decode_batch(
            data, pos, stop=stop, origin=start, verify_crc=verify_crc, limits=limits,
            header=known[index] if index < count else None)
        out.append(batch)
        index += 1
        pos += _LOG_OVERHEAD + batch.header.batch_length
    return out


def encode_batch(
    header: RecordBatchHeader,
    records: tuple[Record, ...],
    *,
    renumber: bool = True,
    compression: Compression | None = None,
    levels: CompressionLevels = DEFAULT_LEVELS,
    keep_extent: bool = False,
) -> bytes:
    """Encode ``records`` as one batch that keeps every field of ``header``.

    Producer id, epoch, base sequence, leader epoch, base offset, base timestamp
    and the transactional/control bits are kept; the record count, last offset
    delta, max timestamp (for CreateTime), batch length and CRC are recomputed.
    With ``renumber`` (what a produce request needs) offset deltas become 0..n-1.
    ``compression`` overrides the header's codec; ``levels`` sets its level.
    ``keep_extent`` keeps the header's last offset delta and max timestamp too (a batch
    read from the log, whose compacted-away records still count in both).
    """
    return b"".join(encode_batch_parts(header, records, renumber=renumber,
                                       compression=compression, levels=levels,
                                       keep_extent=keep_extent))


def encode_batch_parts(
    header: RecordBatchHeader,
    records: tuple[Record, ...],
    *,
    renumber: bool = True,
    compression: Compression | None = None,
    levels: CompressionLevels = DEFAULT_LEVELS,
    keep_extent: bool = False,
) -> tuple[bytes, bytes, bytes]:
    """:func:`encode_batch` as the three pieces it joins (the header to the CRC, the rest
    of the header, the records block): for a caller that writes them on with other
    pieces, so that the block is copied once, not twice."""
    block, max_ts = encode_records(records, header.base_timestamp, renumber)
    attributes = header.attributes
    if compression is not None:
        attributes = (attributes & ~0x07) | int(compression)
    if not records or keep_extent:
        last_offset_delta = header.last_offset_delta
    elif renumber:
        last_offset_delta = len(records) - 1
    else:
        last_offset_delta = records[-1].offset_delta
    if max_ts is None or keep_extent or attributes & _TIMESTAMP_TYPE_BIT:
        max_ts = header.max_timestamp
    return _around(header, attributes, last_offset_delta, max_ts, len(records), block, levels)


def encode_block_parts(
    header: RecordBatchHeader,
    block: bytes,
    *,
    levels: CompressionLevels = DEFAULT_LEVELS,
) -> tuple[bytes, bytes, bytes]:
    """The batch of ``header`` around a new records ``block`` (uncompressed, holding the
    header's ``record_count`` records), as :func:`encode_batch_parts` gives it: every
    header field kept but the batch length and CRC, the block compressed with the
    header's codec. For a batch read from the log whose records were rewritten where
    they lie."""
    return _around(header, header.attributes, header.last_offset_delta, header.max_timestamp,
                   header.record_count, block, levels)


def _around(header: RecordBatchHeader, attributes: int, last_offset_delta: int, max_ts: int,
            count: int, block: bytes, levels: CompressionLevels) -> tuple[bytes, bytes, bytes]:
    """The three pieces of a batch: to the CRC, the rest of the header, the block."""
    codec = compression_from_attributes(attributes)
    if codec is not Compression.NONE:
        block = compress(codec, block, levels)
    parts = batch_around(header, attributes, last_offset_delta, max_ts, count, block)
    if parts is not None:  # compiled, the same bytes; Python when struct.pack would raise
        return parts
    return _pieces_general(header, attributes, last_offset_delta, max_ts, count, block)


def _pieces_general(header: RecordBatchHeader, attributes: int, last_offset_delta: int,
                    max_ts: int, count: int, block: bytes) -> tuple[bytes, bytes, bytes]:
    """_around's pieces around a block already compressed, in Python: for any values."""
    after_crc = _AFTER_CRC.pack(
        attributes, last_offset_delta, header.base_timestamp, max_ts,
        header.producer_id, header.producer_epoch, header.base_sequence, count,
    )
    crc = crc32c(block, crc32c(after_crc))
    prefix = struct.pack(
        ">qiibI", header.base_offset, BATCH_HEADER_SIZE - _LOG_OVERHEAD + len(block),
        header.partition_leader_epoch, 2, crc,
    )
    return prefix, after_crc, block


def build_batch(
    records: tuple[Record, ...] | list[Record],
    *,
    compression: Compression = Compression.NONE,
    base_offset: int = 0,
    partition_leader_epoch: int = -1,
    producer_id: int = -1,
    producer_epoch: int = -1,
    base_sequence: int = -1,
    transactional: bool = False,
    control: bool = False,
    timestamp_type: int = TimestampType.CREATE_TIME,
    base_timestamp: int | None = None,
    max_timestamp: int | None = None,
) -> bytes:
    """Encode a new batch from records, the way a producer would (offset deltas 0..n-1)."""
    recs = tuple(records)
    attributes = int(compression)
    if timestamp_type == TimestampType.LOG_APPEND_TIME:
        attributes |= _TIMESTAMP_TYPE_BIT
    if transactional:
        attributes |= _TRANSACTIONAL_BIT
    if control:
        attributes |= _CONTROL_BIT
    if base_timestamp is None:
        base_timestamp = recs[0].timestamp if recs else -1
    header = RecordBatchHeader(
        base_offset=base_offset, batch_length=0, partition_leader_epoch=partition_leader_epoch,
        crc=0, attributes=attributes, last_offset_delta=max(len(recs) - 1, 0),
        base_timestamp=base_timestamp,
        max_timestamp=max_timestamp if max_timestamp is not None else base_timestamp,
        producer_id=producer_id, producer_epoch=producer_epoch, base_sequence=base_sequence,
        record_count=len(recs),
    )
    return encode_batch(header, recs, renumber=True)
