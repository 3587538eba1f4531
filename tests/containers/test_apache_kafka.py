"""kiproxy in front of Apache Kafka: the official image in KRaft mode, started by testcontainers.

The runtime and observability suites run against Tansu, an embedded
Kafka-compatible broker. These tests repeat the core interception tests against
Apache Kafka itself: records transformed on the way in (every codec, checked
by the broker's own batch validation), a batch rejected with the producer
seeing the error and nothing stored, an idempotent and a transactional producer
whose sequence numbers the broker checks, a consumer group (classic and KIP-848)
that commits and resumes, and metadata that never names the broker.

Every test runs on two brokers (the ``kafka`` fixture's ids):

* ``jvm``: the session's 1-node Apache Kafka cluster of JVMs on loopback
  (tests/conftest.py's ``apache_kafka``, from ``make kafka``); skipped, saying
  how to get it, when no distribution is found.
* ``docker``: the official ``apache/kafka`` image (or, where it cannot be pulled,
  the equivalent ``make kafka-image`` builds from ``make kafka``'s jars) through
  testcontainers' Kafka module, set up for that image (the module's own defaults
  start Confluent's image). It needs the Docker API: Docker's, or podman's served
  for the session where no Docker engine answers; where neither runs, these are
  skipped with the reason "no Docker engine: ..." (pytest's ``-ra`` summary
  prints it).

The proxy runs on this machine as its own process (``kiproxy run``, the way
tests/conftest.py starts it), in front of the broker's port.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
import uuid
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, ProxyProcess, consume, high_watermark, launch_proxy
from support.confluent import group_consumer_conf, poll_messages

from containers.engine import (
    SERVED_DOCKER_HOST,
    NoEngine,
    NoKafkaJars,
    build_image,
    engine_env,
)
from kiproxy_dev.tansu import free_port

try:
    from testcontainers.community.kafka import KafkaContainer
except ImportError:  # testcontainers before its "community" package layout
    from testcontainers.kafka import KafkaContainer

pytestmark = pytest.mark.timeout(600)  # the first test also pulls and starts the image

KAFKA_IMAGE = "apache/kafka:4.3.1"
"""The same tag as docker-compose.yml (tests/unit/test_deploy_files.py checks they agree)."""

ROUTER = "kiproxy.interceptors.builtin.route:TopicRouter"
ROUTES: dict[str, Any] = {
    "routes": [
        # The example plugin of plugins/, as docker-compose.yml configures it.
        {"topic": "masked-.*", "interceptor": "mask_card_numbers:MaskCardNumbers"},
        {"topic": "json-.*", "interceptor": "json_schema",
         "config": {"default_schema": {"type": "object", "required": ["id"]},
                    "error": "POLICY_VIOLATION"}},
    ],
}
POLICY_VIOLATION = 44


# ---------------------------------------------------------------------------- the broker


@dataclass(frozen=True)
class KafkaCluster:
    """Where the broker is, as seen from this machine, and its node ids."""

    bootstrap: str
    node_ids: tuple[int, ...]


class ApacheKafkaContainer(KafkaContainer):
    """testcontainers' ``KafkaContainer``, set up for the official ``apache/kafka`` image.

    The module starts the container with a command that waits for a start
    script, and writes that script once the published port is known, so that
    the broker can advertise ``host:mapped-port``. Its script and KRaft settings
    are written for Confluent's image (``/etc/confluent/docker/...``); this class
    keeps the mechanism and swaps both for what ``apache/kafka`` expects:
    ``KAFKA_*`` variables read by ``/etc/kafka/docker/run``, which formats the
    storage with ``CLUSTER_ID`` itself.
    """

    def __init__(self, image: str = KAFKA_IMAGE) -> None:
        super().__init__(image)

    def configure(self) -> None:
        """KRaft settings for one combined broker and controller, node id 1."""
        self.wait_for = re.compile(r".*Kafka Server started.*")
        self.env.pop("KAFKA_BROKER_ID", None)  # ZooKeeper-era name; KRaft has node.id
        self.with_env("CLUSTER_ID", self.cluster_id)
        self.with_env("KAFKA_NODE_ID", "1")
        self.with_env("KAFKA_PROCESS_ROLES", "broker,controller")
        self.with_env("KAFKA_LISTENERS", f"{self.listeners},CONTROLLER://0.0.0.0:9094")
        self.with_env("KAFKA_LISTENER_SECURITY_PROTOCOL_MAP",
                      f"{self.security_protocol_map},CONTROLLER:PLAINTEXT")
        self.with_env("KAFKA_CONTROLLER_QUORUM_VOTERS", "1@localhost:9094")
        self.with_env("KAFKA_CONTROLLER_LISTENER_NAMES", "CONTROLLER")
        # One broker: every internal topic with one replica.
        self.with_env("KAFKA_TRANSACTION_STATE_LOG_REPLICATION_FACTOR", "1")
        self.with_env("KAFKA_TRANSACTION_STATE_LOG_MIN_ISR", "1")
        self.with_env("KAFKA_SHARE_COORDINATOR_STATE_TOPIC_REPLICATION_FACTOR", "1")
        self.with_env("KAFKA_SHARE_COORDINATOR_STATE_TOPIC_MIN_ISR", "1")
        self.with_env("KAFKA_LOG_DIRS", "/tmp/kraft-combined-logs")

    def tc_start(self) -> None:
        """Write the start script: advertise the published port, then run the image's own."""
        host = self.get_container_host_ip()
        port = self.get_exposed_port(self.port)
        script = (
            "#!/bin/sh\n"
            f"export KAFKA_ADVERTISED_LISTENERS={self.listener_name}://{host}:{port},"
            "BROKER://$(hostname):9092\n"
            "exec /etc/kafka/docker/run\n"
        )
        self.create_file(script.encode(), self.TC_START_SCRIPT)


@pytest.fixture(scope="session")
def docker_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The Kafka image to start through the Docker API, once one answers: Docker's own, or
    podman's (``podman system service``, for this session) where no Docker engine answers
    and podman runs; the image is ``apache/kafka`` or, where it cannot be pulled, the one
    ``make kafka-image`` builds. Skips (with the reason shown) where neither engine runs."""
    from testcontainers.core.docker_client import DockerClient

    try:
        DockerClient(timeout=10).client.ping()
        docker_error = None
    except Exception as exc:
        docker_error = exc
    service = None
    if docker_error is not None:
        service = _podman_service(tmp_path_factory.mktemp("podman") / "podman.sock")
        if service is None:
            pytest.skip(f"no Docker engine: {docker_error} (and podman cannot serve the "
                        "Docker API here; make container-engine installs it)")
    try:
        try:
            kafka_image = build_image("kafka").ref
        except NoKafkaJars as exc:
            pytest.skip(f"apache/kafka cannot be pulled and make kafka failed: {exc}")
        except NoEngine as exc:
            pytest.skip(f"no container engine: {exc}")
        yield kafka_image
    finally:
        if service is not None:
            service.terminate()
            service.wait(10)


def _podman_service(socket: Path) -> subprocess.Popen[bytes] | None:
    """``podman system service`` on ``socket``, with DOCKER_HOST pointing testcontainers
    at it (and its reaper container off: its image cannot be pulled everywhere)."""
    if shutil.which("podman") is None:
        return None
    service = subprocess.Popen(["podman", "system", "service", "--time=0", f"unix://{socket}"],
                               env=engine_env(), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL)
    os.environ["DOCKER_HOST"] = os.environ[SERVED_DOCKER_HOST] = f"unix://{socket}"
    os.environ.setdefault("CONTAINERS_CONF", engine_env()["CONTAINERS_CONF"])
    from testcontainers.core.config import ConnectionMode
    from testcontainers.core.config import testcontainers_config as config
    from testcontainers.core.docker_client import DockerClient

    # podman's containers publish their ports on this host's loopback.
    config.connection_mode_override = ConnectionMode.docker_host
    config._ryuk_disabled = True

    deadline = time.monotonic() + 30
    while True:
        try:
            DockerClient(timeout=10).client.ping()
            return service
        except Exception:
            if service.poll() is not None or time.monotonic() > deadline:
                service.kill()
                os.environ.pop("DOCKER_HOST", None)
                return None
            time.sleep(0.2)


@pytest.fixture(scope="module", params=["jvm", "docker"])
def kafka(request: pytest.FixtureRequest) -> Iterator[KafkaCluster]:
    """One Apache Kafka broker (node id 1): the shared JVM cluster, or a container
    (KRaft, combined broker and controller)."""
    if request.param == "jvm":
        cluster = request.getfixturevalue("apache_kafka")
        yield KafkaCluster(cluster.bootstrap, tuple(cluster.broker_ids))
        return
    container = ApacheKafkaContainer(request.getfixturevalue("docker_engine"))
    container.start(timeout=180)
    try:
        yield KafkaCluster(container.get_bootstrap_server(), (1,))
    finally:
        container.stop()


@pytest.fixture(scope="module")
def proxy(kafka: KafkaCluster) -> Iterator[ProxyProcess]:
    """kiproxy in front of the broker: the example plugin and a JSON validator, by topic."""
    pins = [arg for node in kafka.node_ids for arg in ("--node-port", f"{node}={free_port()}")]
    p = launch_proxy(kafka.bootstrap, *pins, interceptor=ROUTER, interceptor_config=ROUTES,
                     plugins_dir=ROOT / "plugins")
    yield p
    assert p.alive(), f"proxy died during the module:\n{p.log}"
    p.stop()


# ---------------------------------------------------------------------------- helpers


def _create_topic(bootstrap: str, prefix: str, partitions: int = 1) -> str:
    """Create ``PREFIX-<random>`` through ``bootstrap``; return its name."""
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"{prefix}-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(name, num_partitions=partitions,
                                            replication_factor=1)], operation_timeout=20)
    futures[name].result(timeout=30)
    return name


def _produce(bootstrap: str, topic: str, records: list[tuple[bytes | None, bytes | None]],
             *, one_batch_each: bool = False, **conf: Any) -> list[Any]:
    """Produce ``(key, value)`` records; return the delivery error (or None) of each, in order."""
    from confluent_kafka import Producer

    results: dict[int, Any] = {}
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, **conf})
    for i, (key, value) in enumerate(records):
        producer.produce(topic, key=key, value=value, partition=0, headers=[("i", str(i).encode())],
                         on_delivery=lambda err, _msg, i=i: results.__setitem__(i, err))
        if one_batch_each:
            assert producer.flush(30) == 0
    assert producer.flush(30) == 0
    return [results[i] for i in range(len(records))]


# ---------------------------------------------------------------------------- transform


@pytest.mark.parametrize("codec", ["none", "gzip", "snappy", "lz4", "zstd"])
def test_records_are_transformed_before_the_broker_stores_them(
        proxy: ProxyProcess, kafka: KafkaCluster, codec: str) -> None:
    topic = _create_topic(proxy.bootstrap, "masked")
    records: list[tuple[bytes | None, bytes | None]] = [
        (b"k0", b"card 4111 1111 1111 1111 paid"),
        (None, b"no card here"),
        (b"k2", None),
        (b"k3", b"two: 5500-0000-0000-0004 and 4012 8888 8888 1881"),
    ]
    assert _produce(proxy.bootstrap, topic, records, **{"compression.type": codec}) == [None] * 4

    expected = [b"card ****-****-****-1111 paid", b"no card here", None,
                b"two: ****-****-****-0004 and ****-****-****-1881"]
    # What the broker stored (read from it directly), and what a client of the proxy reads.
    for bootstrap in (kafka.bootstrap, proxy.bootstrap):
        got = consume(bootstrap, topic, 4)
        assert [m.value() for m in got] == expected
        assert [m.key() for m in got] == [k for k, _ in records]
        assert [m.headers() for m in got] == [[("i", str(i).encode())] for i in range(4)]


# ---------------------------------------------------------------------------- reject


def test_rejected_batch_reaches_the_producer_and_is_not_stored(
        proxy: ProxyProcess, kafka: KafkaCluster) -> None:
    topic = _create_topic(proxy.bootstrap, "json")
    records: list[tuple[bytes | None, bytes | None]] = [
        (b"a", b'{"id": 1}'), (b"b", b"not json"), (b"c", b'{"no_id": true}'), (b"d", b'{"id": 4}'),
    ]
    errors = _produce(proxy.bootstrap, topic, records, one_batch_each=True, retries=0)
    assert errors[0] is None and errors[3] is None
    assert [e.code() for e in errors[1:3]] == [POLICY_VIOLATION, POLICY_VIOLATION]

    stored = consume(kafka.bootstrap, topic, 2)
    assert [m.value() for m in stored] == [b'{"id": 1}', b'{"id": 4}']
    assert [m.offset() for m in stored] == [0, 1]
    assert high_watermark(kafka.bootstrap, topic) == 2  # and nothing else is stored


# ---------------------------------------------------------------------------- producers


def test_idempotent_producer_keeps_order_and_sequence(proxy: ProxyProcess,
                                                      kafka: KafkaCluster) -> None:
    from confluent_kafka import Producer

    topic = _create_topic(proxy.bootstrap, "masked", partitions=3)
    errors: list[Any] = []
    producer = Producer({"bootstrap.servers": proxy.bootstrap, "enable.idempotence": True,
                         "acks": "all", "max.in.flight.requests.per.connection": 5,
                         "linger.ms": 2, "batch.num.messages": 25, "compression.type": "zstd"})
    count = 600
    for i in range(count):
        producer.produce(topic, key=f"key-{i % 7}".encode(),
                         value=f"#{i} card 4111 1111 1111 {i:04d}".encode(),
                         on_delivery=lambda err, _msg: errors.append(err) if err else None)
        producer.poll(0)
    assert producer.flush(60) == 0
    assert errors == []

    stored = consume(kafka.bootstrap, topic, count, partitions=3, timeout=60)
    assert len(stored) == count
    by_key: dict[bytes, list[int]] = defaultdict(list)
    for m in sorted(stored, key=lambda m: (m.partition(), m.offset())):
        number = int(m.value().split()[0][1:])
        assert m.value() == f"#{number} card ****-****-****-{number:04d}".encode()
        by_key[m.key()].append(number)
    assert sorted(n for ns in by_key.values() for n in ns) == list(range(count))  # no duplicates
    for key, numbers in by_key.items():
        assert numbers == sorted(numbers), f"{key!r} out of order"


def test_transactional_producer_commits_and_aborts(proxy: ProxyProcess,
                                                   kafka: KafkaCluster) -> None:
    from confluent_kafka import Producer

    topic = _create_topic(proxy.bootstrap, "masked")
    producer = Producer({"bootstrap.servers": proxy.bootstrap,
                         "transactional.id": f"tx-{uuid.uuid4().hex[:8]}"})
    producer.init_transactions(30)
    producer.begin_transaction()
    for i in range(5):
        producer.produce(topic, value=f"committed #{i}: 4111 1111 1111 1111".encode(), partition=0)
    producer.commit_transaction(30)
    producer.begin_transaction()
    for i in range(3):
        producer.produce(topic, value=f"aborted {i}".encode(), partition=0)
    producer.flush(30)
    producer.abort_transaction(30)
    producer.begin_transaction()
    producer.produce(topic, value=b"last 4111 1111 1111 1111", partition=0)
    producer.commit_transaction(30)

    # librdkafka consumers read committed records only (isolation.level=read_committed).
    stored = consume(kafka.bootstrap, topic, 6, timeout=30)
    assert [m.value() for m in stored] == [
        *(f"committed #{i}: ****-****-****-1111".encode() for i in range(5)),
        b"last ****-****-****-1111",
    ]


# ---------------------------------------------------------------------------- consumers


@pytest.mark.parametrize("group_protocol", ["classic", "consumer"])
def test_consumer_group_commits_and_resumes(proxy: ProxyProcess, group_protocol: str) -> None:
    from confluent_kafka import Consumer, TopicPartition

    topic = _create_topic(proxy.bootstrap, "plain")
    assert _produce(proxy.bootstrap, topic, [(None, f"m{i}".encode()) for i in range(10)]) \
        == [None] * 10

    conf = group_consumer_conf(proxy.bootstrap, f"grp-{uuid.uuid4().hex[:8]}", group_protocol)

    first = Consumer(conf)
    try:
        first.subscribe([topic])
        got = poll_messages(first, 4)
        assert [m.value() for m in got] == [f"m{i}".encode() for i in range(4)]
        first.commit(message=got[-1], asynchronous=False)
        assert first.committed([TopicPartition(topic, 0)], timeout=10)[0].offset == 4
    finally:
        first.close()

    second = Consumer(conf)
    try:
        second.subscribe([topic])
        rest = poll_messages(second, 6)
        assert [m.value() for m in rest] == [f"m{i}".encode() for i in range(4, 10)]
        second.commit(asynchronous=False)
        assert second.committed([TopicPartition(topic, 0)], timeout=10)[0].offset == 10
    finally:
        second.close()


# ---------------------------------------------------------------------------- addresses


def test_metadata_names_only_the_proxy(proxy: ProxyProcess, kafka: KafkaCluster) -> None:
    from confluent_kafka.admin import AdminClient

    metadata = AdminClient({"bootstrap.servers": proxy.bootstrap}).list_topics(timeout=20)
    assert set(metadata.brokers) == set(kafka.node_ids)
    proxy_host, proxy_port = proxy.bootstrap.rsplit(":", 1)
    kafka_port = int(kafka.bootstrap.rsplit(":", 1)[1])
    for broker in metadata.brokers.values():
        assert broker.host == proxy_host
        assert broker.port not in (kafka_port, int(proxy_port))
        assert f"gets listener port {broker.port}" in proxy.log
