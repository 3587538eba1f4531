"""kiproxy in front of a three-node Apache Kafka cluster: one proxy port per node,
leader failover, a preferred-leader election and a node that joins later.

The cluster (brokers 1-3 and a dedicated controller, tests/conftest.py's launcher)
is started once for the module; the tests run in file order and the last one adds
broker 4. The proxy serves node N on ``--broker-port-start`` + N; its ports for
nodes 1-4 are chosen free up front.

"No client ever connects to a broker port" is checked two ways: every TCP
connection of this test process is sampled (psutil, as the clients start, every
50 ms and as they finish), and librdkafka's own statistics list the brokers each
client connected to. The launcher's readiness probe (``restart_node``) connects to
a broker itself, so sampling pauses while it runs; a client connection to a broker
would outlive it and be seen. That a client *did* use a proxy port is never read
from samples (a produce to a fresh node can start and finish between two): it is
the client's statistics counting requests sent to that port, and the records
arriving, transformed, on the broker behind it.

Leaks: after the clients close, the proxy's ``kiproxy_active_connections`` gauge
(``--metrics-listen``) returns to 0, and its open file descriptors and threads to
what they were before the stream (a few descriptors of slack for the upstream
connections the proxy keeps for node discovery); its resident memory grows by
less than 64 MiB over the stream (over 100,000 records on an idle machine).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import re
import socket
import struct
import threading
import time
import urllib.request
import uuid
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import ProxyProcess, launch_proxy
from support.apache_kafka import kafka_home_or_skip

from kiproxy_dev.kafka_cluster import KafkaCluster
from kiproxy_dev.tansu import free_port

pytestmark = pytest.mark.timeout(300)

NODES = (1, 2, 3)
PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
JOINER = 4
PARTITIONS = 3
RSS_BOUND = 64 << 20
FD_SLACK = 4
THREAD_SLACK = 8
"""Threads the proxy's fixed-size pools may add on demand (2 decode + 6 resolver)."""


@pytest.fixture(scope="module")
def cluster() -> Iterator[KafkaCluster]:
    with KafkaCluster(kafka_home_or_skip(), nodes=len(NODES)) as c:
        yield c


@pytest.fixture(scope="module")
def proxy(cluster: KafkaCluster) -> Iterator[ProxyProcess]:
    metrics = free_port()
    p = launch_proxy(cluster.bootstrap, "--metrics-listen", f"127.0.0.1:{metrics}",
                     interceptor="kiproxy.interceptors.builtin.uppercase:Uppercase",
                     node_ids=(*NODES, JOINER))
    p.lines.append(f"metrics port {metrics}")
    yield p
    assert p.alive(), f"the proxy died during the module:\n{p.log}"
    p.stop()


# ---------------------------------------------------------------------------- helpers


def _metrics_port(proxy: ProxyProcess) -> int:
    return int(next(ln for ln in proxy.lines if ln.startswith("metrics port")).split()[-1])


def _active_connections(proxy: ProxyProcess) -> float:
    url = f"http://127.0.0.1:{_metrics_port(proxy)}/metrics"
    with urllib.request.urlopen(url, timeout=10) as answer:
        text = answer.read().decode()
    match = re.search(r"^kiproxy_active_connections (\S+)$", text, re.MULTILINE)
    assert match, text
    return float(match.group(1))


def _node_port(proxy: ProxyProcess, node: int) -> int:
    return proxy.broker_port_start + node


def _broker_ports(cluster: KafkaCluster) -> set[int]:
    return {cluster.port(n) for n in [0, *cluster.broker_ids]}


class ConnectionSampler:
    """This process's TCP connections, sampled on entry, every 50 ms and on exit;
    ``pause()`` around probes.

    It can only miss a connection that opens and closes between two samples, so it
    serves "no connection to X" checks; that a connection was made is asserted from
    the client's own statistics instead.
    """

    def __init__(self) -> None:
        self.remote_ports: set[int] = set()
        self._me = psutil.Process()
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> ConnectionSampler:
        self._sample()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(10)
        self._sample()

    def pause(self) -> threading.Lock:
        return self._lock

    def _sample(self) -> None:
        with self._lock:
            for c in self._me.net_connections(kind="tcp"):
                if c.raddr:
                    self.remote_ports.add(c.raddr.port)

    def _run(self) -> None:
        while not self._stop.wait(0.05):
            self._sample()


def _stats_brokers(stats: list[str]) -> set[str]:
    """``host:port`` of every broker librdkafka's statistics name (bootstrap included;
    not its logical coordinator handles, which have no address of their own)."""
    return {broker["nodename"] for line in stats
            for broker in json.loads(line)["brokers"].values() if broker["nodename"]}


def _stats_node(stats: list[str], node: int) -> str:
    """``host:port`` librdkafka's latest statistics give for broker ``node``."""
    brokers = json.loads(stats[-1])["brokers"].values()
    return str(next(b["nodename"] for b in brokers if b["nodeid"] == node))


def _produce_requests(stats: list[str], node: int) -> int:
    """Produce requests the client sent to broker ``node``, by its latest statistics."""
    if not stats:
        return 0
    brokers = json.loads(stats[-1])["brokers"].values()
    return sum(int(b["req"]["Produce"]) for b in brokers if b["nodeid"] == node)


def _read_back(bootstrap: str, topic: str, count: int) -> list[bytes | None]:
    """The first ``count`` values of partition 0 of ``topic``, read through ``bootstrap``."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"v-{topic}",
                         "enable.auto.commit": False})
    values: list[bytes | None] = []
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        deadline = time.monotonic() + 60
        while len(values) < count and time.monotonic() < deadline:
            values += [m.value() for m in consumer.consume(count, 0.5) if m.error() is None]
    finally:
        consumer.close()
    return values


def _leaders(admin: Any, topic: str) -> dict[int, int]:
    """partition -> leader node id, through whatever bootstrap ``admin`` uses."""
    metadata = admin.list_topics(topic, timeout=10)
    return {p: m.leader for p, m in metadata.topics[topic].partitions.items()}


def _replicas(admin: Any, topic: str) -> dict[int, list[int]]:
    metadata = admin.list_topics(topic, timeout=10)
    return {p: list(m.replicas) for p, m in metadata.topics[topic].partitions.items()}


def _listening(port: int) -> bool:
    try:
        socket.create_connection(("127.0.0.1", port), 2).close()
    except OSError:
        return False
    return True


def _wait(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"{what} not within {timeout:g} s"
        time.sleep(0.2)


# ---------------------------------------------------------------------------- fetch side


@pytest.mark.parametrize("hook", ["reverse", "record_encryption"])
def test_fetch_side_hooks_serve_partitions_led_by_every_node(
        cluster: KafkaCluster, tmp_path_factory: pytest.TempPathFactory, hook: str) -> None:
    """Six partitions over three leaders, through a proxy whose route transforms values
    on produce and undoes it on consume - ``tp_fetch:Reverse`` (values reversed), and the
    ``record_encryption`` built-in with a key file: a consumer through the proxy reads
    exactly what was produced, from every node's proxy port; straight from the brokers
    the values are reversed, or sealed (no plaintext, the marker header last)."""
    from confluent_kafka import Consumer, Producer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic

    from kiproxy.interceptors.builtin.record_encryption import MARKER_HEADER
    from kiproxy.interceptors.builtin.record_encryption.key_file import write_key_file

    here = tmp_path_factory.mktemp("fetch-multinode")
    link: dict[str, Any] = {"class": "tp_fetch:Reverse"}
    if hook == "record_encryption":
        write_key_file(here / "keys.yaml", {"KEK": (1, {1: os.urandom(32)})})
        link = {"class": "record_encryption",
                "config": {"kms": {"type": "key_file", "path": str(here / "keys.yaml")},
                           "key": "KEK"}}
    config = here / "routes.json"
    config.write_text(json.dumps({"routes": [
        {"match": {"topic": "hooked-.*"}, "interceptors": [link]}]}))
    proxy = launch_proxy(cluster.bootstrap, plugins_dir=PLUGINS, config_file=config,
                         node_ids=(*NODES, JOINER))
    try:
        topic = f"hooked-{uuid.uuid4().hex[:8]}"
        admin = AdminClient({"bootstrap.servers": cluster.bootstrap})
        admin.create_topics([NewTopic(topic, num_partitions=6, replication_factor=3)],
                            operation_timeout=20)[topic].result(timeout=30)
        _wait(lambda: len(set(_leaders(admin, topic).values())) == 3, 30, "three leaders")
        producer = Producer({"bootstrap.servers": proxy.bootstrap, "enable.idempotence": True,
                             "compression.type": "lz4", "linger.ms": 20})
        values = {p: [f"p{p} value {i}".encode() for i in range(40)] for p in range(6)}
        for p, vals in values.items():
            for v in vals:
                producer.produce(topic, value=v, partition=p)
        assert producer.flush(30) == 0

        def read(bootstrap: str) -> dict[int, list[Any]]:
            consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"r-{topic}",
                                 "enable.auto.commit": False})
            got: dict[int, list[Any]] = defaultdict(list)
            try:
                consumer.assign([TopicPartition(topic, p, 0) for p in range(6)])
                deadline = time.monotonic() + 60
                while sum(map(len, got.values())) < 240 and time.monotonic() < deadline:
                    for m in consumer.consume(100, 0.5):
                        if m.error() is None:
                            got[m.partition()].append(m)
            finally:
                consumer.close()
            return dict(got)

        assert {p: [m.value() for m in ms] for p, ms in read(proxy.bootstrap).items()} == values
        stored = read(cluster.bootstrap)
        if hook == "reverse":
            assert {p: [m.value() for m in ms] for p, ms in stored.items()} == {
                p: [v[::-1] for v in vals] for p, vals in values.items()}
        else:
            assert sum(map(len, stored.values())) == 240
            assert not any(m.value() in values[p] for p, ms in stored.items() for m in ms)
            assert all((m.headers() or [])[-1][0] == MARKER_HEADER
                       for ms in stored.values() for m in ms)
        assert proxy.alive()
    finally:
        proxy.stop()


# ---------------------------------------------------------------------------- addresses


def test_metadata_find_coordinator_and_describe_cluster_name_one_proxy_port_per_node(
        cluster: KafkaCluster, proxy: ProxyProcess) -> None:
    from confluent_kafka import Consumer, Producer, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    expected = {n: _node_port(proxy, n) for n in NODES}
    stats: list[str] = []
    with ConnectionSampler() as sampler:
        admin = AdminClient({"bootstrap.servers": proxy.bootstrap})
        topic = f"multi-{uuid.uuid4().hex[:8]}"
        admin.create_topics([NewTopic(topic, PARTITIONS, 3)])[topic].result(30)

        metadata = admin.list_topics(timeout=20)
        assert {n: (b.host, b.port) for n, b in metadata.brokers.items()} == {
            n: ("127.0.0.1", p) for n, p in expected.items()}

        described = admin.describe_cluster().result(20)
        assert {n.id: (n.host, n.port) for n in described.nodes} == {
            n: ("127.0.0.1", p) for n, p in expected.items()}
        assert described.controller.port in expected.values()

        # FindCoordinator, for a group and for a transaction.
        group = f"g-{topic}"
        producer = Producer({"bootstrap.servers": proxy.bootstrap,
                             "transactional.id": f"tx-{topic}",
                             "statistics.interval.ms": 200, "stats_cb": stats.append})
        producer.init_transactions(30)
        producer.begin_transaction()
        producer.produce(topic, value=b"in a transaction", partition=0)
        producer.commit_transaction(30)
        consumer = Consumer({"bootstrap.servers": proxy.bootstrap, "group.id": group,
                             "auto.offset.reset": "earliest", "enable.auto.commit": False,
                             "statistics.interval.ms": 200, "stats_cb": stats.append})
        try:
            consumer.assign([TopicPartition(topic, 0, 0)])
            msg = None
            deadline = time.monotonic() + 30
            while msg is None and time.monotonic() < deadline:
                msg = consumer.poll(0.5)
            assert msg is not None and msg.value() == b"IN A TRANSACTION"
            consumer.commit(message=msg, asynchronous=False)
            producer.poll(0.5)
            consumer.poll(0.5)
        finally:
            consumer.close()
        description = admin.describe_consumer_groups([group])[group].result(20)
        assert (description.coordinator.host, description.coordinator.port) in {
            ("127.0.0.1", p) for p in expected.values()}

    assert not sampler.remote_ports & _broker_ports(cluster), (
        sampler.remote_ports, _broker_ports(cluster))
    proxy_ports = {f"127.0.0.1:{p}" for p in proxy.ports}
    assert stats and _stats_brokers(stats) <= proxy_ports, _stats_brokers(stats)


# ---------------------------------------------------------------------------- failover


class Stream:
    """An idempotent, acks=all confluent-kafka producer streaming ``rec-<p>-<n>`` values to
    every partition (in order per partition) from a thread until told to stop."""

    def __init__(self, bootstrap: str, topic: str) -> None:
        from confluent_kafka import Producer

        self.topic = topic
        self.errors: list[Any] = []
        self.global_errors: list[Any] = []
        self.acked: dict[int, list[bytes]] = defaultdict(list)
        self.sent = 0
        self.stats: list[str] = []
        self._stop = threading.Event()
        self._producer = Producer({
            "bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
            "linger.ms": 5, "message.timeout.ms": 120_000, "compression.type": "zstd",
            "reconnect.backoff.max.ms": 500, "retry.backoff.max.ms": 500,
            "statistics.interval.ms": 1000, "stats_cb": self.stats.append,
            "error_cb": self.global_errors.append, "log_level": 3})
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _delivered(self, err: Any, msg: Any) -> None:
        if err is not None:
            self.errors.append(err)
        else:
            self.acked[msg.partition()].append(msg.value())

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            for p in range(PARTITIONS):
                self._producer.produce(self.topic, value=b"rec-%d-%06d" % (p, n), partition=p,
                                       on_delivery=self._delivered)
            n += 1
            self.sent = n * PARTITIONS
            if n % 100 == 0:
                self._producer.poll(0)
                time.sleep(0.02)  # ~15,000 records/s at most: the stream spans every phase
        self._producer.flush(120)
        self._producer.close()

    def start(self) -> Stream:
        self._thread.start()
        return self

    def wait_acked(self, more: int, timeout: float = 60) -> None:
        """Until ``more`` records beyond those acknowledged now are acknowledged."""
        target = sum(len(v) for v in self.acked.values()) + more
        _wait(lambda: sum(len(v) for v in self.acked.values()) >= target, timeout,
              f"{more} more acknowledgements")

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(150)
        assert not self._thread.is_alive(), "the producer did not finish flushing"


def _dead_listener_answers_nothing(port: int) -> None:
    """A client of the proxy's port for a dead node sees the connection fail or close
    unanswered, as it would with the dead broker itself."""
    api_versions_v0 = struct.pack(">hhih", 18, 0, 1, 4) + b"test"
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
            s.sendall(struct.pack(">i", len(api_versions_v0)) + api_versions_v0)
            assert s.recv(4) == b"", "the proxy answered for a dead node"
    except (ConnectionRefusedError, ConnectionResetError):
        pass


def test_idempotent_stream_survives_leader_kill_restart_and_preferred_election(
        cluster: KafkaCluster, proxy: ProxyProcess) -> None:
    from confluent_kafka import ElectionType, KafkaException, TopicPartition
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": proxy.bootstrap})
    topic = f"failover-{uuid.uuid4().hex[:8]}"
    admin.create_topics([NewTopic(topic, PARTITIONS, 3)])[topic].result(30)
    _wait(lambda: all(leader in NODES for leader in _leaders(admin, topic).values()), 30,
          "leaders for every partition")
    me = psutil.Process(proxy.process.pid)

    with ConnectionSampler() as sampler:
        stream = Stream(proxy.bootstrap, topic).start()
        stream.wait_acked(3000)
        fds, threads, rss = me.num_fds(), me.num_threads(), me.memory_info().rss

        # SIGKILL the leader of partition 0; the others take over.
        victim = _leaders(admin, topic)[0]
        cluster.kill_node(victim)
        _wait(lambda: victim not in _leaders(admin, topic).values(), 60,
              f"leaderships moving off killed broker {victim}")
        stream.wait_acked(3000)
        _dead_listener_answers_nothing(_node_port(proxy, victim))

        with sampler.pause():  # the launcher's readiness probe connects to the broker
            cluster.restart_node(victim)
        stream.wait_acked(3000)

        # The restarted broker is the preferred leader again once it is back in sync.
        preferred = {p: r[0] for p, r in _replicas(admin, topic).items()}
        partitions = [TopicPartition(topic, p) for p in range(PARTITIONS)]

        def elected() -> bool:
            # Refused (PREFERRED_LEADER_NOT_AVAILABLE) until the broker is in sync again.
            with contextlib.suppress(KafkaException):
                admin.elect_leaders(ElectionType.PREFERRED, partitions).result(20)
            return _leaders(admin, topic) == preferred

        _wait(elected, 90, "a preferred-leader election")
        stream.wait_acked(3000)
        stream.stop()

    acked = {p: len(v) for p, v in stream.acked.items()}
    print(f"\nfailover stream: {sum(acked.values())} records acknowledged {acked}, "
          f"broker {victim} killed and restarted, leaders elected back to {preferred}")
    assert stream.errors == [], stream.errors[:5]
    assert not [e for e in stream.global_errors if e.fatal()], stream.global_errors
    assert not sampler.remote_ports & _broker_ports(cluster)
    assert _stats_brokers(stream.stats) <= {f"127.0.0.1:{p}" for p in proxy.ports}

    # The broker's own view (read straight from the cluster): exactly once, in order.
    from confluent_kafka import Consumer

    consumer = Consumer({"bootstrap.servers": cluster.bootstrap, "group.id": f"v-{topic}",
                         "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    stored: dict[int, list[bytes]] = defaultdict(list)
    total = sum(len(v) for v in stream.acked.values())
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
        deadline = time.monotonic() + 90
        while sum(len(v) for v in stored.values()) < total and time.monotonic() < deadline:
            for m in consumer.consume(10_000, 0.5):
                if m.error() is None:
                    stored[m.partition()].append(m.value())
    finally:
        consumer.close()
    for p in range(PARTITIONS):
        sent = [b"rec-%d-%06d" % (p, n) for n in range(len(stream.acked[p]))]
        assert sorted(stream.acked[p]) == sent, f"partition {p}: acknowledged values"
        assert stored[p] == [v.upper() for v in sent], f"partition {p}: stored values"

    # Nothing leaks in the proxy once the clients have gone.
    admin = None  # the last reference: an AdminClient closes its connections when collected
    gc.collect()
    _wait(lambda: _active_connections(proxy) == 0, 30, "no client connection left")
    assert me.num_fds() <= fds + FD_SLACK, (me.num_fds(), fds)
    # Fixed-size pools (decode threads, asyncio's resolver executor used on reconnects)
    # start their threads on demand; anything beyond their sizes would be a leak.
    assert me.num_threads() <= threads + THREAD_SLACK, (me.num_threads(), threads)
    assert me.memory_info().rss - rss < RSS_BOUND, (me.memory_info().rss, rss)
    assert "Traceback" not in proxy.log


# ---------------------------------------------------------------------------- a joining node


def test_a_broker_added_after_the_proxy_started_gets_a_listener_and_is_used(
        cluster: KafkaCluster, proxy: ProxyProcess) -> None:
    from confluent_kafka import Producer
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    assert cluster.add_broker() == JOINER
    admin = AdminClient({"bootstrap.servers": proxy.bootstrap})
    _wait(lambda: JOINER in admin.list_topics(timeout=10).brokers, 30,
          f"broker {JOINER} in metadata through the proxy")
    port = _node_port(proxy, JOINER)
    assert admin.list_topics(timeout=10).brokers[JOINER].port == port
    assert re.search(rf"node {JOINER} \(127\.0\.0\.1:\d+\) gets listener port {port}",
                     proxy.log), proxy.log

    topic = f"joined-{uuid.uuid4().hex[:8]}"
    admin.create_topics([NewTopic(topic, 1, replica_assignment=[[JOINER]])])[topic].result(30)
    _wait(lambda: _leaders(admin, topic) == {0: JOINER}, 30, f"broker {JOINER} leading")
    errors: list[Any] = []
    stats: list[str] = []
    sent = [b"to the new node %d" % i for i in range(10)]
    with ConnectionSampler() as sampler:
        producer = Producer({"bootstrap.servers": proxy.bootstrap, "acks": "all",
                             "statistics.interval.ms": 100, "stats_cb": stats.append})
        for value in sent:
            producer.produce(topic, value=value, partition=0,
                             on_delivery=lambda err, msg: errors.append(err))
        unsent = producer.flush(30)
        assert unsent == 0, (f"{unsent} records not delivered; something listens on port "
                             f"{port}: {_listening(port)}; the proxy's log:\n{proxy.log}")

        # Broker JOINER alone holds the partition, so acks=all succeeded only if the
        # Produce reached it; the client's statistics say on which address.
        def counted() -> bool:
            producer.poll(0.1)  # serves the statistics callback
            return _produce_requests(stats, JOINER) > 0

        _wait(counted, 30, f"the producer's statistics counting a Produce to node {JOINER}")
    assert errors == [None] * len(sent)
    assert _stats_node(stats, JOINER) == f"127.0.0.1:{port}"
    assert _stats_brokers(stats) <= {f"127.0.0.1:{p}" for p in proxy.ports}, stats[-1]
    assert cluster.port(JOINER) not in sampler.remote_ports

    # Read straight from broker JOINER: the records passed the proxy's interceptor.
    assert _read_back(cluster.bootstrap, topic, len(sent)) == [v.upper() for v in sent]
