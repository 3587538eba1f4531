"""The audit log: one JSON line per produced topic-partition, for reports and audits.

Switched on with ``--audit-log PATH`` (config ``audit.path``)::

    audit:
      path: /var/log/kiproxy/audit.jsonl
      max_bytes: 104857600       # rotate when the file reaches this size (0: never)
      rotate_interval_s: 3600    # ... or when it is this old (0: never)
      backups: 24                # rotated files kept (0: keep all)
      requests: false            # also one event per request of other APIs
      topic: null                # also send every event to this topic (see audit_sink)

Produce event (``"event": "produce"``), one per topic-partition of each
produce request::

    {"event": "produce", "ts": 1763848800123, "client_id": "orders-svc",
     "client_address": "10.0.0.7:53412", "principal": null, "api_version": 11,
     "correlation_id": 42, "topic": "orders", "partition": 3, "batches": 1,
     "records": 500, "bytes": 20480, "outcome": "transformed", "route": "payments",
     "error_code": 0, "error_message": null, "base_offset": 1200, "latency_ms": 2.41}

``route`` is the name of the route whose chain handled the partition
(``default`` for the ``interceptor:`` shorthand), or null when no route matched
and the partition passed through untouched.

Request event (``"event": "request"``, only with ``requests: true``), one per
request of any other API: ``ts``, ``client_id``, ``client_address``,
``principal``, ``api_key``, ``api_name``, ``api_version``, ``correlation_id``,
``request_bytes``, ``response_bytes``, ``latency_ms``.

Rotation renames the current file to ``PATH.<UTC time>.<n>`` and opens a new
one, so ``PATH*`` globs every event. Lines are written by the observer thread,
never the event loop; the file is flushed at least every ``flush_interval_ms``
(default 200) and on shutdown.

With ``topic`` set, :class:`AuditTopic` also sends every event, as JSON keyed by
the topic's (or API's) name, through the process's audit sink
(:mod:`kiproxy.proxy.observe.kafka_sink`; its connection, queue and time bounds are
``audit_sink``'s). The topic is created by the cluster on first use where the cluster
creates topics automatically; what the sink cannot write is dropped and counted in
``kiproxy_sink_dropped_total{sink="audit"}``.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from kiproxy.interceptors.observer import Observer, PartitionSummary, ResponseInfo
from kiproxy.proxy.observe.kafka_sink import KafkaSink, SinkRecord

log = logging.getLogger("kiproxy.audit")

__all__ = ["AuditBatch", "AuditLog", "AuditTopic", "produce_events", "request_event"]


def produce_events(info: ResponseInfo) -> list[dict[str, Any]]:
    """The audit events of a produce response, one per topic-partition."""
    req = info.request
    latency = round(info.latency_ms, 3)
    return [
        _verdict_fields(p, {
            "event": "produce",
            "ts": req.received_at_ms,
            "client_id": req.client_id,
            "client_address": req.client_address,
            "principal": req.principal,
            "api_version": req.api_version,
            "correlation_id": req.correlation_id,
            "topic": p.topic,
            "partition": p.partition,
            "batches": p.batches,
            "records": p.records,
            "bytes": p.bytes,
            "outcome": p.outcome,
            "route": p.route,
            "error_code": p.error_code,
            "error_message": p.error_message,
            "base_offset": p.base_offset,
            "latency_ms": latency,
        })
        for p in info.produce
    ]


def _verdict_fields(p: PartitionSummary, event: dict[str, Any]) -> dict[str, Any]:
    """``observe_mode`` for a partition a route handled; ``link`` when a link refused the
    partition; ``observed_outcome`` (with the would-be error and link) beside the real
    ``outcome`` when a route or link in observe mode judged it."""
    if p.route is not None:
        event["observe_mode"] = p.observe_mode
    if p.link is not None:
        event["link"] = p.link
    if p.observed_outcome is not None:
        event["observed_outcome"] = p.observed_outcome
        event["observed_error_code"] = p.observed_error_code
        event["observed_error_message"] = p.observed_error_message
        event["observed_link"] = p.observed_link
    return event


def request_event(info: ResponseInfo) -> dict[str, Any]:
    """The audit event of a request of any API other than Produce."""
    req = info.request
    return {
        "event": "request",
        "ts": req.received_at_ms,
        "client_id": req.client_id,
        "client_address": req.client_address,
        "principal": req.principal,
        "api_key": req.api_key,
        "api_name": req.api_name,
        "api_version": req.api_version,
        "correlation_id": req.correlation_id,
        "request_bytes": req.size,
        "response_bytes": info.size,
        "latency_ms": round(info.latency_ms, 3),
    }


def _events(info: ResponseInfo, requests: bool) -> list[dict[str, Any]]:
    if info.request.api_key == 0:
        return produce_events(info)
    return [request_event(info)] if requests else []


class AuditLog(Observer):
    """Writes audit events as JSON Lines to a size- and time-rotated file."""

    def __init__(self) -> None:
        self.path = Path("audit.jsonl")
        self.max_bytes = 100 * 2**20
        self.rotate_interval_s = 3600.0
        self.backups = 24
        self.requests = False
        self.flush_interval_s = 0.2
        self.events_written = 0
        self.rotations = 0
        self._file: IO[str] | None = None
        self._opened_at = 0.0
        self._size = 0
        self._seq = 0
        self._dirty = False
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._flusher: threading.Thread | None = None

    def configure(self, config: Mapping[str, Any]) -> None:
        """Keys: ``path`` (required), ``max_bytes``, ``rotate_interval_s``, ``backups``,
        ``requests``, ``flush_interval_ms``."""
        if not config.get("path"):
            raise ValueError("audit.path is required")
        self.path = Path(str(config["path"]))
        self.max_bytes = int(config.get("max_bytes", self.max_bytes))
        self.rotate_interval_s = float(config.get("rotate_interval_s", self.rotate_interval_s))
        self.backups = int(config.get("backups", self.backups))
        self.requests = bool(config.get("requests", False))
        self.flush_interval_s = int(config.get("flush_interval_ms", 200)) / 1000
        if self.max_bytes < 0 or self.rotate_interval_s < 0 or self.backups < 0:
            raise ValueError("audit.max_bytes, rotate_interval_s and backups must be >= 0")
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._open()
        self._flusher = threading.Thread(target=self._flush_loop, name="audit-flush",
                                         daemon=True)
        self._flusher.start()

    def on_response(self, info: ResponseInfo) -> None:
        """Write the response's events."""
        self.record(_events(info, self.requests))

    def record(self, events: list[dict[str, Any]]) -> None:
        """Append ``events`` (each with an ``event`` field), as one write."""
        if not events:
            return
        text = "".join(json.dumps(e, separators=(",", ":")) + "\n" for e in events)
        with self._lock:
            if self._due_for_rotation(len(text)):
                self._rotate()
            assert self._file is not None
            self._file.write(text)
            self._size += len(text) if text.isascii() else len(text.encode())
            self._dirty = True
            self.events_written += len(events)

    def close(self) -> None:
        """Flush and close the file."""
        self._stop.set()
        if self._flusher is not None:
            self._flusher.join(5)
        with self._lock:
            if self._file is not None:
                self._file.flush()
                os.fsync(self._file.fileno())
                self._file.close()
                self._file = None

    # ------------------------------------------------------------------ file handling

    def _open(self) -> None:
        self._file = open(self.path, "a", encoding="utf-8", buffering=1 << 16)  # noqa: SIM115
        self._size = self._file.tell()
        self._opened_at = time.monotonic()

    def _due_for_rotation(self, incoming: int) -> bool:
        if self._size == 0:
            return False
        if self.max_bytes and self._size + incoming > self.max_bytes:
            return True
        return bool(self.rotate_interval_s) and \
            time.monotonic() - self._opened_at >= self.rotate_interval_s

    def _rotate(self) -> None:
        assert self._file is not None
        self._file.close()
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        self._seq += 1
        target = self.path.with_name(f"{self.path.name}.{stamp}.{self._seq:06d}")
        os.replace(self.path, target)
        self.rotations += 1
        self._open()
        if self.backups:
            rotated = sorted(self.path.parent.glob(f"{self.path.name}.*"),
                             key=lambda p: p.stat().st_mtime_ns)
            for old in rotated[: max(len(rotated) - self.backups, 0)]:
                try:
                    old.unlink()
                except OSError as exc:
                    log.warning("audit: cannot remove old file %s: %s", old, exc)

    def _flush_loop(self) -> None:
        while not self._stop.wait(self.flush_interval_s):
            with self._lock:
                if self._dirty and self._file is not None:
                    self._file.flush()
                    self._dirty = False


@dataclass(frozen=True, slots=True)
class AuditBatch:
    """The audit events of one response, as records for ``audit.topic``: keyed by the
    produced topic's name (or the API's, for a request event), the event's JSON as value."""

    topic: str
    """``audit.topic``."""
    events: tuple[tuple[bytes, bytes], ...]
    """(key, value) of each event."""

    def count(self) -> int:
        """How many records."""
        return len(self.events)

    def size(self) -> int:
        """Bytes of keys and values (what the sink's ``queue_bytes`` counts)."""
        return sum(len(key) + len(value) for key, value in self.events)

    def sink_records(self) -> Iterator[SinkRecord]:
        """The records as written (no headers; the broker stamps the time)."""
        for key, value in self.events:
            yield SinkRecord(key, value, [], None)


class AuditTopic(Observer):
    """Sends audit events to ``audit.topic`` through the process's audit sink.

    An observer, so the events are made into JSON on its observer thread, off the event
    loop; the records go to ``sink`` (a :class:`KafkaSink` named ``audit``, settings
    ``audit_sink``), whose queue, time bounds and drop counts are the proxy's. The sink
    belongs to the process and outlives this observer (a reload may replace it).
    """

    def __init__(self, sink: KafkaSink, topic: str, *, requests: bool) -> None:
        self.sink = sink
        self.topic = topic
        self.requests = requests

    def on_response(self, info: ResponseInfo) -> None:
        """Offer the response's events to the sink (queued or dropped and counted)."""
        events = _events(info, self.requests)
        if events:
            self.sink.offer(AuditBatch(self.topic, tuple(
                (str(event.get("topic") or event.get("api_name")).encode(),
                 json.dumps(event, separators=(",", ":")).encode()) for event in events)))
