"""One partition's record batches as their headers declare them, read once.

Contract: :meth:`PartitionBatches.read` walks the batch headers of a
partition's ``records`` bytes (``data[start:end]``, where they lie in the
request frame) once and keeps what every later step asks of them: the
headers, the number of batches and records they declare, and the size of
each compressed records block. The produce path's tally, its decode-offload
decision (inline or on a thread, and the worst-case memory to reserve), the
decode itself and the rejection metrics all read this one value instead of
walking the headers again. Framing and magic are checked, CRCs are not (the
decode does that); a partition whose headers cannot be read is a value too
(:attr:`PartitionBatches.error`), counted as no batches, which the decode then
refuses the way it always did.
"""

from __future__ import annotations

from dataclasses import dataclass

from kiproxy.protocol._codec import SlotsMaker
from kiproxy.protocol.errors import ProtocolError
from kiproxy.protocol.records import BATCH_HEADER_SIZE, RecordBatchHeader, read_batch_headers

__all__ = ["PartitionBatches"]

_LOG_OVERHEAD = 12  # baseOffset + batchLength: the bytes batchLength does not count


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionBatches:
    """The batch headers of one partition's ``records`` bytes and what they declare."""

    start: int
    """Where the partition's records start in the frame."""
    end: int
    """Where they end (exclusive)."""
    headers: tuple[RecordBatchHeader, ...]
    """Every batch's header, in order (empty when :attr:`error` is set)."""
    records: int
    """Records the batches declare, in all (control batches included)."""
    compressed_blocks: tuple[int, ...]
    """Stored size of each compressed records block (uncompressed batches have none)."""
    error: ProtocolError | None = None
    """Why the headers could not be read (the decode refuses the partition)."""

    @classmethod
    def read(cls, data: bytes, start: int = 0, end: int | None = None) -> PartitionBatches:
        """The view of ``data[start:end]`` (all of ``data`` by default)."""
        stop = len(data) if end is None else end
        if stop == start:
            return cls(start=start, end=stop, headers=(), records=0, compressed_blocks=())
        try:
            headers = read_batch_headers(data, start, stop)
        except ProtocolError as exc:
            return cls(start=start, end=stop, headers=(), records=0, compressed_blocks=(),
                       error=exc)
        records = 0
        blocks: list[int] = []
        for h in headers:  # one pass: this runs for every intercepted partition
            records += h.record_count
            if h.attributes & 0x07:
                blocks.append(h.batch_length + _LOG_OVERHEAD - BATCH_HEADER_SIZE)
        # Every field given, in order, without the frozen __init__ (see SlotsMaker).
        view: PartitionBatches = _from_fields(start, stop, tuple(headers), records,
                                              tuple(blocks), None)
        return view

    @property
    def size(self) -> int:
        """Bytes of the partition's ``records`` field."""
        return self.end - self.start

    @property
    def batches(self) -> int:
        """Batches the partition holds (0 when its headers cannot be read)."""
        return len(self.headers)

    @property
    def compressed(self) -> bool:
        """Some batch's records block is compressed."""
        return bool(self.compressed_blocks)


_from_fields = SlotsMaker(PartitionBatches)
