"""One fetched partition's ``records`` bytes split into batches, no record decoded.

Contract: :func:`split_fetched_records` walks ``data[start:end]`` - a partition's
``records`` field in a Fetch response, located by
:func:`~kiproxy.protocol.fetch_response.read_fetch_response` - the way Kafka's consumer
does (``ByteBufferLogInputStream``), and returns a :class:`FetchedRecords`: every whole
batch's span, its magic and, for magic 2, its 61-byte header; and where the partial
batch at the end begins, if there is one. What brokers really send is covered:

- any number of batches back to back;
- a last batch cut short by the request's byte limits: kept as the broker sent it
  (:attr:`FetchedRecords.tail`), never read past its first bytes, never decoded; the
  consumer drops it and fetches again from its offset;
- control batches (transaction markers): flagged by their header
  (:attr:`~kiproxy.protocol.records.RecordBatchHeader.is_control`), never decoded;
- legacy message sets (magic 0 and 1, from topics written in the old format):
  :attr:`FetchedBatch.legacy`, spanned by their size field, passed undecoded.

Nothing is decompressed and no CRC is checked (the consumer checks CRCs). A size or
magic that the consumer would refuse raises
:class:`~kiproxy.protocol.errors.CorruptBatch` naming the byte (counted from
``start``): a size below the smallest entry, a magic above 2, a magic-2 header that
does not hold together, an unknown codec.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

from kiproxy.protocol.errors import CorruptBatch
from kiproxy.protocol.records import BATCH_HEADER_SIZE, RecordBatchHeader, read_batch_headers

__all__ = ["FetchedBatch", "FetchedRecords", "split_fetched_records"]

LOG_OVERHEAD = 12
"""baseOffset int64 + size int32: the bytes every entry's size field does not count."""
_MAGIC_AT = 16
"""The magic byte follows baseOffset, size and (epoch or CRC) in every format."""
_LEGACY_MIN_SIZE = 14
"""A magic 0 message's smallest size (crc, magic, attributes, null key and value)."""
_SIZE = struct.Struct(">i")


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchedBatch:
    """One whole batch (or legacy message-set entry) and where it lies."""

    start: int
    """The batch's first byte (its base offset), an absolute position in the frame."""
    end: int
    """One past its last byte."""
    magic: int
    """2 for a record batch; 0 or 1 for a legacy message-set entry."""
    header: RecordBatchHeader | None
    """The batch header (magic 2); None for a legacy entry."""

    @property
    def legacy(self) -> bool:
        """Whether this is an old-format (magic 0 or 1) entry, passed undecoded."""
        return self.header is None

    @property
    def is_control(self) -> bool:
        """Whether the batch holds control records (transaction markers)."""
        return self.header is not None and self.header.is_control


@dataclass(frozen=True, slots=True, kw_only=True)
class FetchedRecords:
    """A partition's fetched ``records`` bytes split into whole batches and a tail."""

    start: int
    """Where the records start in the frame."""
    end: int
    """Where they end (exclusive)."""
    batches: tuple[FetchedBatch, ...]
    """Every whole batch, in order."""
    tail: int
    """Where the partial last batch starts (``end`` when every batch is whole)."""

    @property
    def partial(self) -> bool:
        """Whether the last batch was cut short (the bytes ``[tail, end)``)."""
        return self.tail != self.end

    @property
    def legacy(self) -> bool:
        """Whether some entry is in the old message format."""
        return any(b.header is None for b in self.batches)


def split_fetched_records(data: bytes | bytearray, start: int = 0, end: int | None = None
                          ) -> FetchedRecords:
    """The batches of ``data[start:end]`` (all of ``data`` by default); see the module
    contract. Raises :class:`CorruptBatch` for an entry the consumer would refuse."""
    stop = len(data) if end is None else end
    batches = []
    pos = start
    while stop - pos >= LOG_OVERHEAD:
        (size,) = _SIZE.unpack_from(data, pos + 8)
        if size < _LEGACY_MIN_SIZE:
            raise CorruptBatch(f"fetched records: batch at byte {pos - start} declares "
                               f"size {size}, below the smallest entry ({_LEGACY_MIN_SIZE})")
        if stop - pos <= _MAGIC_AT:
            break  # cut before its magic: a partial batch
        magic = data[pos + _MAGIC_AT]
        if magic > 2:
            raise CorruptBatch(f"fetched records: batch at byte {pos - start} has magic "
                               f"{magic}; 0, 1 and 2 exist")
        batch_end = pos + LOG_OVERHEAD + size
        if batch_end > stop:
            break  # cut short by the fetch's byte limit: kept as it came
        header = None
        if magic == 2:
            if size < BATCH_HEADER_SIZE - LOG_OVERHEAD:
                raise CorruptBatch(f"fetched records: batch at byte {pos - start}: size "
                                   f"{size} is smaller than a record batch header")
            try:
                (header,) = read_batch_headers(data, pos, batch_end)
            except CorruptBatch as exc:  # its message counts bytes from the batch
                raise type(exc)(f"fetched records: batch at byte {pos - start}: {exc}"
                                ) from None
        batches.append(FetchedBatch(start=pos, end=batch_end, magic=magic, header=header))
        pos = batch_end
    return FetchedRecords(start=start, end=stop, batches=tuple(batches), tail=pos)
