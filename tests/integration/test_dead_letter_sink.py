"""The dead-letter sink (a ``KafkaSink``) alone, against real brokers: what a copy
carries, and what is dropped.

The sink is driven as the produce path drives it (``offer`` on the event loop);
the copies are read back with confluent-kafka and the counters read from the
proxy's own metrics registry.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Sequence
from pathlib import Path

import pytest
from conftest import consume
from support.apache_kafka import SASL_LISTENER, SASL_USERS

from kiproxy.interceptors import Record
from kiproxy.proxy.config.model import DeadLetterSinkSettings, UpstreamTlsSettings
from kiproxy.proxy.observe.dead_letter import HEADERS, DeadLetterCopy
from kiproxy.proxy.observe.kafka_sink import KafkaSink
from kiproxy.proxy.observe.metrics import Metrics
from kiproxy_dev.kafka_cluster import KafkaCluster
from kiproxy_dev.tansu import EmbeddedBroker

pytestmark = pytest.mark.timeout(120)


def create_topic(bootstrap: str, config: dict[str, str] | None = None) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"dlq-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})  # kept alive until the answer
    admin.create_topics([NewTopic(name, num_partitions=1, replication_factor=1,
                                  config=config or {})])[name].result(15)
    return name


def delete_topic(bootstrap: str, name: str) -> None:
    from confluent_kafka.admin import AdminClient

    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.delete_topics([name])[name].result(15)


def topic_names(bootstrap: str) -> set[str]:
    from confluent_kafka.admin import AdminClient

    return set(AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).topics)


def refused_copy(topic: str, records: Sequence[Record], **overrides: object) -> DeadLetterCopy:
    fields: dict[str, object] = dict(
        topic=topic, source_topic="payments", partition=3, route="guard",
        link="my_policy:MyPolicy", error_code=87, error_name="INVALID_RECORD",
        reason="amount is negative", client_id="orders-svc", principal="User:orders",
        time_ms=1_763_800_000_123, observed=False, records=tuple(records))
    fields.update(overrides)
    return DeadLetterCopy(**fields)  # type: ignore[arg-type]


def records(n: int, size: int = 8) -> list[Record]:
    return [Record(key=f"k{i}".encode(), value=f"{i:0{size}d}".encode(),
                   headers=[("trace", f"t{i}".encode()), ("trace", None), ("x", b"")],
                   timestamp=1_700_000_000_000 + i) for i in range(n)]


def dropped(metrics: Metrics, reason: str) -> float:
    return metrics.registry.get_sample_value("kiproxy_sink_dropped_total",
                                             {"sink": "dead_letter", "reason": reason}) or 0.0


def written(metrics: Metrics, topic: str) -> float:
    return metrics.registry.get_sample_value("kiproxy_sink_written_total",
                                             {"sink": "dead_letter", "topic": topic}) or 0.0


def sink(bootstrap: str, metrics: Metrics, **settings: object) -> KafkaSink:
    return KafkaSink("dead_letter", DeadLetterSinkSettings.model_validate(settings),
                     bootstrap=[bootstrap], tls=None, metrics=metrics)


async def wait_for(check: object, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not check() and time.monotonic() < deadline:  # type: ignore[operator]
        await asyncio.sleep(0.05)


def test_copies_keep_the_record_and_carry_every_header(broker: EmbeddedBroker) -> None:
    topic = create_topic(broker.bootstrap)
    metrics = Metrics()
    sent = records(3)
    observed = refused_copy(topic, records(1), route="watch", link=None, client_id=None,
                            principal=None, observed=True, error_code=44,
                            error_name="POLICY_VIOLATION", reason="no PII allowed")

    async def run() -> None:
        dl = sink(broker.bootstrap, metrics)
        await dl.start()
        dl.offer(refused_copy(topic, sent, record_reasons={1: "record 1: amount is -5"}))
        dl.offer(observed)
        await dl.close()

    asyncio.run(run())
    assert written(metrics, topic) == 4
    got = consume(broker.bootstrap, topic, 4)
    assert len(got) == 4
    for i, (message, original) in enumerate(zip(got[:3], sent, strict=True)):
        assert message.key() == original.key and message.value() == original.value
        assert message.timestamp()[1] == original.timestamp
        reason = b"record 1: amount is -5" if i == 1 else b"amount is negative"
        assert message.headers() == [
            ("trace", f"t{i}".encode()), ("trace", None), ("x", b""),
            ("kiproxy.topic", b"payments"), ("kiproxy.partition", b"3"),
            ("kiproxy.route", b"guard"), ("kiproxy.link", b"my_policy:MyPolicy"),
            ("kiproxy.error.code", b"87"), ("kiproxy.error.name", b"INVALID_RECORD"),
            ("kiproxy.reason", reason), ("kiproxy.client.id", b"orders-svc"),
            ("kiproxy.principal", b"User:orders"), ("kiproxy.time", b"1763800000123"),
            ("kiproxy.observed", b"false")]
    last = dict(got[3].headers()[3:])
    assert list(last) == list(HEADERS)
    assert last["kiproxy.route"] == b"watch" and last["kiproxy.observed"] == b"true"
    assert last["kiproxy.link"] is None and last["kiproxy.client.id"] is None
    assert last["kiproxy.principal"] is None and last["kiproxy.error.code"] == b"44"
    assert last["kiproxy.reason"] == b"no PII allowed"


def test_a_full_queue_drops_whole_copies_and_counts_their_records(
        broker: EmbeddedBroker) -> None:
    topic = create_topic(broker.bootstrap)
    metrics = Metrics()

    async def run() -> None:
        dl = sink(broker.bootstrap, metrics, queue_records=5, queue_bytes=1000)
        await dl.start()
        # The writer cannot run between these calls: the queue fills as under a burst.
        dl.offer(refused_copy(topic, records(3)))
        dl.offer(refused_copy(topic, records(3)))          # 6 > 5 records: dropped
        dl.offer(refused_copy(topic, records(1, size=2000)))  # past queue_bytes: dropped
        dl.offer(refused_copy(topic, records(2)))          # fits
        await dl.close()

    asyncio.run(run())
    assert dropped(metrics, "queue_full") == 4
    assert written(metrics, topic) == 5
    assert [m.key() for m in consume(broker.bootstrap, topic, 5)] == \
        [b"k0", b"k1", b"k2", b"k0", b"k1"]


def test_a_missing_or_deleted_topic_drops_copies_and_is_never_created(
        broker: EmbeddedBroker) -> None:
    topic = create_topic(broker.bootstrap)
    never = f"dlq-never-{uuid.uuid4().hex[:8]}"
    metrics = Metrics()

    async def run() -> None:
        dl = sink(broker.bootstrap, metrics, topic_check_interval_ms=100)
        await dl.start()
        dl.offer(refused_copy(topic, records(2)))
        dl.offer(refused_copy(never, records(3)))
        await wait_for(lambda: written(metrics, topic) == 2 and dropped(metrics, "topic_missing"))
        delete_topic(broker.bootstrap, topic)
        await asyncio.sleep(0.2)  # past the check interval: the sink asks again
        for _ in range(50):
            assert dl.offer(refused_copy(topic, records(4))) is None
        await wait_for(lambda: dropped(metrics, "topic_missing") == 3 + 200)
        await dl.close()

    asyncio.run(run())
    assert written(metrics, topic) == 2
    assert dropped(metrics, "topic_missing") == 203
    assert dropped(metrics, "queue_full") == 0
    names = topic_names(broker.bootstrap)
    assert topic not in names and never not in names


def test_a_record_over_a_mebibyte_is_copied_when_the_topic_takes_it(
        apache_kafka: KafkaCluster) -> None:
    """The producer's own 1 MiB max_request_size dropped such a record before the broker
    was asked ("configure max_request_size", a setting kiproxy does not have); the
    sink's bound is what a producer may send the proxy, and the topic decides."""
    topic = create_topic(apache_kafka.bootstrap, {"max.message.bytes": str(4 * 2**20)})
    metrics = Metrics()
    big = records(1, size=1_100_000)

    async def run() -> None:
        dl = sink(apache_kafka.bootstrap, metrics, linger_ms=0)
        await dl.start()
        dl.offer(refused_copy(topic, big))
        await wait_for(lambda: written(metrics, topic) == 1 or dropped(metrics, "refused") > 0)
        await dl.close()

    asyncio.run(run())
    assert (written(metrics, topic), dropped(metrics, "refused")) == (1, 0)
    (message,) = consume(apache_kafka.bootstrap, topic, 1)
    assert message.value() == big[0].value


def test_records_the_broker_refuses_are_dropped_and_counted(apache_kafka: KafkaCluster) -> None:
    topic = create_topic(apache_kafka.bootstrap, {"max.message.bytes": "2048"})
    metrics = Metrics()

    async def run() -> None:
        dl = sink(apache_kafka.bootstrap, metrics, linger_ms=0)
        await dl.start()
        dl.offer(refused_copy(topic, records(1)))
        await wait_for(lambda: written(metrics, topic) == 1)
        dl.offer(refused_copy(topic, records(3, size=4000)))  # each past max.message.bytes
        await wait_for(lambda: dropped(metrics, "refused") == 3)
        dl.offer(refused_copy(topic, records(1)))
        await wait_for(lambda: written(metrics, topic) == 2)
        await dl.close()

    asyncio.run(run())
    assert dropped(metrics, "refused") == 3
    assert written(metrics, topic) == 2
    assert [m.value() for m in consume(apache_kafka.bootstrap, topic, 2)] == \
        [b"00000000", b"00000000"]


def test_the_sink_authenticates_with_credentials_of_its_own(apache_kafka: KafkaCluster,
                                                             tmp_path: Path) -> None:
    """SCRAM-SHA-512 on the cluster's SASL listener, the password read from a file."""
    topic = create_topic(apache_kafka.bootstrap)
    secret = tmp_path / "dlq-password"
    secret.write_text(SASL_USERS["bob"] + "\n")
    metrics = Metrics()
    settings = DeadLetterSinkSettings.model_validate({
        "bootstrap": apache_kafka.listener_bootstrap(SASL_LISTENER), "sasl": {
            "mechanism": "SCRAM-SHA-512", "username": "bob", "password_file": str(secret)}})
    bootstrap, tls = settings.connection([apache_kafka.bootstrap], UpstreamTlsSettings())
    assert tls is None and bootstrap == (apache_kafka.listener_bootstrap(SASL_LISTENER),)

    async def run() -> None:
        dl = KafkaSink("dead_letter", settings, bootstrap=bootstrap, tls=None, metrics=metrics)
        await dl.start()
        dl.offer(refused_copy(topic, records(2)))
        await wait_for(lambda: written(metrics, topic) == 2)
        await dl.close()

    asyncio.run(run())
    assert written(metrics, topic) == 2
    assert [m.key() for m in consume(apache_kafka.bootstrap, topic, 2)] == [b"k0", b"k1"]


def test_a_broker_gone_away_drops_copies_as_unavailable_and_close_is_bounded() -> None:
    with EmbeddedBroker() as own:
        topic = create_topic(own.bootstrap)
        metrics = Metrics()

        async def run() -> None:
            dl = sink(own.bootstrap, metrics, request_timeout_ms=1000, close_timeout_ms=3000)
            await dl.start()
            dl.offer(refused_copy(topic, records(1)))
            await wait_for(lambda: written(metrics, topic) == 1)
            own.stop()
            dl.offer(refused_copy(topic, records(2)))
            await wait_for(lambda: dropped(metrics, "unavailable") == 2)
            dl.offer(refused_copy(topic, records(3)))
            await dl.close()
            dl.offer(refused_copy(topic, records(4)))  # after close: counted, not queued

        asyncio.run(run())
    assert written(metrics, topic) == 1
    # The 3 queued at close either time out within close_timeout_ms or are counted closed.
    assert dropped(metrics, "unavailable") >= 2
    assert dropped(metrics, "closed") >= 4
    assert dropped(metrics, "unavailable") + dropped(metrics, "closed") == 2 + 3 + 4
