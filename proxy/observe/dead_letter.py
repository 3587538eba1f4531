"""The dead-letter sink: copies of refused records, written to a topic by the proxy's own producer.

Contract: the produce path hands each refused topic-partition's records to
:meth:`DeadLetterSink.offer` as one :class:`DeadLetterCopy`. ``offer`` never
blocks and never raises: it puts the copy on a bounded queue (``queue_records``
records and ``queue_bytes`` bytes, settings ``dead_letter_sink``) or drops it.
A writer task on the proxy's event loop takes copies off the queue and writes
each record through an aiokafka producer of its own (its own client id,
credentials, TLS and SASL; bootstrap defaults to the upstream cluster). Nothing
it does changes or delays the answer the producer of the refused records gets.

Each written record keeps the original key, value, headers (in order) and
timestamp, and gets these headers after the original ones (UTF-8 text; a null
value where the proxy does not know the fact):

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

Copies that cannot be written are dropped and counted, by record, in
``kiproxy_dead_letter_dropped_total{reason}``: ``queue_full`` (the queue's bound),
``topic_missing`` (the topic does not exist: the sink never creates one; it asks
the cluster without creating it, at most every ``topic_check_interval_ms``),
``not_authorized`` (the sink's principal may not write it), ``refused`` (the
broker refused the records, e.g. too large), ``unavailable`` (no answer within
``request_timeout_ms``) and ``closed`` (still queued when the proxy stopped, past
``close_timeout_ms``). Written records are counted in
``kiproxy_dead_letter_written_total{topic}``. A topic that failed is not tried
again until the next check, so a missing topic costs no wait per copy.
"""

from __future__ import annotations

import asyncio
import collections
import importlib.util
import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kiproxy.interceptors import Record
from kiproxy.proxy.config.clients import DeadLetterSinkSettings
from kiproxy.proxy.observe.metrics import Metrics

if TYPE_CHECKING:
    import ssl

log = logging.getLogger("kiproxy.dead_letter")

__all__ = ["DROP_REASONS", "HEADERS", "DeadLetterCopy", "DeadLetterSink"]

HEADERS = ("kiproxy.topic", "kiproxy.partition", "kiproxy.route", "kiproxy.link",
           "kiproxy.error.code", "kiproxy.error.name", "kiproxy.reason", "kiproxy.client.id",
           "kiproxy.principal", "kiproxy.time", "kiproxy.observed")
"""The headers the sink adds to every copy, in this order, after the record's own."""

DROP_REASONS = ("queue_full", "topic_missing", "not_authorized", "refused", "unavailable",
                "closed")
"""The ``reason`` label values of ``kiproxy_dead_letter_dropped_total``."""

_LOG_EVERY_S = 60.0


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

    def size(self) -> int:
        """Bytes of keys, values and header keys and values (what the queue bound counts)."""
        total = 0
        for r in self.records:
            total += len(r.key or b"") + len(r.value or b"")
            for h in r.headers:
                total += len(h.key) + len(h.value or b"")
        return total


def _text(value: object) -> bytes | None:
    return None if value is None else str(value).encode()


def copy_headers(copy: DeadLetterCopy, index: int) -> list[tuple[str, bytes | None]]:
    """Record ``index``'s original headers followed by the sink's :data:`HEADERS`."""
    record = copy.records[index]
    facts = (copy.source_topic, copy.partition, copy.route, copy.link, copy.error_code,
             copy.error_name, copy.record_reasons.get(index, copy.reason), copy.client_id,
             copy.principal, copy.time_ms, "true" if copy.observed else "false")
    return [(h.key, h.value) for h in record.headers] + \
        [(name, _text(value)) for name, value in zip(HEADERS, facts, strict=True)]


def _drop_reason(exc: BaseException) -> str:
    from aiokafka import errors as kafka_errors

    if isinstance(exc, kafka_errors.TopicAuthorizationFailedError
                  | kafka_errors.ClusterAuthorizationFailedError):
        return "not_authorized"
    if isinstance(exc, kafka_errors.UnknownTopicOrPartitionError):
        return "topic_missing"
    if isinstance(exc, kafka_errors.ProducerClosed | asyncio.CancelledError):
        return "closed"
    if isinstance(exc, kafka_errors.KafkaTimeoutError | kafka_errors.KafkaConnectionError
                  | kafka_errors.NoBrokersAvailable) \
            or getattr(exc, "retriable", False):
        return "unavailable"
    return "refused"


class DeadLetterSink:
    """Writes :class:`DeadLetterCopy` values to their topics; see the module docstring.

    ``bootstrap`` and ``tls`` are the resolved connection: give
    ``settings.connection(config.upstream, config.upstream_tls)``, the TLS part made a
    context by ``kiproxy.proxy.net.tls.upstream_context(tls, "dead_letter_sink.tls")``.
    ``metrics`` holds the counters. Raises ``ImportError`` without aiokafka and
    ``ValueError`` for an unreadable ``sasl.password_file``.
    """

    def __init__(self, settings: DeadLetterSinkSettings, *, bootstrap: Sequence[str],
                 tls: ssl.SSLContext | None, metrics: Metrics) -> None:
        if importlib.util.find_spec("aiokafka") is None:
            raise ImportError("a route's dead_letter needs aiokafka: "
                              "pip install 'kafka-interceptor-proxy[kafka-audit]'")
        self.settings = settings
        self.bootstrap = tuple(bootstrap)
        self._tls = tls
        self._sasl_password = settings.sasl.secret() if settings.sasl is not None else None
        self._written = metrics.dead_letter_written
        self._dropped = metrics.dead_letter_dropped
        self._queued_gauge = metrics.dead_letter_queued
        self._queue: collections.deque[tuple[DeadLetterCopy, int]] = collections.deque()
        self._queued_records = 0
        self._queued_bytes = 0
        self._wake = asyncio.Event()
        self._closing = False
        self._producer: Any = None
        self._writer: asyncio.Task[None] | None = None
        self._in_flight: set[asyncio.Future[Any]] = set()
        self._topics: dict[str, tuple[float, str | None]] = {}
        """Topic -> (monotonic time until which the answer holds, drop reason or None)."""
        self._last_log: dict[str, float] = {}

    # ------------------------------------------------------------------ the produce path side

    def offer(self, copy: DeadLetterCopy) -> None:
        """Queue ``copy`` for writing, or drop and count it; never blocks, never raises."""
        try:
            records = len(copy.records)
            if not records:
                return
            if self._closing:
                self._drop(copy.topic, "closed", records, "the proxy is stopping")
                return
            size = copy.size()
            if self._queued_records + records > self.settings.queue_records \
                    or self._queued_bytes + size > self.settings.queue_bytes:
                self._drop(copy.topic, "queue_full", records,
                           f"{self._queued_records} records ({self._queued_bytes} bytes) are "
                           "already waiting; raise dead_letter_sink.queue_records/queue_bytes "
                           "or check that the cluster keeps up")
                return
            self._queue.append((copy, size))
            self._queued_records += records
            self._queued_bytes += size
            self._queued_gauge.set(self._queued_records)
            self._wake.set()
        except Exception:  # the producer's answer must never depend on the copy
            log.exception("dead-letter sink: dropping a copy that could not be queued")

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the writer task (it connects, and reconnects, on its own)."""
        if self._writer is None:
            self._writer = asyncio.create_task(self._write_loop(), name="dead-letter-writer")

    async def close(self) -> None:
        """Write what is queued within ``close_timeout_ms``, count the rest as ``closed``,
        and stop the producer."""
        self._closing = True
        self._wake.set()
        bound = self.settings.close_timeout_ms / 1000
        deadline = time.monotonic() + bound
        if self._writer is not None:
            try:
                await asyncio.wait_for(asyncio.shield(self._writer), bound)
            except TimeoutError:
                self._writer.cancel()
                await asyncio.gather(self._writer, return_exceptions=True)
        while self._queue:
            copy, size = self._queue.popleft()
            self._dequeued(copy, size)
            self._drop(copy.topic, "closed", len(copy.records), "the proxy stopped first")
        if self._in_flight:
            await asyncio.wait(self._in_flight, timeout=max(deadline - time.monotonic(), 0.1))
        producer, self._producer = self._producer, None
        if producer is not None:
            try:
                await asyncio.wait_for(producer.stop(), max(deadline - time.monotonic(), 1.0))
            except Exception as exc:
                log.warning("dead-letter sink: stopping the producer failed: %s", exc)

    # ------------------------------------------------------------------ the writer

    def _dequeued(self, copy: DeadLetterCopy, size: int) -> None:
        self._queued_records -= len(copy.records)
        self._queued_bytes -= size
        self._queued_gauge.set(self._queued_records)

    async def _write_loop(self) -> None:
        while True:
            if not self._queue:
                if self._closing:
                    return
                self._wake.clear()
                await self._wake.wait()
                continue
            producer = await self._connected()
            if producer is None:
                if self._closing:
                    return
                continue
            copy, size = self._queue.popleft()
            self._dequeued(copy, size)
            try:
                await self._write(producer, copy)
            except Exception as exc:
                self._drop(copy.topic, _drop_reason(exc), len(copy.records), str(exc))

    async def _connected(self) -> Any:
        """The started producer; None (after a pause) when the cluster cannot be reached."""
        if self._producer is not None:
            return self._producer
        from aiokafka import AIOKafkaProducer

        s = self.settings
        protocol = ("SASL_" if s.sasl else "") + ("SSL" if self._tls else "PLAINTEXT")
        sasl: dict[str, Any] = {} if s.sasl is None else {
            "sasl_mechanism": s.sasl.mechanism, "sasl_plain_username": s.sasl.username,
            "sasl_plain_password": self._sasl_password}
        producer = AIOKafkaProducer(
            bootstrap_servers=list(self.bootstrap), client_id=s.client_id, acks=s.acks,
            linger_ms=s.linger_ms, request_timeout_ms=s.request_timeout_ms,
            security_protocol=protocol, ssl_context=self._tls, **sasl)
        try:
            await producer.start()
        except Exception as exc:
            self._log("connect", f"cannot connect to {','.join(self.bootstrap)} "
                      f"(copies wait in the queue meanwhile): {exc}")
            await producer.stop()
            if not self._closing:
                await asyncio.sleep(1.0)
            return None
        self._producer = producer
        return producer

    async def _topic_reason(self, producer: Any, topic: str) -> str | None:
        """Why ``topic`` cannot be written now (a drop reason), or None; asks the cluster
        without creating the topic, at most every ``topic_check_interval_ms``."""
        checked = self._topics.get(topic)
        now = time.monotonic()
        if checked is not None and now < checked[0]:
            return checked[1]
        from aiokafka import errors as kafka_errors
        from aiokafka.protocol.metadata import MetadataRequest

        reason: str | None
        try:
            node = producer.client.get_random_node()
            answer = await producer.client.send(node, MetadataRequest([topic], False))
            code = next((t[0] for t in answer.topics if t[1] == topic), 3)
            reason = None if code == 0 else _drop_reason(kafka_errors.for_code(code)())
        except Exception as exc:
            reason = _drop_reason(exc)
        self._remember(topic, reason)
        return reason

    def _remember(self, topic: str, reason: str | None) -> None:
        # A topic found missing or forbidden is not asked about again for a whole interval;
        # a passing fault (no leader yet, a timeout) only for a second.
        hold = self.settings.topic_check_interval_ms / 1000 \
            if reason in (None, "topic_missing", "not_authorized") else 1.0
        self._topics[topic] = (time.monotonic() + hold, reason)

    async def _write(self, producer: Any, copy: DeadLetterCopy) -> None:
        handed = 0  # records handed to the producer (or dropped) so far
        try:
            reason = await self._topic_reason(producer, copy.topic)
            if reason is not None:
                handed = len(copy.records)
                self._drop(copy.topic, reason, handed,
                           f"topic {copy.topic} cannot be written ({reason}); create it, or "
                           f"grant the sink's user ({self.settings.client_id}) write access")
                return
            for index, record in enumerate(copy.records):
                try:
                    future = await producer.send(
                        copy.topic, record.value, key=record.key,
                        headers=copy_headers(copy, index), timestamp_ms=record.timestamp)
                except Exception as exc:  # too large for the producer, or its buffer stayed full
                    self._drop(copy.topic, _drop_reason(exc), 1, str(exc) or type(exc).__name__)
                else:
                    self._in_flight.add(future)
                    future.add_done_callback(lambda f, t=copy.topic: self._delivered(t, f))
                handed = index + 1
        except asyncio.CancelledError:  # close() stopped waiting: count what is left
            self._drop(copy.topic, "closed", len(copy.records) - handed,
                       "the proxy stopped first")
            raise

    def _delivered(self, topic: str, future: asyncio.Future[Any]) -> None:
        self._in_flight.discard(future)
        exc = asyncio.CancelledError() if future.cancelled() else future.exception()
        if exc is None:
            self._written.labels(topic).inc()
            return
        reason = _drop_reason(exc)
        if reason in ("topic_missing", "not_authorized"):
            self._remember(topic, reason)
        self._drop(topic, reason, 1, str(exc) or type(exc).__name__)

    def _drop(self, topic: str, reason: str, records: int, why: str) -> None:
        self._dropped.labels(reason).inc(records)
        self._log(reason, f"dropped {records} record(s) for dead-letter topic {topic} "
                  f"({reason}): {why}")

    def _log(self, key: str, message: str) -> None:
        now = time.monotonic()
        if now - self._last_log.get(key, -_LOG_EVERY_S) >= _LOG_EVERY_S:
            self._last_log[key] = now
            log.warning("dead-letter sink: %s", message)
