"""The Apache Kafka launcher (dev/kiproxy_dev/kafka_cluster.py): real KRaft clusters
of JVMs on loopback.

The bad-input tests need neither Kafka's jars nor Java: they stop before any JVM
starts. The others skip, saying how to get Kafka, when `make kafka` has not run.
"""

from __future__ import annotations

import os
import socket
import stat
import time
import uuid
from pathlib import Path

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]
from support.apache_kafka import PINNED_VERSION, kafka_home_or_skip

from kiproxy_dev.kafka_cluster import (
    KafkaCluster,
    KafkaClusterError,
    find_kafka_home,
    probe_metadata,
)

# --- bad input: refused before any JVM starts ------------------------------------------


def fake_kafka_home(tmp_path: Path) -> Path:
    """A folder that looks like a Kafka distribution (an empty core jar): enough for the checks."""
    (tmp_path / "libs").mkdir()
    (tmp_path / "libs" / f"kafka_2.13-{PINNED_VERSION}.jar").write_bytes(b"")
    return tmp_path


def fake_java(tmp_path: Path, version: str) -> str:
    """An executable that answers ``-version`` as a JDK of ``version`` would."""
    script = tmp_path / f"java-{version}"
    script.write_text(f"#!/bin/sh\necho 'openjdk version \"{version}\" 2024-01-16' >&2\n")
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    return str(script)


def test_a_folder_without_kafka_jars_is_refused(tmp_path: Path) -> None:
    with pytest.raises(KafkaClusterError, match=r"no libs/kafka_2\.13-\*\.jar.*make kafka"):
        KafkaCluster(tmp_path)


def test_java_older_than_17_is_refused(tmp_path: Path) -> None:
    home = fake_kafka_home(tmp_path)
    with pytest.raises(KafkaClusterError, match=r"Java 11, too old.*need Java 17"):
        KafkaCluster(home, java=fake_java(tmp_path, "11.0.22"))
    with pytest.raises(KafkaClusterError, match=r"Java 8, too old"):
        KafkaCluster(home, java=fake_java(tmp_path, "1.8.0_392"))


def test_missing_java_is_refused(tmp_path: Path) -> None:
    with pytest.raises(KafkaClusterError, match=r"no Java found.*JAVA_HOME"):
        KafkaCluster(fake_kafka_home(tmp_path), java=str(tmp_path / "no-such-java"))


def _free_port() -> int:
    # A port free now (port + 1 of the taken one may belong to someone else).
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_a_taken_port_is_refused(tmp_path: Path) -> None:
    home, java = fake_kafka_home(tmp_path), fake_java(tmp_path, "17.0.15")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(KafkaClusterError, match=rf"port 127\.0\.0\.1:{port} for broker 2 is"):
            KafkaCluster(
                home, nodes=2, broker_ports=[_free_port(), port], java=java
            )
        with pytest.raises(
            KafkaClusterError, match=rf"port 127\.0\.0\.1:{port} for the controller"
        ):
            KafkaCluster(home, controller_port=port, java=java)


def test_find_kafka_home_prefers_the_environment_then_a_complete_cache_folder(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KIPROXY_KAFKA_HOME", raising=False)
    monkeypatch.setenv("KIPROXY_KAFKA_CACHE", str(tmp_path))
    assert find_kafka_home() is None
    partial = tmp_path / "kafka_2.13-4.9.0"  # no stamp: an interrupted `make kafka`
    (partial / "libs").mkdir(parents=True)
    (partial / "libs" / "kafka_2.13-4.9.0.jar").write_bytes(b"")
    assert find_kafka_home() is None
    for v in ("4.1.1", "4.10.0"):
        home = tmp_path / f"kafka_2.13-{v}"
        (home / "libs").mkdir(parents=True)
        (home / "libs" / f"kafka_2.13-{v}.jar").write_bytes(b"")
        (home / ".kiproxy-complete").write_text(f"{v}\nhash\n")
    assert find_kafka_home() == tmp_path / "kafka_2.13-4.10.0"
    assert find_kafka_home("4.1.1") == tmp_path / "kafka_2.13-4.1.1"
    monkeypatch.setenv("KIPROXY_KAFKA_HOME", "/opt/kafka")
    assert find_kafka_home("4.1.1") == Path("/opt/kafka")


# --- real clusters ----------------------------------------------------------------------


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@pytest.fixture(scope="module")
def one_node(apache_kafka: KafkaCluster) -> KafkaCluster:
    """The session's shared 1-node cluster (tests/conftest.py)."""
    return apache_kafka


def test_one_node_cluster_serves_a_produce_and_consume_round_trip(one_node: KafkaCluster) -> None:
    topic = f"t-{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": one_node.bootstrap})
    admin.create_topics([NewTopic(topic, num_partitions=2, replication_factor=1)])[topic].result(30)

    producer = Producer({"bootstrap.servers": one_node.bootstrap, "acks": "all"})
    for i in range(5):
        producer.produce(topic, key=f"k{i}".encode(), value=f"v{i}".encode(), partition=i % 2)
    assert producer.flush(30) == 0

    consumer = Consumer(
        {
            "bootstrap.servers": one_node.bootstrap,
            "group.id": f"g-{topic}",
            "group.protocol": "consumer",  # KIP-848 groups work on this cluster
            "auto.offset.reset": "earliest",
        }
    )
    try:
        consumer.subscribe([topic])
        got: dict[bytes, bytes] = {}
        deadline = time.monotonic() + 60
        while len(got) < 5 and time.monotonic() < deadline:
            msg = consumer.poll(1.0)
            if msg is not None and msg.error() is None:
                got[msg.key() or b""] = msg.value() or b""
    finally:
        consumer.close()
    assert got == {f"k{i}".encode(): f"v{i}".encode() for i in range(5)}
    view = probe_metadata(one_node.port(1), [topic])
    assert view.brokers == {1: one_node.port(1)}
    assert view.leaders == {(topic, 0): 1, (topic, 1): 1}


def test_a_bad_setting_fails_formatting_with_kafkas_message_and_no_jvm_left() -> None:
    cluster = KafkaCluster(kafka_home_or_skip(), overrides={"num.io.threads": "0"})
    with pytest.raises(
        KafkaClusterError, match=r"(?s)formatting the storage of .* failed.*num.io.threads"
    ):
        cluster.start(timeout=120)
    assert cluster.nodes_alive() == []
    assert not cluster.workdir.exists()


def test_a_broker_that_exits_fails_start_with_its_log_and_no_jvm_left() -> None:
    cluster = KafkaCluster(kafka_home_or_skip())
    with socket.socket() as thief:  # the port is taken after the cluster chose it
        thief.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        thief.bind(("127.0.0.1", cluster.port(1)))
        thief.listen()
        with pytest.raises(
            KafkaClusterError, match=r"(?s)broker 1 exited with status \d+.*Address already in use"
        ):
            cluster.start(timeout=120)
    assert cluster.nodes_alive() == []


def test_a_node_not_ready_in_time_fails_start_with_its_log_and_no_jvm_left() -> None:
    cluster = KafkaCluster(kafka_home_or_skip())
    with pytest.raises(
        KafkaClusterError, match=r"(?s)broker 1 not ready after 0.5s.*the end of broker 1's log"
    ):
        cluster.start(timeout=0.5)
    assert cluster.nodes_alive() == []


def test_three_nodes_survive_killing_the_partition_leader_and_restarting_it() -> None:
    home = kafka_home_or_skip()
    started = time.monotonic()
    with KafkaCluster(home, nodes=3) as cluster:
        print(f"3-node cluster ready in {time.monotonic() - started:.1f}s")
        topic = f"t-{uuid.uuid4().hex[:8]}"
        admin = AdminClient({"bootstrap.servers": cluster.bootstrap})
        admin.create_topics([NewTopic(topic, 1, 3)])[topic].result(30)
        producer = Producer(
            {
                "bootstrap.servers": cluster.bootstrap,
                "acks": "all",
                "enable.idempotence": True,
            }
        )
        for i in range(10):
            producer.produce(topic, value=f"v{i}".encode())
        assert producer.flush(30) == 0

        leader = cluster.partition_leader(topic)
        pid = cluster.pid(leader)
        cluster.kill_node(leader)
        assert not _pid_alive(pid)
        assert leader not in cluster.nodes_alive()
        for i in range(10, 20):  # acks=all with min.insync.replicas=2: two of three suffice
            producer.produce(topic, value=f"v{i}".encode())
        assert producer.flush(60) == 0
        assert cluster.partition_leader(topic) != leader

        cluster.restart_node(leader)
        assert set(probe_metadata(cluster.port(leader)).brokers) == {1, 2, 3}

        consumer = Consumer(
            {
                "bootstrap.servers": cluster.bootstrap,
                "group.id": f"g-{topic}",
                "auto.offset.reset": "earliest",
            }
        )
        try:
            consumer.subscribe([topic])
            values: list[bytes] = []
            deadline = time.monotonic() + 60
            while len(values) < 20 and time.monotonic() < deadline:
                msg = consumer.poll(1.0)
                if msg is not None and msg.error() is None:
                    values.append(msg.value() or b"")
        finally:
            consumer.close()
        assert values == [f"v{i}".encode() for i in range(20)]
        pids = [cluster.pid(n) for n in cluster.nodes_alive()]
    assert not any(_pid_alive(p) for p in pids)


def test_a_broker_added_to_a_running_cluster_joins_it() -> None:
    with KafkaCluster(kafka_home_or_skip(), nodes=1) as cluster:
        new = cluster.add_broker()
        assert new == 2
        assert set(probe_metadata(cluster.port(1)).brokers) == {1, 2}
        assert cluster.bootstrap.endswith(f",127.0.0.1:{cluster.port(2)}")
