"""Apache Kafka's Java client (tests/java/KiproxyClient.java) against a 1-node Apache Kafka.

No proxy yet: these pin down what the client prints, so that the interception
tests can compare a run through kiproxy with a run straight to the broker.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest
from support.apache_kafka import kafka_home_or_skip
from support.java_client import JavaClient

from kiproxy.proxy.kafka_cluster import KafkaCluster


@pytest.fixture(scope="module")
def cluster() -> Iterator[KafkaCluster]:
    with KafkaCluster(kafka_home_or_skip(), nodes=1) as c:
        yield c


@pytest.fixture(scope="module")
def client() -> JavaClient:
    return JavaClient.build(kafka_home_or_skip())


def topic_name() -> str:
    return f"java-{uuid.uuid4().hex[:8]}"


def test_produce_reports_each_delivery_and_consume_reads_records_with_headers(
    cluster: KafkaCluster, client: JavaClient
) -> None:
    topic = topic_name()
    produced = client.produce(
        cluster.bootstrap,
        topic,
        5,
        compression="zstd",
        idempotent=True,
        headers=[("trace", "abc"), ("trace", "def")],
        value_prefix="hello-",
    )
    assert produced.returncode == 0, produced.stderr
    assert [e["index"] for e in produced.of("delivered")] == [0, 1, 2, 3, 4]
    assert [e["offset"] for e in produced.of("delivered")] == [0, 1, 2, 3, 4]
    assert produced.done == {
        "event": "done",
        "sent": 5,
        "delivered": 5,
        "errors": 0,
        "transaction": None,
    }

    consumed = client.consume(cluster.bootstrap, topic, 5, group=f"g-{topic}")
    assert consumed.returncode == 0, consumed.stderr
    records = consumed.of("record")
    assert [(r["key"], r["value"], r["offset"]) for r in records] == [
        (f"key-{i}", f"hello-{i}", i) for i in range(5)
    ]
    assert records[0]["headers"] == [["trace", "abc"], ["trace", "def"]]


def test_read_committed_sees_committed_transactions_only(
    cluster: KafkaCluster, client: JavaClient
) -> None:
    topic = topic_name()
    aborted = client.produce(
        cluster.bootstrap,
        topic,
        3,
        transactional_id=f"tx-{topic}-a",
        abort=True,
        value_prefix="aborted-",
    )
    assert aborted.done["transaction"] == "aborted"
    committed = client.produce(
        cluster.bootstrap,
        topic,
        3,
        transactional_id=f"tx-{topic}-c",
        value_prefix="committed-",
        compression="lz4",
    )
    assert committed.returncode == 0, committed.stderr
    assert committed.done["transaction"] == "committed"

    seen = client.consume(cluster.bootstrap, topic, 3, isolation="read_committed")
    assert [r["value"] for r in seen.of("record")] == [f"committed-{i}" for i in range(3)]
    everything = client.consume(cluster.bootstrap, topic, 6, isolation="read_uncommitted")
    assert len(everything.of("record")) == 6


def test_a_failed_send_is_reported_with_the_exception_class(
    cluster: KafkaCluster, client: JavaClient
) -> None:
    # An illegal topic name: the client refuses every record, naming Kafka's exception.
    run = client.produce(cluster.bootstrap, "bad topic name!", 2)
    assert run.returncode == 1
    errors = run.of("error")
    assert errors, run.stderr
    assert all(e["error"].startswith("org.apache.kafka.common.errors.") for e in errors)
    assert run.done["delivered"] == 0
