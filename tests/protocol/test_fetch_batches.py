"""Splitting fetched records into batches the way a consumer reads them.

Whole batches of every codec, control batches and old-format (magic 0 and 1) entries
are spanned and flagged; a last batch cut at any byte is the tail, never read as a
batch; sizes and magics a consumer refuses are :class:`CorruptBatch` naming the byte.
"""

from __future__ import annotations

import struct
import zlib

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiproxy.protocol.errors import CorruptBatch, UnsupportedCompression
from kiproxy.protocol.fetch_batches import split_fetched_records
from kiproxy.protocol.records import Compression, Record, build_batch, read_batch_headers


def _batch(offset: int, n: int, codec: Compression = Compression.NONE, *,
           control: bool = False, transactional: bool = False) -> bytes:
    records = [Record(key=b"k%d" % i, value=b"v" * (i + 5), timestamp=1000 + i)
               for i in range(n)]
    return build_batch(records, base_offset=offset, compression=codec, control=control,
                       transactional=transactional, producer_id=9 if transactional else -1,
                       producer_epoch=0 if transactional else -1,
                       base_sequence=offset if transactional else -1)


def _legacy(offset: int, magic: int, value: bytes) -> bytes:
    """One old-format message: crc, magic, attributes, [timestamp], null key, value."""
    body = bytes([magic, 0]) + (struct.pack(">q", 1000) if magic == 1 else b"")
    body += struct.pack(">i", -1) + struct.pack(">i", len(value)) + value
    message = struct.pack(">I", zlib.crc32(body)) + body
    return struct.pack(">qi", offset, len(message)) + message


def _mixed() -> list[bytes]:
    return [_batch(0, 3), _batch(3, 2, Compression.GZIP, transactional=True),
            _batch(5, 1, control=True, transactional=True), _batch(6, 4, Compression.ZSTD),
            _batch(10, 2, Compression.LZ4), _batch(12, 2, Compression.SNAPPY)]


def test_whole_batches_of_every_kind_are_spanned_with_their_headers() -> None:
    parts = _mixed()
    data = b"".join(parts)
    prefix = b"frame bytes before the records"
    split = split_fetched_records(prefix + data, len(prefix))
    assert not split.partial and split.tail == split.end == len(prefix) + len(data)
    assert [(b.start - len(prefix), b.end - len(prefix)) for b in split.batches] == [
        (sum(map(len, parts[:i])), sum(map(len, parts[:i + 1]))) for i in range(len(parts))]
    assert [b.header for b in split.batches] == read_batch_headers(data)
    assert [b.is_control for b in split.batches] == [False, False, True, False, False, False]
    assert not split.legacy


@settings(max_examples=200, deadline=None)
@given(cut=st.integers(0, sum(map(len, _mixed())) - 1))
def test_a_batch_cut_at_any_byte_is_the_tail(cut: int) -> None:
    parts = _mixed()
    data = b"".join(parts)[:cut]
    split = split_fetched_records(data)
    whole = 0
    while whole < len(parts) and sum(map(len, parts[:whole + 1])) <= cut:
        whole += 1
    assert len(split.batches) == whole
    assert split.tail == sum(map(len, parts[:whole]))
    assert split.partial == (split.tail != cut)


def test_old_format_entries_are_flagged_and_passed_undecoded() -> None:
    data = _legacy(0, 0, b"zero") + _legacy(1, 1, b"one") + _batch(2, 2)
    split = split_fetched_records(data)
    assert [(b.magic, b.legacy) for b in split.batches] == [(0, True), (1, True), (2, False)]
    assert split.legacy and split.batches[0].header is None
    assert split.batches[-1].end == len(data)


def test_sizes_and_magics_a_consumer_refuses_are_corrupt() -> None:
    good = _batch(0, 1)
    tiny = good + struct.pack(">qi", 1, 13) + b"\x00" * 13
    with pytest.raises(CorruptBatch, match=f"batch at byte {len(good)} declares size 13"):
        split_fetched_records(tiny)
    magic3 = bytearray(_batch(0, 1))
    magic3[16] = 3
    with pytest.raises(CorruptBatch, match="batch at byte 0 has magic 3"):
        split_fetched_records(bytes(magic3))
    short_v2 = struct.pack(">qii", 0, 20, 0) + b"\x02" + b"\x00" * 19
    with pytest.raises(CorruptBatch, match="smaller than a record batch header"):
        split_fetched_records(short_v2)
    codec7 = bytearray(_batch(0, 1))
    codec7[22] |= 0x07  # attributes' low byte: compression 7 does not exist
    with pytest.raises(UnsupportedCompression, match=f"batch at byte {len(good)}: "):
        split_fetched_records(good + bytes(codec7))


def test_empty_records_hold_no_batch() -> None:
    split = split_fetched_records(b"xyz", 3)
    assert split.batches == () and not split.partial


@settings(max_examples=500, deadline=None)
@given(data=st.binary(max_size=300), at=st.integers(0, 20))
def test_any_bytes_split_into_batches_within_them_or_are_corrupt(data: bytes, at: int) -> None:
    good = _batch(0, 2)
    for records in (data, good + data, good[:at] + data):
        try:
            split = split_fetched_records(records)
        except CorruptBatch:
            continue
        assert split.start <= split.tail <= split.end == len(records)
        ends = [split.start] + [b.end for b in split.batches]
        assert all(b.start == prev < b.end for b, prev in zip(split.batches, ends,
                                                              strict=False))
