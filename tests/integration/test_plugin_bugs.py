"""Plugin bugs the proxy must hold against, end to end: Tansu, ``kiproxy run`` as a
subprocess, real producers.

One proxy serves the module, with routes:

* ``stubborn-`` topics run ``tp_slow:Stubborn`` with ``timeout_ms: 300``: an
  ``async def intercept`` that swallows its cancellation and sleeps on (two sleeps of
  1.5 s). The producer is answered REQUEST_TIMED_OUT at the deadline, not when the
  plugin ends; nothing is stored, the audit log and ``kiproxy_interceptor_errors``
  say timeout, and once the plugin ends the proxy warns that it ignored its
  cancellation.
* ``own-timeout-`` topics run ``tp_slow:OwnTimeout``: an ``async def intercept`` that
  bounds a slow call of its own with ``asyncio.timeout`` and falls back when it
  fires. Its timeout is the plugin's business: the records are stored as the plugin
  answered, and the proxy's own work is not cancelled by it.
* ``strays-`` and ``mixed-`` topics run ``tp_reject:Reject`` raising ``RejectBatch``
  on a batch of three records with record errors for records 99 and -1 (``strays-``),
  or 99, 2 and 0 (``mixed-``). Only those naming a record of the batch are sent, in
  index order: librdkafka, which matches them to its records in order, failed every
  record with ``_INVALID_DIFFERENT_RECORD`` (and kafka-python with a generic
  ``KafkaError``) when the others were sent. The rejection keeps the plugin's code and
  message, and the proxy warns, naming the plugin, the topic-partition and the indices
  it left out.
"""

from __future__ import annotations

import json
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ProxyProcess, consume, high_watermark, launch_proxy
from hardening.fault_relay import wait_until

from kiproxy_dev.tansu import EmbeddedBroker, free_port

pytestmark = pytest.mark.timeout(120)

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
REQUEST_TIMED_OUT = 7
POLICY_VIOLATION = 44
STUBBORN = "tp_slow:Stubborn"
STRAYS = "tp_reject:Reject"
OWN_TIMEOUT = "tp_slow:OwnTimeout"


class Proxy:
    """The module's proxy and where it writes its audit log and metrics."""

    def __init__(self, process: ProxyProcess, audit: Path, metrics: str) -> None:
        self.process = process
        self.audit = audit
        self.metrics = metrics

    def audited(self, topic: str) -> list[dict[str, Any]]:
        lines = self.audit.read_text().splitlines() if self.audit.exists() else []
        return [e for e in map(json.loads, lines)
                if e.get("event") == "produce" and e.get("topic") == topic]

    def timeouts(self) -> float:
        with urllib.request.urlopen(f"http://{self.metrics}/metrics", timeout=5) as answer:
            text = answer.read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("kiproxy_interceptor_errors_total{")
                   and 'reason="timeout"' in line)


@pytest.fixture(scope="module")
def proxy(broker: EmbeddedBroker, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proxy]:
    where = tmp_path_factory.mktemp("plugin-bugs")
    metrics = f"127.0.0.1:{free_port()}"
    config = where / "kiproxy.json"
    config.write_text(json.dumps({"routes": [
        {"name": "stubborn", "match": {"topic": "stubborn-.*"},
         "interceptors": [{"class": STUBBORN, "timeout_ms": 300,
                           "config": {"sleep_ms": 1500, "times": 2}}]},
        {"name": "own-timeout", "match": {"topic": "own-timeout-.*"},
         "interceptors": [{"class": OWN_TIMEOUT, "timeout_ms": 5000,
                           "config": {"sleep_ms": 2000, "timeout_ms": 100}}]},
        {"name": "strays", "match": {"topic": "strays-.*"},
         "interceptors": [{"class": STRAYS, "config": {
             "message": "strays refused", "record_errors": [99, -1]}}]},
        {"name": "mixed", "match": {"topic": "mixed-.*"},
         "interceptors": [{"class": f"{STRAYS}Too", "config": {
             "error": "INVALID_RECORD", "message": "mixed refused",
             "record_errors": [99, 2, 0]}}]},
    ]}))
    audit = where / "audit.jsonl"
    p = launch_proxy(broker.bootstrap, "--audit-log", str(audit), "--metrics-listen", metrics,
                     plugins_dir=PLUGINS, config_file=config)
    yield Proxy(p, audit, metrics)
    assert p.alive(), f"the proxy died during the module:\n{p.log}"
    p.stop()


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


def test_a_plugin_that_swallows_its_cancellation_is_timed_out_at_the_deadline(
        proxy: Proxy) -> None:
    from confluent_kafka import KafkaError, Producer
    from kafka import KafkaProducer
    from kafka.errors import RequestTimedOutError

    topic = _name("stubborn")
    before = proxy.timeouts()
    # REQUEST_TIMED_OUT is retriable: retries=0 lets the client report it at once.
    cf = Producer({"bootstrap.servers": proxy.process.bootstrap, "retries": 0,
                   "message.timeout.ms": 20000})
    errors: list[Any] = []
    cf.produce(topic, value=b"late", partition=0, on_delivery=lambda e, _m: errors.append(e))
    cf.flush(20)
    # Had the proxy waited for the plugin to end, the batch would have been stored.
    assert [e.code() if e else None for e in errors] == [KafkaError.REQUEST_TIMED_OUT]

    kp = KafkaProducer(bootstrap_servers=proxy.process.bootstrap, retries=0)
    try:
        with pytest.raises(RequestTimedOutError) as info:
            kp.send(topic, value=b"late too", partition=0).get(timeout=15)
        assert f"interceptor {STUBBORN} did not finish within 300 ms" in str(info.value)
    finally:
        kp.close(timeout=5)

    assert high_watermark(proxy.process.bootstrap, topic) == 0
    assert proxy.timeouts() - before == 2
    proxy.process.wait_for_line("level=WARNING", f"rejected {topic}",
                                "did not finish within 300 ms")
    warning = proxy.process.wait_for_line(f"interceptor {STUBBORN} ignored its cancellation")
    assert "level=WARNING" in warning and "returned, which was dropped" in warning
    assert wait_until(lambda: len(proxy.audited(topic)) == 2, 10), proxy.audited(topic)
    assert [(e["outcome"], e["error_code"]) for e in proxy.audited(topic)] == \
        [("rejected", REQUEST_TIMED_OUT)] * 2


def test_a_plugins_own_asyncio_timeout_is_its_own_business(proxy: Proxy) -> None:
    """The plugin's timeout cancels the task it was entered in: the one running the plugin.
    (When the plugin was moved to a task of its own after its first wait, its timeout
    cancelled the proxy's task that had started it instead.)"""
    from confluent_kafka import Producer

    topic = _name("own-timeout")
    producer = Producer({"bootstrap.servers": proxy.process.bootstrap, "retries": 0,
                         "linger.ms": 0})
    errors: list[Any] = []
    for i in range(3):  # one request after another, on one connection
        producer.produce(topic, value=b"v%d" % i, partition=0,
                         on_delivery=lambda e, _m: errors.append(e))
        producer.flush(20)
    assert errors == [None] * 3
    values = [m.value() for m in consume(proxy.process.bootstrap, topic, 3)]
    assert values == [b"fallback:v0", b"fallback:v1", b"fallback:v2"]
    about = [line for line in proxy.process.log.splitlines()
             if (topic in line or OWN_TIMEOUT in line) and "level=INFO" not in line]
    assert about == [], about


R = "_INVALID_DIFFERENT_RECORD"  # librdkafka: another record of the batch was refused
FAILED = "Failed to append record because it was part of a batch"  # kafka-python's generic


@pytest.mark.parametrize(("prefix", "confluent", "kafka_python"), [
    # Only records that are not in the batch: the rejection reaches every record as the
    # plugin made it (before, librdkafka failed each with _INVALID_DIFFERENT_RECORD and
    # kafka-python with a generic KafkaError).
    ("strays", ["POLICY_VIOLATION"] * 3, ["PolicyViolationError: strays refused"] * 3),
    # 99, 2, 0: 99 left out, 2 and 0 sent in order, each reaching its record.
    ("mixed", ["INVALID_RECORD", R, "INVALID_RECORD"],
     ["InvalidRecordError: record 0 refused", FAILED, "InvalidRecordError: record 2 refused"]),
])
def test_record_errors_naming_no_record_of_the_batch_are_left_out(
        proxy: Proxy, prefix: str, confluent: list[str], kafka_python: list[str]) -> None:
    from confluent_kafka import Producer
    from kafka import KafkaProducer

    topic = _name(prefix)
    cf = Producer({"bootstrap.servers": proxy.process.bootstrap, "linger.ms": 100,
                   "message.timeout.ms": 20000})
    errors: dict[bytes, Any] = {}
    for value in (b"r0", b"r1", b"r2"):  # one batch of three records
        cf.produce(topic, value=value, partition=0,
                   on_delivery=lambda e, m: errors.__setitem__(m.value(), e))
    cf.flush(20)
    assert [errors[v].name() for v in (b"r0", b"r1", b"r2")] == confluent

    kp = KafkaProducer(bootstrap_servers=proxy.process.bootstrap, retries=0, linger_ms=100)
    try:
        futures = [kp.send(topic, value=v, partition=0) for v in (b"k0", b"k1", b"k2")]
        kp.flush(15)
        shown = []
        for future in futures:
            with pytest.raises(Exception) as info:  # each record's own error class
                future.get(timeout=15)
            shown.append(f"{type(info.value).__name__}: {info.value}")
    finally:
        kp.close(timeout=5)
    assert [want in got for want, got in zip(kafka_python, shown, strict=True)] == [True] * 3, \
        shown

    assert high_watermark(proxy.process.bootstrap, topic) == 0
    plugin = STRAYS if prefix == "strays" else f"{STRAYS}Too"
    warning = proxy.process.wait_for_line(f"interceptor {plugin} rejected {topic}[0] with "
                                          "record_errors naming no record")
    assert "level=WARNING" in warning
    assert ("(indices 0 to 2): 99, -1;" if prefix == "strays" else "(indices 0 to 2): 99;") \
        in warning
