"""Re-encoding a batch read from the log with new record contents, its place in the log kept.

Contract: :func:`reencode_batch` writes a decoded magic-2 batch (from a Fetch response)
back with new records that may differ from the old ones in their keys, values and
headers only. Everything that places the batch in the log and that a consumer acts on is
kept from the original header: base offset, last offset delta, partition leader epoch,
attributes (codec, timestamp type, transactional and control bits, delete horizon),
base and max timestamp, producer id and epoch, base sequence; and from each record its
offset delta and timestamp. The records block is compressed again with the batch's own
codec; the batch length and CRC-32C are computed anew.

A change the log could not have made - another record count, an offset delta or a
timestamp changed - raises :class:`BatchShapeChanged` naming the record, since a
consumer would skip or repeat offsets. A control batch (a transaction marker, read by
the consumer itself) is refused the same way: it passes as it came. Records that are
the very objects decoded (no record replaced) give back the original bytes.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence

from kiproxy.protocol.compression import DEFAULT_LEVELS, CompressionLevels
from kiproxy.protocol.records import (
    DecodedBatch,
    Record,
    decode_batch,
    encode_batch_parts,
    first_moved,
)

__all__ = ["BatchShapeChanged", "reencode_batch", "reencode_batch_parts"]


class BatchShapeChanged(ValueError):
    """New records that do not fit the batch's place in the log (count, offsets or
    timestamps changed), or a control batch asked to change."""


def reencode_batch(
    original: DecodedBatch | bytes,
    records: Sequence[Record],
    *,
    levels: CompressionLevels = DEFAULT_LEVELS,
) -> bytes:
    """``original`` (a decoded batch, or one batch's bytes, decoded here with its CRC
    checked) encoded again with ``records``; see the module contract."""
    parts = reencode_batch_parts(original, records, levels=levels)
    return parts[0] if len(parts) == 1 else b"".join(parts)


def reencode_batch_parts(
    original: DecodedBatch | bytes,
    records: Sequence[Record],
    *,
    levels: CompressionLevels = DEFAULT_LEVELS,
) -> tuple[bytes, ...]:
    """:func:`reencode_batch` as pieces whose concatenation is the batch (written on
    with other pieces, the records block is copied once)."""
    batch = decode_batch(original) if isinstance(original, bytes) else original
    header = batch.header
    old = batch.records
    new = tuple(records)
    where = f"batch at offset {header.base_offset}"
    if len(new) == len(old) and all(map(operator.is_, new, old)):
        return (bytes(batch.raw),) if batch.raw else encode_batch_parts(
            header, new, renumber=False, levels=levels, keep_extent=True)
    if header.is_control:
        raise BatchShapeChanged(f"{where} is a control batch (a transaction marker); "
                                "it cannot be changed, pass it on as it came")
    if len(new) != len(old):
        raise BatchShapeChanged(f"{where} holds {len(old)} records, {len(new)} were given: "
                                "records can be changed, not added or removed")
    i = first_moved(old, new)
    if i >= 0:
        a, b = old[i], new[i]
        if a.offset_delta != b.offset_delta:
            raise BatchShapeChanged(
                f"{where}, record {i}: offset delta {b.offset_delta} given for "
                f"{a.offset_delta} (offset {header.base_offset + a.offset_delta})")
        raise BatchShapeChanged(
            f"{where}, record {i} (offset {header.base_offset + a.offset_delta}): "
            f"timestamp {b.timestamp} given for {a.timestamp}")
    return encode_batch_parts(header, new, renumber=False, levels=levels, keep_extent=True)
