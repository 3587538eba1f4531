"""``audit.topic`` through ``audit_sink``: the audit events reach a cluster of their own with
credentials of their own, and a cluster that refuses the credentials changes no answer.

The proxy runs in front of the session's Tansu; the audit sink writes to the session's
Apache Kafka on its SCRAM-SHA-512 listener. The events are read back with confluent-kafka
and the drops read from the proxy's ``/metrics``.
"""

from __future__ import annotations

import json
import signal
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import consume_until, launch_proxy
from support.apache_kafka import SASL_LISTENER, SASL_USERS

from kiproxy_dev.kafka_cluster import KafkaCluster
from kiproxy_dev.tansu import EmbeddedBroker, free_port

pytestmark = pytest.mark.timeout(180)


def produce(bootstrap: str, topic: str, n: int) -> list[Any]:
    """Every record's delivery error (None: stored)."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "client.id": "audited",
                         "linger.ms": 5, "message.timeout.ms": 20000})
    errors: list[Any] = []
    for i in range(n):
        producer.produce(topic, b"v%d" % i, on_delivery=lambda err, _m: errors.append(err))
    producer.flush(30)
    return errors


def partitions(bootstrap: str, topic: str) -> int:
    """How many partitions ``topic`` has (the cluster created it on first use)."""
    from confluent_kafka.admin import AdminClient

    metadata = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10)
    assert topic in metadata.topics
    return len(metadata.topics[topic].partitions)


def records_of(events: list[Any], topic: str) -> int:
    """The records the audit events (messages of the audit topic) count for ``topic``."""
    return sum(e["records"] for e in (json.loads(m.value()) for m in events)
               if e.get("topic") == topic)


def dropped(metrics: str) -> float:
    with urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("kiproxy_sink_dropped_total{") and 'sink="audit"' in line)


def audited_proxy(tmp_path: Path, tansu: EmbeddedBroker, kafka: KafkaCluster, audit: str,
                  password: str) -> tuple[Any, str]:
    secret = tmp_path / "audit-password"
    secret.write_text(password + "\n")
    metrics = f"127.0.0.1:{free_port()}"
    config = tmp_path / "kiproxy.yaml"
    config.write_text(yaml.safe_dump({"metrics_listen": metrics, "audit": {"topic": audit},
                                      "audit_sink": {
        "bootstrap": [kafka.listener_bootstrap(SASL_LISTENER)], "request_timeout_ms": 2000,
        "sasl": {"mechanism": "SCRAM-SHA-512", "username": "bob",
                 "password_file": str(secret)}}}))
    return launch_proxy(tansu.bootstrap, config_file=config), metrics


def test_audit_events_go_to_a_cluster_of_their_own_with_their_own_credentials(
        tmp_path: Path, broker: EmbeddedBroker, apache_kafka: KafkaCluster, topic: str) -> None:
    audit = f"audit-{uuid.uuid4().hex[:8]}"
    proxy, _ = audited_proxy(tmp_path, broker, apache_kafka, audit, SASL_USERS["bob"])
    try:
        assert produce(proxy.bootstrap, topic, 30) == [None] * 30
    finally:
        assert proxy.stop() == 0  # shutdown writes what is queued
    got = consume_until(apache_kafka.bootstrap, audit, lambda got: records_of(got, topic) >= 30,
                        partitions=partitions(apache_kafka.bootstrap, audit), timeout=10)
    mine = [e for e in (json.loads(m.value()) for m in got) if e.get("topic") == topic]
    assert sum(e["records"] for e in mine) == 30, proxy.log
    assert all(e["client_id"] == "audited" for e in mine)


def test_refused_credentials_change_no_answer_and_drops_are_counted(
        tmp_path: Path, broker: EmbeddedBroker, apache_kafka: KafkaCluster, topic: str) -> None:
    audit = f"audit-{uuid.uuid4().hex[:8]}"
    proxy, metrics = audited_proxy(tmp_path, broker, apache_kafka, audit, "not-bobs-password")
    try:
        assert produce(proxy.bootstrap, topic, 30) == [None] * 30
        proxy.wait_for_line("level=WARNING", "audit sink: cannot connect")
        assert dropped(metrics) == 0  # the events wait in the queue meanwhile
    finally:
        assert proxy.stop() == 0
    assert not [line for line in proxy.lines if "level=ERROR" in line or "Traceback" in line]
    # At shutdown the queued events are counted as closed (the metrics listener is gone
    # by then: the line says so).
    proxy.wait_for_line("audit sink: dropped", f"for topic {audit}", "(closed)")


def test_a_reload_that_first_sets_audit_topic_starts_the_audit_sink(
        tmp_path: Path, broker: EmbeddedBroker, topic: str) -> None:
    audit = f"audit-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "kiproxy.yaml"
    config.write_text(yaml.safe_dump({"log_level": "INFO"}))
    proxy = launch_proxy(broker.bootstrap, config_file=config)
    try:
        assert produce(proxy.bootstrap, topic, 5) == [None] * 5  # not audited
        config.write_text(yaml.safe_dump({"log_level": "INFO", "audit": {"topic": audit}}))
        proxy.process.send_signal(signal.SIGHUP)
        proxy.wait_for_line("reload (signal) applied")
        assert produce(proxy.bootstrap, topic, 7) == [None] * 7
    finally:
        assert proxy.stop() == 0
    got = consume_until(broker.bootstrap, audit, lambda got: records_of(got, topic) >= 7,
                        partitions=partitions(broker.bootstrap, audit), timeout=10)
    mine = [e for e in (json.loads(m.value()) for m in got) if e.get("topic") == topic]
    assert sum(e["records"] for e in mine) == 7, proxy.log
