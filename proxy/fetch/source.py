"""One fetched batch on its way through a partition's fetch-side hooks.

Contract. A :class:`BatchSource` says where its batch lies in the Fetch answer, gives
its records block once a block hook needs it (an uncompressed batch's where it lies in
the answer, its CRC checked once; a compressed one's decompressed), and its decoded
form once a link needs records (decoded once, on the loop or on a decode thread within
``max_decode_memory``). A batch that only block hooks see is never decoded. Raises
:class:`~kiproxy.protocol.errors.CorruptBatch` for a batch that cannot be read.
"""

from __future__ import annotations

from kiproxy.protocol.fetch_batches import LOG_OVERHEAD, FetchedBatch
from kiproxy.protocol.partition_batches import PartitionBatches
from kiproxy.protocol.records import (
    BATCH_HEADER_SIZE,
    DecodedBatch,
    Record,
    RecordBatchHeader,
    verify_batch_crc,
)
from kiproxy.proxy.produce.offload import DecodeLease

__all__ = ["BatchSource"]


class BatchSource:
    """One batch on its way through the chain: where it lies in the response, its
    records block once a block hook needs it, and its decoded form once a link needs
    records. The block of an uncompressed batch is the response's own bytes, its CRC
    checked; that of a compressed one is decompressed, not decoded. A batch that only
    block hooks see is never decoded."""

    __slots__ = ("_block", "_decoded", "batch", "crc_checked", "frame", "header", "lease")

    def __init__(self, frame: bytes, batch: FetchedBatch, lease: DecodeLease) -> None:
        assert batch.header is not None
        self.frame = frame
        self.batch = batch
        self.header: RecordBatchHeader = batch.header
        self.lease = lease
        self._block: bytes | None = None
        self._decoded: DecodedBatch | None = None
        self.crc_checked = False
        """The batch's CRC was checked already (with others: :func:`verify_crcs`)."""

    @property
    def records(self) -> tuple[Record, ...] | None:
        """The batch's records, when it was decoded already."""
        return None if self._decoded is None else self._decoded.records

    def _batches(self) -> PartitionBatches:
        batch, header = self.batch, self.header
        blocks = (header.batch_length + LOG_OVERHEAD - BATCH_HEADER_SIZE,) \
            if header.attributes & 0x07 else ()
        return PartitionBatches(start=batch.start, end=batch.end, headers=(header,),
                                records=header.record_count, compressed_blocks=blocks)

    async def decoded(self) -> DecodedBatch:
        """The batch decoded (once; on the loop, or on a decode thread within
        ``max_decode_memory`` when large). Raises ``CorruptBatch``."""
        if self._decoded is None:
            (self._decoded,) = await self.lease.decode_partition(self.frame, self._batches())
            self._block = None  # the decoded batch holds it
        return self._decoded

    async def block_held(self) -> memoryview | None:
        """:meth:`block` of a compressed batch without waiting for the budget
        (:meth:`~kiproxy.proxy.produce.offload.DecodeLease.decompress_held`: held,
        reserved); None when the budget has no room now. Raises ``CorruptBatch``."""
        if self._block is None:
            self._block = await self.lease.decompress_held(self.frame, self._batches())
        return None if self._block is None else memoryview(self._block)

    def done(self) -> None:
        """Drop what the batch's way through the hooks kept (its block, its records)."""
        self._block = None
        self._decoded = None

    async def block(self) -> memoryview:
        """The batch's records block: where it lies in the frame when uncompressed (its
        CRC checked), else decompressed (where and within the budget a decode would
        run). Raises ``CorruptBatch``."""
        if self._decoded is not None:
            return self._decoded.records_block()
        if not self.header.attributes & 0x07:
            if not self.crc_checked:
                verify_batch_crc(self.frame, self.batch.start, self.header, self.batch.start)
            return memoryview(self.frame)[self.batch.start + BATCH_HEADER_SIZE:self.batch.end]
        if self._block is None:
            self._block = await self.lease.decompress(self.frame, self._batches())
        return memoryview(self._block)
