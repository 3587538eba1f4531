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

from collections.abc import Sequence

from kiproxy.protocol.compression import DEFAULT_LEVELS, CompressionLevels
from kiproxy.protocol.records import DecodedBatch, Record, decode_batch, encode_batch

__all__ = ["BatchShapeChanged", "reencode_batch"]


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
    batch = decode_batch(original) if isinstance(original, bytes) else original
    header = batch.header
    old = batch.records
    new = tuple(records)
    where = f"batch at offset {header.base_offset}"
    if len(new) == len(old) and all(a is b for a, b in zip(new, old, strict=True)):
        return bytes(batch.raw) if batch.raw else encode_batch(
            header, new, renumber=False, levels=levels, keep_extent=True)
    if header.is_control:
        raise BatchShapeChanged(f"{where} is a control batch (a transaction marker); "
                                "it cannot be changed, pass it on as it came")
    if len(new) != len(old):
        raise BatchShapeChanged(f"{where} holds {len(old)} records, {len(new)} were given: "
                                "records can be changed, not added or removed")
    for i, (a, b) in enumerate(zip(old, new, strict=True)):
        if a.offset_delta != b.offset_delta:
            raise BatchShapeChanged(
                f"{where}, record {i}: offset delta {b.offset_delta} given for "
                f"{a.offset_delta} (offset {header.base_offset + a.offset_delta})")
        if a.timestamp != b.timestamp:
            raise BatchShapeChanged(
                f"{where}, record {i} (offset {header.base_offset + a.offset_delta}): "
                f"timestamp {b.timestamp} given for {a.timestamp}")
    return encode_batch(header, new, renumber=False, levels=levels, keep_extent=True)
