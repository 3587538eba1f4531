"""The side-copy sink's queue (``kiproxy.proxy.observe.kafka_sink``) with no cluster to
write to: offers from any thread, bounded by records and bytes, drops counted per sink and
reason and named in a rate-limited warning, and what is queued at close counted."""

from __future__ import annotations

import asyncio
import logging
import socket
import threading

import pytest

from kiproxy.proxy.config.clients import AuditSinkSettings
from kiproxy.proxy.observe.audit import AuditBatch
from kiproxy.proxy.observe.kafka_sink import KafkaSink
from kiproxy.proxy.observe.metrics import Metrics


def nowhere() -> str:
    """An address where nothing listens."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def events(n: int, value: bytes = b"{}") -> AuditBatch:
    return AuditBatch("events", tuple((b"orders", value) for _ in range(n)))


def make(metrics: Metrics, **settings: object) -> KafkaSink:
    return KafkaSink("audit", AuditSinkSettings.model_validate(
        {"request_timeout_ms": 200, "close_timeout_ms": 300, **settings}),
        bootstrap=[nowhere()], tls=None, metrics=metrics)


def test_offers_from_another_thread_are_bounded_by_records_and_counted(
        caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics()
    caplog.set_level(logging.WARNING, "kiproxy.sink")

    async def run() -> tuple[int, int]:
        sink = make(metrics, queue_records=5)
        await sink.start()
        offering = threading.Thread(target=lambda: [sink.offer(events(2)) for _ in range(4)])
        offering.start()
        await asyncio.to_thread(offering.join)
        queued = sink.queued
        assert sample(metrics, "kiproxy_sink_queued_records", sink="audit") == 4
        await sink.close()
        sink.offer(events(3))  # after close: counted, not queued
        return queued

    assert asyncio.run(run()) == (4, 4 * (len(b"orders") + 2))
    assert sample(metrics, "kiproxy_sink_dropped_total", sink="audit", reason="queue_full") == 4
    assert sample(metrics, "kiproxy_sink_dropped_total", sink="audit", reason="closed") == 4 + 3
    assert sample(metrics, "kiproxy_sink_queued_records", sink="audit") == 0
    full = [r.getMessage() for r in caplog.records if "(queue_full)" in r.getMessage()]
    assert len(full) == 1  # the second drop within the interval is held back, and counted
    assert full[0].startswith("audit sink: dropped 2 record(s) for topic events")
    assert "audit_sink.queue_records/queue_bytes" in full[0]


def test_a_batch_past_the_byte_bound_is_dropped_whole() -> None:
    metrics = Metrics()

    async def run() -> tuple[int, int]:
        sink = make(metrics, queue_bytes=100)
        await sink.start()
        sink.offer(events(3, b"x" * 20))   # 78 bytes: kept
        sink.offer(events(1, b"x" * 20))   # 104 > 100: dropped
        sink.offer(events(1, b"x" * 10))   # 94: kept
        queued = sink.queued
        await sink.close()
        return queued

    assert asyncio.run(run()) == (4, 94)
    assert sample(metrics, "kiproxy_sink_dropped_total", sink="audit", reason="queue_full") == 1
    assert sample(metrics, "kiproxy_sink_dropped_total", sink="audit", reason="closed") == 4
