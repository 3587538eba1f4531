"""Re-encoding a fetched batch: new contents, the same place in the log.

For every codec, a batch as a broker stores it (base offset, leader epoch, producer id,
epoch and sequence, transactional bit, gaps left by compaction in its offsets and a max
timestamp from a removed record) re-encoded with new values keeps every header field
but the CRC and length, and every record's offset and timestamp. Changing the count, an
offset or a timestamp, or touching a control batch, is refused naming the record.
"""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiproxy.protocol.batch_reencode import BatchShapeChanged, reencode_batch
from kiproxy.protocol.records import (
    Compression,
    Record,
    RecordBatchHeader,
    TimestampType,
    build_batch,
    decode_batch,
    encode_batch,
)

_LOG_APPEND = 0x08
_TRANSACTIONAL = 0x10


def _stored_batch(codec: Compression, attributes: int = _TRANSACTIONAL) -> bytes:
    """A batch as the log holds it after compaction: offsets 0, 3 and 5 of 0..9 kept."""
    header = RecordBatchHeader(
        base_offset=1_000_000, batch_length=0, partition_leader_epoch=17, crc=0,
        attributes=attributes | int(codec), last_offset_delta=9,
        base_timestamp=1_700_000_000_000, max_timestamp=1_700_000_000_900,
        producer_id=4242, producer_epoch=3, base_sequence=77, record_count=3)
    records = tuple(Record(key=b"k%d" % d, value=b"value %d" % d, headers=[("h", b"%d" % d)],
                           timestamp=1_700_000_000_000 + 10 * d, offset_delta=d)
                    for d in (0, 3, 5))
    return encode_batch(header, records, renumber=False, keep_extent=True)


def _unchanging(h: RecordBatchHeader) -> RecordBatchHeader:
    return dataclasses.replace(h, crc=0, batch_length=0)


@pytest.mark.parametrize("codec", list(Compression))
@pytest.mark.parametrize("attributes", [_TRANSACTIONAL, _LOG_APPEND, 0])
def test_new_values_keep_every_header_field_offset_and_timestamp(
        codec: Compression, attributes: int) -> None:
    original = decode_batch(_stored_batch(codec, attributes))
    assert original.header.last_offset_delta == 9  # the input is what compaction leaves
    new = [r.with_value(b"encrypted " + (r.value or b"") * 20).with_headers([("enc", b"1")])
           for r in original.records]
    again = decode_batch(reencode_batch(original, new))
    assert _unchanging(again.header) == _unchanging(original.header)
    assert again.header.compression is codec
    assert [(r.offset_delta, r.timestamp, r.key) for r in again.records] == [
        (r.offset_delta, r.timestamp, r.key) for r in original.records]
    assert [r.value for r in again.records] == [r.value for r in new]
    assert [r.headers for r in again.records] == [r.headers for r in new]


@settings(max_examples=100, deadline=None)
@given(values=st.lists(st.one_of(st.none(), st.binary(max_size=50)), min_size=3, max_size=3),
       codec=st.sampled_from(list(Compression)))
def test_bytes_in_give_the_same_batch_as_a_decoded_batch(values: list[bytes | None],
                                                          codec: Compression) -> None:
    raw = _stored_batch(codec)
    new = [r.with_value(v) for r, v in zip(decode_batch(raw).records, values, strict=True)]
    assert reencode_batch(raw, new) == reencode_batch(decode_batch(raw), new)


def test_the_records_decoded_give_back_the_original_bytes() -> None:
    raw = _stored_batch(Compression.ZSTD)
    assert reencode_batch(raw, decode_batch(raw).records) == raw


def test_count_offset_and_timestamp_changes_are_refused() -> None:
    batch = decode_batch(_stored_batch(Compression.GZIP))
    records = list(batch.records)
    with pytest.raises(BatchShapeChanged, match="holds 3 records, 2 were given"):
        reencode_batch(batch, records[:2])
    with pytest.raises(BatchShapeChanged, match=r"record 1: offset delta 4 given for 3 "
                                                r"\(offset 1000003\)"):
        reencode_batch(batch, [records[0], records[1].with_offset_delta(4), records[2]])
    with pytest.raises(BatchShapeChanged, match=r"record 2 .* timestamp"):
        reencode_batch(batch, [*records[:2], records[2].with_timestamp(5)])


def test_a_control_batch_passes_as_it_came() -> None:
    marker = build_batch([Record(key=b"\x00\x00\x00\x00", value=b"\x00\x00\x00\x00\x00\x00",
                                 timestamp=5)], control=True, transactional=True,
                         producer_id=1, producer_epoch=0,
                         timestamp_type=TimestampType.CREATE_TIME)
    batch = decode_batch(marker)
    with pytest.raises(BatchShapeChanged, match="control batch"):
        reencode_batch(batch, [batch.records[0].with_value(b"x")])
    assert reencode_batch(batch, batch.records) == marker
