"""Dead-letter copies: the records a route refused, as the dead-letter sink writes them.

Contract: the produce path hands each refused topic-partition's records to the
process's dead-letter sink (a :class:`~kiproxy.proxy.observe.kafka_sink.KafkaSink`
named ``dead_letter``, settings ``dead_letter_sink``) as one :class:`DeadLetterCopy`;
the sink queues it or drops and counts it, and never changes or delays the answer the
producer of the refused records gets (see :mod:`kiproxy.proxy.observe.kafka_sink`
for its bounds and drop reasons). The sink never creates a dead-letter topic.

Each written record keeps the original key, value, headers (in order) and
timestamp - but for a header key that is not UTF-8 (brokers store what a client sent;
it is read as lone surrogates), written with the bytes that are not as ``\\xNN`` escapes, as
the sink's producer writes keys as text only - and gets these headers after the
original ones (UTF-8 text; a null value where the proxy does not know the fact):

=========================  ============================================================
``kiproxy.topic``          the topic the record was produced to
``kiproxy.partition``      its partition (decimal)
``kiproxy.route``          the route that refused it
``kiproxy.link``           the chain link that refused it (its class), or null
``kiproxy.error.code``     the Kafka error code the producer got (decimal), e.g. ``87``
``kiproxy.error.name``     its name, e.g. ``INVALID_RECORD``
``kiproxy.reason``         the record's own record error when it has one, else the batch's
``kiproxy.client.id``      the producer's client id, or null
``kiproxy.principal``      the producer's principal, or null when unknown
``kiproxy.time``           when the proxy refused it (ms since the epoch, decimal)
``kiproxy.observed``       ``true`` when the route only observed (the record was stored)
=========================  ============================================================
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from kiproxy.interceptors import Record
from kiproxy.protocol.records import header_key_text, records_size
from kiproxy.proxy.observe.kafka_sink import SinkRecord

__all__ = ["HEADERS", "DeadLetterCopy", "copy_headers"]

HEADERS = ("kiproxy.topic", "kiproxy.partition", "kiproxy.route", "kiproxy.link",
           "kiproxy.error.code", "kiproxy.error.name", "kiproxy.reason", "kiproxy.client.id",
           "kiproxy.principal", "kiproxy.time", "kiproxy.observed")
"""The headers the sink adds to every copy, in this order, after the record's own."""

@dataclass(frozen=True, slots=True, kw_only=True)
class DeadLetterCopy:
    """The records of one refused topic-partition, to be copied to a dead-letter topic."""

    topic: str
    """The dead-letter topic (the route's ``dead_letter.topic``)."""
    source_topic: str
    """The topic the records were produced to."""
    partition: int
    """Their partition."""
    route: str
    """The route that refused them."""
    link: str | None
    """The chain link whose verdict refused them, or None when not one link's."""
    error_code: int
    """The Kafka error code the producer got (or would have got, when observed)."""
    error_name: str
    """Its name, e.g. ``POLICY_VIOLATION``."""
    reason: str
    """The batch's error message."""
    client_id: str | None
    principal: str | None
    """The producer's principal, None when the proxy does not know it."""
    time_ms: int
    """When the proxy refused them, ms since the epoch."""
    observed: bool
    """The route only observed: the records were stored, this copy shows what would fail."""
    records: tuple[Record, ...]
    """The records as the producer sent them."""
    record_reasons: Mapping[int, str] = field(default_factory=dict)
    """Index in ``records`` -> that record's own record error, where the verdict gave one."""

    def count(self) -> int:
        """How many records."""
        return len(self.records)

    def size(self) -> int:
        """Bytes the records take encoded (what the queue bound counts), measured by the
        compiled codec without building the fields; a record that cannot be encoded counts
        its values (the sink refuses it when it writes)."""
        try:
            return records_size(tuple(self.records))
        except UnicodeEncodeError:
            return sum(len(r.value or b"") for r in self.records)

    def sink_records(self) -> Iterator[SinkRecord]:
        """The records as written: the original key, value and timestamp, the original
        headers followed by :data:`HEADERS`."""
        for index, record in enumerate(self.records):
            yield SinkRecord(record.key, record.value, copy_headers(self, index),
                             record.timestamp)


def _text(value: object) -> bytes | None:
    return None if value is None else str(value).encode("utf-8", "backslashreplace")


def copy_headers(copy: DeadLetterCopy, index: int) -> list[tuple[str, bytes | None]]:
    """Record ``index``'s original headers followed by the sink's :data:`HEADERS`."""
    record = copy.records[index]
    facts = (copy.source_topic, copy.partition, copy.route, copy.link, copy.error_code,
             copy.error_name, copy.record_reasons.get(index, copy.reason), copy.client_id,
             copy.principal, copy.time_ms, "true" if copy.observed else "false")
    return [(header_key_text(h.key), h.value) for h in record.headers] + \
        [(name, _text(value)) for name, value in zip(HEADERS, facts, strict=True)]
