"""Apache Kafka's Java client (tests/java/KiproxyClient.java), straight to Apache Kafka and
through kiproxy, on the session's shared 1-node cluster.

The first tests pin down what the client prints against the broker alone. The
others run it through the proxy with the TopicRouter of tests/plugins: ``up-``
topics are upper-cased, ``rej-`` rejected with POLICY_VIOLATION, ``inv-`` with
INVALID_RECORD and record_errors, ``inw-`` with INVALID_RECORD alone (each with
an error_message). What the Java producer
surfaces for a rejection is asserted exactly (and written down in
docs/java-client.md): every send of the batch fails with the error's own
exception class, its message the error_message (or, for a record listed in
record_errors, that record's message); a transaction then fails to commit.
"""


from __future__ import annotations

import re
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ProxyProcess, launch_proxy
from support.apache_kafka import kafka_home_or_skip
from support.java_client import JavaClient

from kiproxy_dev.kafka_cluster import KafkaCluster

pytestmark = pytest.mark.timeout(240)

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
CODECS = ["none", "gzip", "snappy", "lz4", "zstd"]
REJECT_MESSAGE = "rej-* topics are closed for writes"
INVALID_MESSAGE = "inv-* records are refused one by one"


@pytest.fixture(scope="module")
def cluster(apache_kafka: KafkaCluster) -> KafkaCluster:
    """The session's shared 1-node Apache Kafka cluster."""
    return apache_kafka


@pytest.fixture(scope="module")
def proxy(cluster: KafkaCluster) -> Iterator[ProxyProcess]:
    """kiproxy in front of the cluster; the topic prefix picks the plugin."""
    routes = [
        {"topic": "up-.*", "interceptor": "kiproxy.interceptors.builtin.uppercase:Uppercase"},
        {"topic": "rej-.*", "interceptor": "tp_reject:Reject",
         "config": {"error": "POLICY_VIOLATION", "message": REJECT_MESSAGE}},
        {"topic": "inv-.*", "interceptor": "tp_reject:Reject",
         "config": {"error": "INVALID_RECORD", "message": INVALID_MESSAGE,
                    "record_errors": True}},
        {"topic": "inw-.*", "interceptor": "tp_reject:Reject",
         "config": {"error": "INVALID_RECORD", "message": INVALID_MESSAGE}},
    ]
    p = launch_proxy(cluster.bootstrap, interceptor="topic_router",
                     interceptor_config={"routes": routes}, plugins_dir=PLUGINS,
                     node_ids=tuple(cluster.broker_ids))
    yield p
    assert p.alive(), f"the proxy died during the module:\n{p.log}"
    p.stop()


@pytest.fixture(scope="module")
def client() -> JavaClient:
    return JavaClient.build(kafka_home_or_skip())


def high_watermark(bootstrap: str, topic: str) -> int:
    """The end offset of partition 0, read from the broker."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"wm-{topic}"})
    try:
        return int(c.get_watermark_offsets(TopicPartition(topic, 0), timeout=10)[1])
    finally:
        c.close()


def topic_name(prefix: str = "java") -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


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


# ---------------------------------------------------------------------------- through kiproxy


@pytest.mark.parametrize("codec", CODECS)
def test_idempotent_producer_through_a_transforming_plugin(
    cluster: KafkaCluster, proxy: ProxyProcess, client: JavaClient, codec: str
) -> None:
    topic = topic_name("up-java")
    produced = client.produce(
        proxy.bootstrap,
        topic,
        20,
        compression=codec,
        idempotent=True,
        headers=[("trace", "abc"), ("trace", "def"), ("empty", "")],
        value_prefix=f"{codec} value-",
    )
    assert produced.returncode == 0, produced.stderr
    assert [e["offset"] for e in produced.of("delivered")] == list(range(20))
    # What the broker stored, read straight from it: values changed, keys and headers kept.
    consumed = client.consume(cluster.bootstrap, topic, 20)
    records = consumed.of("record")
    assert [(r["key"], r["value"], r["offset"]) for r in records] == [
        (f"key-{i}", f"{codec} VALUE-{i}".upper(), i) for i in range(20)
    ]
    assert all(r["headers"] == [["trace", "abc"], ["trace", "def"], ["empty", ""]]
               for r in records)


def test_transactions_through_a_transforming_plugin_read_committed(
    cluster: KafkaCluster, proxy: ProxyProcess, client: JavaClient
) -> None:
    topic = topic_name("up-javatx")
    first = client.produce(proxy.bootstrap, topic, 3, transactional_id=f"tx-{topic}-1",
                           value_prefix="committed-", compression="zstd")
    assert first.returncode == 0, first.stderr
    aborted = client.produce(proxy.bootstrap, topic, 3, transactional_id=f"tx-{topic}-2",
                             abort=True, value_prefix="aborted-")
    assert aborted.done["transaction"] == "aborted"
    last = client.produce(proxy.bootstrap, topic, 2, transactional_id=f"tx-{topic}-3",
                          value_prefix="last-", compression="gzip")
    assert last.returncode == 0, last.stderr

    expected = [f"COMMITTED-{i}" for i in range(3)] + [f"LAST-{i}" for i in range(2)]
    for bootstrap in (proxy.bootstrap, cluster.bootstrap):
        seen = client.consume(bootstrap, topic, 5, isolation="read_committed",
                              timeout_ms=15_000)
        assert [r["value"] for r in seen.of("record")] == expected
    everything = client.consume(proxy.bootstrap, topic, 8, timeout_ms=15_000)
    assert sorted(r["value"] for r in everything.of("record")) == sorted(
        [*expected, *(f"ABORTED-{i}" for i in range(3))])


@pytest.mark.parametrize(("prefix", "idempotent", "exception", "message"), [
    ("rej", False, "org.apache.kafka.common.errors.PolicyViolationException",
     re.escape(REJECT_MESSAGE)),
    ("rej", True, "org.apache.kafka.common.errors.PolicyViolationException",
     re.escape(REJECT_MESSAGE)),
    # The records listed in record_errors get their own message (index within the batch).
    ("inv", False, "org.apache.kafka.common.InvalidRecordException", r"record \d+ refused"),
    ("inw", False, "org.apache.kafka.common.InvalidRecordException", re.escape(INVALID_MESSAGE)),
], ids=["policy-violation", "policy-violation-idempotent", "invalid-record-with-record-errors",
        "invalid-record"])
def test_a_rejection_reaches_the_java_producer_as_its_exception_and_message(
    cluster: KafkaCluster, proxy: ProxyProcess, client: JavaClient, prefix: str,
    idempotent: bool, exception: str, message: str
) -> None:
    topic = topic_name(f"{prefix}-java")
    run = client.produce(proxy.bootstrap, topic, 3, acks="all", idempotent=idempotent)
    assert run.returncode == 1
    errors = run.of("error")
    assert [e["index"] for e in errors] == [0, 1, 2], run.stderr
    for e in errors:
        assert e["error"] == exception and re.fullmatch(message, e["message"]), e
    assert run.done["delivered"] == 0
    assert high_watermark(cluster.bootstrap, topic) == 0  # nothing stored


def test_a_rejection_fails_the_java_transaction_with_the_cause(
    cluster: KafkaCluster, proxy: ProxyProcess, client: JavaClient
) -> None:
    topic = topic_name("rej-javatx")
    run = client.produce(proxy.bootstrap, topic, 2, transactional_id=f"tx-{topic}")
    assert run.returncode == 1
    sends = [e for e in run.of("error") if e["stage"] == "send"]
    assert [(e["error"], e["message"]) for e in sends] == [
        ("org.apache.kafka.common.errors.PolicyViolationException", REJECT_MESSAGE)] * 2
    # commitTransaction() fails with the rejection: wrapped when the producer had moved
    # to its error state before the commit began, as itself when it moved there after
    # (the send callbacks, and so flush(), may complete just before that move).
    [commit] = [e for e in run.of("error") if e["stage"] == "transaction"]
    policy = ("org.apache.kafka.common.errors.PolicyViolationException", REJECT_MESSAGE)
    wrapped = ("org.apache.kafka.common.KafkaException",
               "Cannot execute transactional method because we are in an error state", *policy)
    assert (commit["error"], commit["message"]) == policy or (
        commit["error"], commit["message"], commit["cause"], commit["cause_message"]
    ) == wrapped, commit
    assert high_watermark(cluster.bootstrap, topic) == 0
