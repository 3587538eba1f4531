"""A batch header read from the wire is the same value its dataclass constructor makes."""

from __future__ import annotations

import dataclasses

from kiproxy.protocol.records import (
    Record,
    RecordBatchHeader,
    build_batch,
    read_batch_headers,
)


def test_a_header_read_equals_the_one_built_from_its_fields() -> None:
    data = build_batch([Record(value=b"v%d" % i, timestamp=1_700_000_000_000 + i)
                        for i in range(3)],
                       producer_id=7, producer_epoch=2, base_sequence=40)
    (read,) = read_batch_headers(data)
    built = RecordBatchHeader(**{f.name: getattr(read, f.name)
                                 for f in dataclasses.fields(RecordBatchHeader)})
    assert read == built and hash(read) == hash(built) and repr(read) == repr(built)
    assert (read.producer_id, read.producer_epoch, read.base_sequence, read.record_count) \
        == (7, 2, 40, 3)
    assert dataclasses.replace(read, base_offset=5).base_offset == 5
