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
from kiproxy.proxy.observe import kafka_sink
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
    # The second drop within the interval is held back, counted, and reported at close.
    assert [m.split(" since")[0] for m in full] == [
        "audit sink: dropped 2 record(s) for topic events"] * 2
    assert all("audit_sink.queue_records/queue_bytes" in m for m in full)


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


def _dropped_in_lines(caplog: pytest.LogCaptureFixture, reason: str) -> int:
    """Records the WARNING lines say were dropped for ``reason``, added up."""
    return sum(int(m.split("dropped ")[1].split(" ")[0])
               for m in (r.getMessage() for r in caplog.records) if f"({reason})" in m)


def test_drops_held_back_are_reported_after_the_interval_without_a_further_drop(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kafka_sink, "LOG_INTERVAL", 0.2)
    metrics = Metrics()
    caplog.set_level(logging.WARNING, "kiproxy.sink")

    async def run() -> tuple[int, int]:
        sink = make(metrics, queue_records=1, close_timeout_ms=100)
        await sink.start()
        sink.offer(events(1))  # queued (nothing listens: it stays)
        for _ in range(3):     # the first is written, the other two held back
            sink.offer(events(2))
        at_once = _dropped_in_lines(caplog, "queue_full")
        for _ in range(200):  # no further drop comes; the interval is 0.2 s
            if _dropped_in_lines(caplog, "queue_full") == 6:
                break
            await asyncio.sleep(0.05)
        later = _dropped_in_lines(caplog, "queue_full")
        await sink.close()
        return at_once, later

    assert asyncio.run(run()) == (2, 6)
    dropped = sample(metrics, "kiproxy_sink_dropped_total", sink="audit", reason="queue_full")
    assert dropped == _dropped_in_lines(caplog, "queue_full") == 6


def test_drops_held_back_are_reported_at_close(caplog: pytest.LogCaptureFixture) -> None:
    metrics = Metrics()
    caplog.set_level(logging.WARNING, "kiproxy.sink")

    async def run() -> int:
        sink = make(metrics, queue_records=1)
        await sink.start()
        sink.offer(events(1))
        for _ in range(5):
            sink.offer(events(3))
        before = _dropped_in_lines(caplog, "queue_full")
        await sink.close()
        return before

    assert asyncio.run(run()) == 3  # one line at once; 30 s have not passed
    dropped = sample(metrics, "kiproxy_sink_dropped_total", sink="audit", reason="queue_full")
    assert dropped == _dropped_in_lines(caplog, "queue_full") == 15


def test_a_dead_letter_copy_writes_a_header_key_that_is_not_utf8_escaped() -> None:
    """A stored header key that is not UTF-8 is read as lone surrogates, which the sink's
    producer (aiokafka) cannot write: every copy holding one was dropped as refused. It
    is written with its bytes escaped, every other header as it came."""
    from aiokafka.record.default_records import DefaultRecordBatchBuilder

    from kiproxy.interceptors.testing import make_record
    from kiproxy.proxy.observe.dead_letter import DeadLetterCopy, copy_headers

    key = b"\xff\xfeid".decode("utf-8", "surrogateescape")
    copy = DeadLetterCopy(
        topic="dlq", source_topic="t", partition=0, route="r", link=None, error_code=87,
        error_name="INVALID_RECORD", reason="refused \udcff", client_id=None,
        principal=None, time_ms=1, observed=False,
        records=(make_record(b"v", headers=[(key, b"1"), ("caf\u00e9", b"2")]),))
    headers = copy_headers(copy, 0)
    assert headers[:2] == [("\\xff\\xfeid", b"1"), ("caf\u00e9", b"2")]
    assert dict(headers)["kiproxy.reason"] == b"refused \\udcff"
    builder = DefaultRecordBatchBuilder(magic=2, compression_type=0, is_transactional=False,
                                        producer_id=-1, producer_epoch=-1, base_sequence=-1,
                                        batch_size=1 << 16)
    assert builder.append(0, timestamp=1, key=None, value=b"v", headers=headers) is not None
