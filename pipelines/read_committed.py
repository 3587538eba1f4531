"""Which fetched batches a ``read_committed`` consumer returns: Kafka's consumer rule, pure.

Contract: :func:`read_committed` takes the batches of one partition of one Fetch
response (sent with ``isolation_level`` 1) and that partition's
``aborted_transactions`` list, and says of every batch, in order, whether its
records are returned (:attr:`BatchFate.RECORDS`), belong to an aborted
transaction (:attr:`BatchFate.ABORTED`) or are a transaction marker
(:attr:`BatchFate.CONTROL`). Each response is judged on its own: the broker's
list holds every aborted transaction that overlaps the fetched offsets,
including one that began before the fetch offset.

The rule is the Java consumer's (``CompletedFetch.nextFetchedBatch``): the
aborted transactions are taken in ``first_offset`` order; before a batch with a
producer id is judged, every aborted transaction that began at or before the
batch's last offset puts its producer id into the aborted set; an ABORT marker of
that producer takes it out again (the transaction is over), and a transactional
data batch of a producer in the set is aborted. Nothing else is: records of a
committed transaction and non-transactional records are returned.
"""

from __future__ import annotations

import enum
import heapq
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

from kiproxy.protocol.records import DecodedBatch

__all__ = ["AbortedTransaction", "BatchFate", "ControlRecordType", "control_type",
           "read_committed"]


class ControlRecordType(enum.IntEnum):
    """The type in a control record's key (Kafka's ``ControlRecordType``)."""

    ABORT = 0
    COMMIT = 1


class BatchFate(enum.Enum):
    """What a read_committed consumer does with one stored batch."""

    RECORDS = "records"
    """Returned: non-transactional, or part of a transaction that was not aborted."""
    ABORTED = "aborted"
    """Dropped: data of an aborted transaction."""
    CONTROL = "control"
    """Dropped: a transaction marker (commit or abort), never shown to applications."""


@dataclass(frozen=True, slots=True, order=True)
class AbortedTransaction:
    """One entry of a Fetch response's ``aborted_transactions``."""

    first_offset: int
    """Offset of the transaction's first record in this partition."""
    producer_id: int
    """The transactional producer that aborted it."""


def control_type(batch: DecodedBatch) -> ControlRecordType | None:
    """The type of a control batch's marker (from its first record's key), None if unknown.

    The key is ``version int16, type int16``; a key too short to hold them, or a
    type Kafka does not define, gives None (the batch is still a control batch).
    """
    if not batch.records or batch.records[0].key is None or len(batch.records[0].key) < 4:
        return None
    _, kind = struct.unpack_from(">hh", batch.records[0].key)
    try:
        return ControlRecordType(kind)
    except ValueError:
        return None


def read_committed(batches: Iterable[DecodedBatch],
                   aborted_transactions: Iterable[AbortedTransaction]
                   ) -> Iterator[tuple[DecodedBatch, BatchFate]]:
    """Every batch of one fetched partition with its fate for a read_committed consumer."""
    pending = list(aborted_transactions)
    heapq.heapify(pending)
    aborted_producers: set[int] = set()
    for batch in batches:
        h = batch.header
        if h.producer_id >= 0:
            last_offset = h.base_offset + h.last_offset_delta
            while pending and pending[0].first_offset <= last_offset:
                aborted_producers.add(heapq.heappop(pending).producer_id)
            if h.is_control:
                if control_type(batch) == ControlRecordType.ABORT:
                    aborted_producers.discard(h.producer_id)
                yield batch, BatchFate.CONTROL
                continue
            if h.is_transactional and h.producer_id in aborted_producers:
                yield batch, BatchFate.ABORTED
                continue
        yield batch, (BatchFate.CONTROL if h.is_control else BatchFate.RECORDS)
