"""The proxy's own Kafka producer for side copies (dead-letter copies, audit events).

Contract:

* :meth:`KafkaSink.offer` never blocks and never raises, and may be called from any
  thread (the produce path calls it on the event loop, the audit observer from its
  observer thread). It puts one :class:`SinkBatch` (the records of one topic) on a
  bounded queue - ``queue_records`` records and ``queue_bytes`` bytes of keys, values
  and headers, settings of the sink's section (:class:`KafkaSinkSettings`) - or drops it
  whole and counts it.
* A writer task on the proxy's event loop takes batches off the queue and writes each
  record through an aiokafka producer of its own (its own client id, TLS and SASL;
  bootstrap defaults to the upstream cluster). Connecting, asking whether a topic
  exists and handing a batch to the producer each take at most ``request_timeout_ms``;
  the producer holds at most one batch (512 KiB) per partition besides those on the
  wire, so memory stays bounded while the cluster is gone, hanging or slow. Nothing the sink
  does changes or delays a producer's answer.
* What cannot be written is dropped and counted, by record, in
  ``kiproxy_sink_dropped_total{sink,reason}``: ``queue_full`` (the queue's bound),
  ``topic_missing`` (the topic does not exist; a sink made with ``creates_topics``
  lets the cluster create it where it does so automatically), ``not_authorized``
  (the sink's principal may not write it), ``refused`` (the broker refused the
  records, e.g. too large), ``unavailable`` (no answer within ``request_timeout_ms``)
  and ``closed`` (still queued when the proxy stopped, past ``close_timeout_ms``).
  Each (topic, reason) writes at most one WARNING line per :data:`LOG_INTERVAL`
  seconds, naming the sink, the topic and how many records were dropped since the
  previous line. Drops held back are reported by a line of their own once the interval
  has passed (or at :meth:`KafkaSink.close`) even when no further drop comes: the
  lines add up to the counter. Written records are counted in
  ``kiproxy_sink_written_total``.
* The topic is asked about at most every ``topic_check_interval_ms`` (a passing fault
  for a second), so a missing topic costs no wait per batch.
* :meth:`KafkaSink.close` writes what is queued within ``close_timeout_ms``, counts the
  rest (queued, or handed over and not acknowledged) as ``closed`` and stops the producer.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import importlib.util
import logging
import threading
import time
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, Protocol

from kiproxy.protocol.log_limit import RateLimitedLog
from kiproxy.proxy.config.clients import KafkaSinkSettings
from kiproxy.proxy.observe.metrics import Metrics

if TYPE_CHECKING:
    import ssl

log = logging.getLogger("kiproxy.sink")

__all__ = ["DEFAULT_MAX_REQUEST_BYTES", "DROP_REASONS", "LOG_INTERVAL", "KafkaSink", "SinkBatch",
           "SinkRecord"]

DROP_REASONS = ("queue_full", "topic_missing", "not_authorized", "refused", "unavailable",
                "closed")
"""The ``reason`` label values of ``kiproxy_sink_dropped_total``."""

LOG_INTERVAL = 30.0
"""Seconds between two WARNING lines about the same sink, topic and drop reason."""

_RETRY_CONNECT_S = 1.0
_CREATE_WAIT_S = 2.0
_NOT_YET = (3, 5)  # UNKNOWN_TOPIC_OR_PARTITION, LEADER_NOT_AVAILABLE
DEFAULT_MAX_REQUEST_BYTES = 100 * 2**20
"""The largest record a sink sends when not told (the proxy passes its ``max_frame_size``)."""

_BATCH_BYTES = 512 * 2**10
"""aiokafka's batch per partition (its default, 16 KiB, holds one large refused record and
makes every such record wait for the previous one's acknowledgement); under the brokers'
default ``message.max.bytes`` (1 MiB)."""


class SinkRecord(NamedTuple):
    """One record as the sink writes it."""

    key: bytes | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]
    timestamp_ms: int | None


class SinkBatch(Protocol):
    """Records for one topic, offered to a sink together (kept or dropped whole)."""

    @property
    def topic(self) -> str:
        """The topic the records go to."""

    def count(self) -> int:
        """How many records."""

    def size(self) -> int:
        """Bytes of keys, values and headers (what ``queue_bytes`` counts)."""

    def sink_records(self) -> Iterable[SinkRecord]:
        """The records, as written."""


def _drop_reason(exc: BaseException) -> str:
    from aiokafka import errors as kafka_errors

    if isinstance(exc, kafka_errors.TopicAuthorizationFailedError
                  | kafka_errors.ClusterAuthorizationFailedError):
        return "not_authorized"
    if isinstance(exc, kafka_errors.UnknownTopicOrPartitionError):
        return "topic_missing"
    if isinstance(exc, kafka_errors.ProducerClosed | asyncio.CancelledError):
        return "closed"
    if isinstance(exc, TimeoutError | kafka_errors.KafkaTimeoutError
                  | kafka_errors.KafkaConnectionError | kafka_errors.NoBrokersAvailable) \
            or getattr(exc, "retriable", False):
        return "unavailable"
    return "refused"


def _quiet_library_log() -> None:
    # The sink reports aiokafka's failures itself, rate-limited, with aiokafka's text;
    # aiokafka's own lines (an ERROR per failed connection attempt) only at DEBUG.
    library = logging.getLogger("aiokafka")
    if library.level == logging.NOTSET and logging.getLogger().level > logging.DEBUG:
        library.setLevel(logging.CRITICAL)


def _why(exc: BaseException) -> str:
    return str(exc) or type(exc).__name__


class KafkaSink:
    """Writes :class:`SinkBatch` values to their topics; see the module docstring.

    ``name`` is the sink's ``sink`` label (``dead_letter``, ``audit``) and its settings
    section is ``<name>_sink``. ``bootstrap`` and ``tls`` are the resolved connection:
    ``settings.connection(config.upstream, config.upstream_tls)``, the TLS part made a
    context by ``kiproxy.proxy.net.tls.upstream_context``. With ``creates_topics`` the
    topic check lets the cluster create a missing topic (where it does so
    automatically). Raises ``ImportError`` without aiokafka and ``ValueError`` for an
    unreadable ``sasl.password_file``.
    """

    def __init__(self, name: str, settings: KafkaSinkSettings, *, bootstrap: Sequence[str],
                 tls: ssl.SSLContext | None, metrics: Metrics,
                 creates_topics: bool = False,
                 max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES) -> None:
        if importlib.util.find_spec("aiokafka") is None:
            raise ImportError(f"{name}_sink needs aiokafka: "
                              "pip install '.[kafka-audit]' (from a kiproxy checkout)")
        self.name = name
        self.settings = settings
        self.bootstrap = tuple(bootstrap)
        self.creates_topics = creates_topics
        self.max_request_bytes = max_request_bytes
        """The largest record the sink hands its producer (aiokafka's ``max_request_size``,
        1 MiB by default, would drop a larger refused record before the broker is asked;
        the broker's own limit then decides)."""
        self._tls = tls
        self._sasl_password = settings.sasl.secret() if settings.sasl is not None else None
        self._written = metrics.sink_written
        self._dropped = metrics.sink_dropped
        self._queued_records_gauge = metrics.sink_queued_records.labels(name)
        self._queued_bytes_gauge = metrics.sink_queued_bytes.labels(name)
        self._lock = threading.Lock()
        """Guards the queue and its counts, ``_closing``, ``_closed``, ``_wake_pending``,
        ``_held``, ``_reporting``."""
        self._queue: collections.deque[tuple[SinkBatch, int]] = collections.deque()
        self._queued_records = 0
        self._queued_bytes = 0
        self._closing = False
        self._closed = False
        """close() has reported every held-back drop: a later drop is written at once."""
        self._wake = asyncio.Event()
        self._wake_pending = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loop_thread: int | None = None
        self._producer: Any = None
        self._writer: asyncio.Task[None] | None = None
        self._in_flight: dict[asyncio.Future[Any], str] = {}
        """Records handed to the producer and not yet acknowledged -> their topic."""
        self._topics: dict[str, tuple[float, str | None]] = {}
        """Topic -> (monotonic time until which the answer holds, drop reason or None)."""
        self._held: dict[tuple[str, str], tuple[int, str]] = {}
        """(topic, reason) -> records dropped since the last line about them, and why the
        last of them was."""
        self._reporting: dict[tuple[str, str], asyncio.TimerHandle | None] = {}
        """(topic, reason) -> the timer that reports its held-back drops (None: being set)."""
        self._log = RateLimitedLog(log, LOG_INTERVAL)
        _quiet_library_log()

    @property
    def queued(self) -> tuple[int, int]:
        """Records and bytes waiting now."""
        with self._lock:
            return self._queued_records, self._queued_bytes

    # ------------------------------------------------------------------ the offering side

    def offer(self, batch: SinkBatch) -> None:
        """Queue ``batch`` for writing, or drop and count it; never blocks, never raises."""
        try:
            records = batch.count()
            if not records:
                return
            size = batch.size()
            s = self.settings
            with self._lock:
                if self._closing:
                    refusal: tuple[str, str] | None = ("closed", "the proxy is stopping")
                elif self._queued_records + records > s.queue_records \
                        or self._queued_bytes + size > s.queue_bytes:
                    refusal = ("queue_full", f"{self._queued_records} records "
                               f"({self._queued_bytes} bytes) are already waiting; raise "
                               f"{self.name}_sink.queue_records/queue_bytes or check that "
                               f"{','.join(self.bootstrap)} keeps up")
                else:
                    refusal = None
                    self._queue.append((batch, size))
                    self._queued_records += records
                    self._queued_bytes += size
                    self._set_gauges()
                    wake = not self._wake_pending
                    self._wake_pending = True
            if refusal is not None:
                self._drop(batch.topic, refusal[0], records, refusal[1])
                return
            if wake:
                self._signal()
        except Exception:  # the producer's answer must never depend on the copy
            log.exception("%s sink: dropping records that could not be queued", self.name)

    def _signal(self) -> None:
        loop = self._loop
        if loop is None:
            return  # start() looks at the queue
        if threading.get_ident() == self._loop_thread:
            self._wake.set()
            return
        with contextlib.suppress(RuntimeError):  # a closed loop: close() counted the rest
            loop.call_soon_threadsafe(self._wake.set)

    # ------------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Start the writer task (it connects, and reconnects, on its own)."""
        if self._writer is not None:
            return
        self._loop = asyncio.get_running_loop()
        self._loop_thread = threading.get_ident()
        self._writer = asyncio.create_task(self._write_loop(), name=f"{self.name}-sink-writer")
        with self._lock:  # drops held back before the loop was known
            waiting = [key for key in self._held if key not in self._reporting]
            self._reporting.update(dict.fromkeys(waiting))
        for key in waiting:
            self._report_later(key)

    async def close(self) -> None:
        """Write what is queued within ``close_timeout_ms``, count the rest as ``closed``,
        and stop the producer."""
        with self._lock:
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
        while True:
            with self._lock:
                if not self._queue:
                    break
                batch, _ = self._take()
            self._drop(batch.topic, "closed", batch.count(), "the proxy stopped first")
        if self._in_flight:
            await asyncio.wait(self._in_flight, timeout=max(deadline - time.monotonic(), 0.1))
        unanswered = collections.Counter(self._in_flight.values())  # handed over, no answer
        self._in_flight.clear()  # their callbacks, when they come, count nothing more
        for topic, records in unanswered.items():
            self._drop(topic, "closed", records, "not acknowledged before the proxy stopped")
        producer, self._producer = self._producer, None
        if producer is not None:
            await self._stop(producer, max(deadline - time.monotonic(), 0.1))
        with self._lock:
            self._closed = True
        self._report_held(None)  # the last word on every drop, whatever the interval

    async def _stop(self, producer: Any, timeout: float) -> None:
        try:
            await asyncio.wait_for(producer.stop(), timeout)
        except Exception as exc:
            self._warn(("stop",), f"stopping the producer failed: {_why(exc)}")

    # ------------------------------------------------------------------ the writer

    def _take(self) -> tuple[SinkBatch, int]:
        """The oldest queued batch, off the queue (call with ``_lock`` held)."""
        batch, size = self._queue.popleft()
        self._queued_records -= batch.count()
        self._queued_bytes -= size
        self._set_gauges()
        return batch, size

    def _set_gauges(self) -> None:
        """The queue gauges from the counts (call with ``_lock`` held)."""
        self._queued_records_gauge.set(self._queued_records)
        self._queued_bytes_gauge.set(self._queued_bytes)

    async def _write_loop(self) -> None:
        await self._connected()  # early: the first records need not wait for a connection
        while True:
            with self._lock:
                idle = not self._queue
                if idle:
                    if self._closing:
                        return
                    self._wake_pending = False
                    self._wake.clear()
            if idle:
                await self._wake.wait()
                continue
            producer = await self._connected()
            if producer is None:
                if self._closing:
                    return
                continue
            with self._lock:
                batch, _ = self._take()
            await self._write(producer, batch)

    async def _connected(self) -> Any:
        """The started producer; None (after a pause) when the cluster cannot be reached
        within ``request_timeout_ms``."""
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
            max_batch_size=_BATCH_BYTES, max_request_size=self.max_request_bytes,
            security_protocol=protocol, ssl_context=self._tls, **sasl)
        try:
            await asyncio.wait_for(producer.start(), s.request_timeout_ms / 1000)
        except Exception as exc:
            self._warn(("connect",), f"cannot connect to {','.join(self.bootstrap)} "
                       f"(records wait in the queue meanwhile): {_why(exc)}")
            await self._stop(producer, s.request_timeout_ms / 1000)
            if not self._closing:
                await asyncio.sleep(_RETRY_CONNECT_S)
            return None
        self._producer = producer
        return producer

    async def _topic_reason(self, producer: Any, topic: str) -> str | None:
        """Why ``topic`` cannot be written now (a drop reason), or None; asks the cluster
        at most every ``topic_check_interval_ms``."""
        checked = self._topics.get(topic)
        now = time.monotonic()
        if checked is not None and now < checked[0]:
            return checked[1]
        from aiokafka import errors as kafka_errors
        from aiokafka.protocol.metadata import MetadataRequest

        reason: str | None
        # A topic the cluster creates on this request is not there at once (unknown topic
        # or no leader yet): ask again for a moment before calling it missing.
        patience = time.monotonic() + (_CREATE_WAIT_S if self.creates_topics else 0.0)
        try:
            while True:
                node = producer.client.get_random_node()
                answer = await producer.client.send(
                    node, MetadataRequest([topic], self.creates_topics))
                code = next((t[0] for t in answer.topics if t[1] == topic), 3)
                if code not in _NOT_YET or time.monotonic() >= patience:
                    break
                await asyncio.sleep(0.1)
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

    async def _write(self, producer: Any, batch: SinkBatch) -> None:
        """Hand ``batch``'s records to the producer within ``request_timeout_ms``; what is
        not handed over by then is dropped as ``unavailable``."""
        topic, total = batch.topic, batch.count()
        handed = 0  # records handed to the producer (or dropped) so far
        try:
            async with asyncio.timeout(self.settings.request_timeout_ms / 1000):
                reason = await self._topic_reason(producer, topic)
                if reason is not None:
                    handed = total
                    self._drop(topic, reason, total, self._remedy(topic, reason))
                    return
                for record in batch.sink_records():
                    try:
                        future = await producer.send(
                            topic, record.value, key=record.key, headers=record.headers,
                            timestamp_ms=record.timestamp_ms)
                    except (TimeoutError, asyncio.CancelledError):
                        raise
                    except Exception as exc:  # too large, or the producer's batch stayed full
                        self._drop(topic, _drop_reason(exc), 1, _why(exc))
                    else:
                        self._in_flight[future] = topic
                        future.add_done_callback(self._delivered)
                    handed += 1
        except TimeoutError:
            self._remember(topic, "unavailable")
            self._drop(topic, "unavailable", total - handed,
                       f"{','.join(self.bootstrap)} did not take them within "
                       f"request_timeout_ms ({self.settings.request_timeout_ms})")
        except asyncio.CancelledError:  # close() stopped waiting: count what is left
            self._drop(topic, "closed", total - handed, "the proxy stopped first")
            raise
        except Exception as exc:
            self._drop(topic, _drop_reason(exc), total - handed, _why(exc))

    def _remedy(self, topic: str, reason: str) -> str:
        if reason == "topic_missing":
            return f"topic {topic} does not exist; create it"
        if reason == "not_authorized":
            return (f"the sink's user may not write topic {topic}; grant it write access "
                    f"({self.name}_sink.sasl)")
        return (f"{','.join(self.bootstrap)} did not say whether topic {topic} can be written "
                f"({reason}); it is asked again within a second")

    def _delivered(self, future: asyncio.Future[Any]) -> None:
        topic = self._in_flight.pop(future, None)
        if topic is None:  # counted by close() already
            return
        exc = asyncio.CancelledError() if future.cancelled() else future.exception()
        if exc is None:
            self._written.labels(self.name, topic).inc()
            return
        reason = _drop_reason(exc)
        if reason in ("topic_missing", "not_authorized"):
            self._remember(topic, reason)
        self._drop(topic, reason, 1, _why(exc))

    # ------------------------------------------------------------------ counting drops

    def _drop(self, topic: str, reason: str, records: int, why: str) -> None:
        if records <= 0:
            return
        self._dropped.labels(self.name, reason).inc(records)
        key = (topic, reason)
        with self._lock:
            held = self._held.pop(key, (0, why))[0] + records
            # Once closed nothing is left to report a held line: it is written now.
            write = self._log.allow(key) is not None or self._closed
            schedule = not write and key not in self._reporting
            if not write:
                self._held[key] = (held, why)
            if schedule:
                self._reporting[key] = None
        if write:
            self._write_drops(key, held, why)
        elif schedule:
            self._report_later(key)

    def _write_drops(self, key: tuple[str, str], records: int, why: str) -> None:
        topic, reason = key
        log.warning("%s sink: dropped %d record(s) for topic %s since the last such line "
                    "(%s): %s", self.name, records, topic, reason, why)

    def _report_later(self, key: tuple[str, str]) -> None:
        """Report ``key``'s held-back drops once its interval has passed, should no drop
        come to write them sooner (called from any thread)."""
        loop = self._loop
        if loop is None:  # not started: start() arms it
            with self._lock:
                self._reporting.pop(key, None)
            return

        def arm() -> None:
            with self._lock:
                if key in self._reporting and not self._closed:
                    self._reporting[key] = loop.call_later(
                        self._log.interval, self._report_held, key)
                    return
                self._reporting.pop(key, None)

        if threading.get_ident() == self._loop_thread:
            arm()
            return
        try:
            loop.call_soon_threadsafe(arm)
        except RuntimeError:  # a closed loop: close() reported them
            with self._lock:
                self._reporting.pop(key, None)

    def _report_held(self, only: tuple[str, str] | None) -> None:
        """Write the line for the drops held back for ``only`` if its interval has passed
        (else look again later), or, given ``None`` (at close), for every key at once."""
        with self._lock:
            if only is None:
                for timer in self._reporting.values():
                    if timer is not None:
                        timer.cancel()
                self._reporting.clear()
                due = list(self._held.items())
                self._held.clear()
            else:
                self._reporting.pop(only, None)
                due, rearm = [], False
                if only in self._held:
                    if self._log.allow(only) is not None:
                        due = [(only, self._held.pop(only))]
                    else:  # a drop wrote a line meanwhile and more were held since
                        self._reporting[only] = None
                        rearm = True
        for key, (records, why) in due:
            self._write_drops(key, records, why)
        if only is not None and rearm:
            self._report_later(only)

    def _warn(self, key: tuple[str, ...], message: str) -> None:
        with self._lock:
            write = self._log.allow(key) is not None
        if write:
            log.warning("%s sink: %s", self.name, message)
