"""Faults between the proxy and the broker, and in the proxy itself: nothing acknowledged
is lost or written twice.

The set-up, all on loopback::

    producer --> kiproxy (restarted now and then) --> fault relay --> Tansu
                                                        ^ cuts every connection (RST)
                                                          at random moments

Tansu is started by the test and advertises the relay's port, so every
connection the proxy opens to it — bootstrap and the node connection it learns
from Metadata — passes the relay. The relay forwards bytes, holds the broker's
answers for 50 ms (a network round trip: without it the broker answers so fast
that a cut almost never falls between "request carried out" and "answer
received"), and at random intervals (0.3-1.5 s, seeded) aborts every live
connection on both sides with a TCP RST (``SO_LINGER`` 0), mid-frame or not.
Meanwhile the proxy process is stopped every 2-4 s, with SIGKILL or SIGTERM at
random, and started again on the same listen port and ``--broker-port-start``,
so that clients reconnect to it.

An idempotent confluent-kafka producer (``enable.idempotence``, ``acks=all``,
250 records a batch at most) sends a bounded stream of small records with unique
values to a topic of 3 partitions: 50,000 by default, to keep ``make test``
short; ``KIPROXY_FAULT_RECORDS=200000`` runs the full-size stream (about 30 s
without the proxy and 70 s with it, restarts and all, on 2 idle cores). After the faults stop,
a consumer reads the topic back through the relay — the broker's own view, not
the proxy's — to the end of every partition, and every value the producer saw
acknowledged must be there exactly once.

The relay also counts the record batches that reached the broker by producer
id, epoch and base sequence: a batch that reached it more than once was re-sent
after a cut or a restart, and only the broker's idempotence kept it from being
stored twice. That count shows the faults did hit records in flight. Whether one
does is a matter of timing: a run through the proxy in which none did (seen once in
many runs) is run again on a new topic, up to three runs, each held to the same checks.

The same stream first runs through the same relay and faults without the proxy
(producer -> relay -> Tansu): the baseline. A loss or duplicate that the baseline
shows too is the broker's (or the client's), not the proxy's; the test fails
only on what the proxy adds. Both runs' counts are printed (``-s``).

The same test runs against Apache Kafka (a 1-node cluster of its own whose
listener advertises the relay's port), with 20,000 records: Kafka's own
producer-state checks (sequence numbers per producer id and epoch; a duplicate
batch answered with the first one's offset, a gap refused with
OUT_OF_ORDER_SEQUENCE_NUMBER) are what keeps a re-sent batch from being stored
twice, and every acknowledged record must be stored exactly once.
"""

from __future__ import annotations

import json
import os
import random
import signal
import struct
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import ProxyProcess
from support.apache_kafka import kafka_home_or_skip

from hardening.fault_relay import FaultRelay, wait_until
from hardening.processes import TansuBroker, free_broker_port_start, launch_proxy_at
from hardening.raw_kafka import closed_by_peer, connect, local_address
from kiproxy.protocol.errors import ProtocolError
from kiproxy.protocol.framing import parse_request_header
from kiproxy.protocol.messages import ApiKey, parse_request
from kiproxy.protocol.records import read_batch_headers
from kiproxy_dev.kafka_cluster import KafkaCluster
from kiproxy_dev.tansu import free_port

RECORDS = max(50_000, int(os.environ.get("KIPROXY_FAULT_RECORDS", "50000")))
KAFKA_RECORDS = 20_000
PARTITIONS = 3
SEED = 20261122
CUT_EVERY = (0.3, 1.5)
RESTART_EVERY = (2.0, 4.0)
PROXIED_SECONDS = 18.0
"""The proxied stream lasts this long at least: three restarts or more, however fast it is."""
PROXIED_RUNS = 3
"""Runs through the proxy at most, until faults hit a batch in flight (see below)."""
RESPONSE_DELAY = 0.05
GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden"
PLUGINS = Path(__file__).resolve().parent / "plugins"

pytestmark = pytest.mark.timeout(420)


# ---------------------------------------------------------------------------- the stream


@dataclass
class StreamResult:
    """What the producer saw."""

    acked: list[bytes] = field(default_factory=list)
    """Values whose delivery was acknowledged, in report order."""
    failed: Counter[str] = field(default_factory=Counter)
    """Delivery failures by error."""
    failed_values: set[bytes] = field(default_factory=set)
    seconds: float = 0.0


def produce_stream(bootstrap: str, topic: str, count: int,
                   min_seconds: float = 0.0) -> StreamResult:
    """Send ``count`` records (values ``%09d``), paced so that the stream spans the
    faults: 200 records every 20 ms at most, and spread over ``min_seconds`` at least
    (so that a fast run still sees its proxy restarts)."""
    from confluent_kafka import Producer

    result = StreamResult()

    def on_delivery(err: Any, msg: Any) -> None:
        if err is None:
            result.acked.append(msg.value())
        else:
            result.failed[str(err)] += 1
            result.failed_values.add(msg.value())

    producer = Producer({
        "bootstrap.servers": bootstrap, "enable.idempotence": True, "acks": "all",
        "linger.ms": 5, "batch.num.messages": 250, "message.timeout.ms": 180_000,
        "reconnect.backoff.max.ms": 500, "retry.backoff.max.ms": 500,
        "client.id": "fault-stream", "log_level": 3,
    })
    started = time.monotonic()
    try:
        for i in range(count):
            value = b"%09d" % i
            while True:
                try:
                    producer.produce(topic, key=value, value=value, on_delivery=on_delivery)
                    break
                except BufferError:
                    producer.poll(0.05)
            if i % 200 == 0:
                producer.poll(0)
                time.sleep(max(0.02, started + min_seconds * i / count - time.monotonic()))
        left = producer.flush(240)
        result.seconds = time.monotonic() - started
    finally:
        producer.close()
    assert left == 0, f"{left} records neither delivered nor failed after 240 s"
    return result


def read_back(bootstrap: str, topic: str, expected: set[bytes], timeout: float = 90) -> Counter[
        bytes]:
    """Every value in ``topic``, counted: read until every partition reported its end
    and every ``expected`` value was seen."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"rb-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "auto.offset.reset": "earliest",
                         "enable.partition.eof": True, "log_level": 3})
    seen: Counter[bytes] = Counter()
    at_end: set[int] = set()
    try:
        consumer.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for msg in consumer.consume(10_000, 0.5):
                error, partition, value = msg.error(), msg.partition(), msg.value()
                if error is not None:
                    if error.code() == KafkaError._PARTITION_EOF and partition is not None:
                        at_end.add(partition)
                    continue
                if value is not None:
                    seen[value] += 1
                at_end.discard(partition if partition is not None else -1)
            if len(at_end) == PARTITIONS and expected.issubset(seen):
                break
    finally:
        consumer.close()
    return seen


@dataclass
class Tally:
    """Acknowledged values against what the broker holds."""

    acked: int
    lost: list[bytes]
    """Acknowledged, not in the topic."""
    duplicated: dict[bytes, int]
    """Acknowledged, in the topic more than once (value -> copies)."""
    stored: int
    """Records in the topic."""
    unacked_stored: int
    """Records whose delivery failed but that are in the topic (allowed)."""
    unknown: int
    """Values in the topic that were never produced."""

    @classmethod
    def of(cls, result: StreamResult, seen: Counter[bytes], count: int) -> Tally:
        acked = set(result.acked)
        produced = {b"%09d" % i for i in range(count)}
        return cls(
            acked=len(acked),
            lost=sorted(v for v in acked if v not in seen),
            duplicated={v: n for v, n in seen.items() if n > 1 and v in acked},
            stored=sum(seen.values()),
            unacked_stored=sum(1 for v in result.failed_values if v in seen),
            unknown=sum(1 for v in seen if v not in produced),
        )

    def line(self) -> str:
        """One line for the report."""
        dups = sorted(self.duplicated.items())[:5]
        return (f"acked {self.acked}, stored {self.stored}, lost {len(self.lost)} "
                f"{self.lost[:5]}, duplicated {len(self.duplicated)} {dups}, "
                f"unacked but stored {self.unacked_stored}, unknown {self.unknown}")


class ProduceTap:
    """Counts the record batches that reach the broker, by producer id, epoch and
    sequence: a batch seen more than once was sent again after a fault, and only
    the broker's idempotence keeps it from being stored twice."""

    def __init__(self) -> None:
        self.batches: Counter[tuple[str, int, int, int, int]] = Counter()
        self._lock = threading.Lock()

    def __call__(self, frame: bytes) -> None:
        try:
            header = parse_request_header(frame)
            if header.api_key != ApiKey.PRODUCE or header.body_offset is None:
                return
            request = parse_request(header.api_key, header.api_version, frame,
                                    header.body_offset)
            keys = [(str(topic.name), part.index, h.producer_id, h.producer_epoch,
                     h.base_sequence)
                    for topic in request.topic_data for part in topic.partition_data
                    for h in read_batch_headers(bytes(part.records or b""))]
        except ProtocolError:
            return
        with self._lock:
            self.batches.update(keys)

    def resent(self, topic: str) -> int:
        """Batches of ``topic`` that reached the broker more than once (extra copies)."""
        with self._lock:
            return sum(n - 1 for key, n in self.batches.items() if key[0] == topic)


# ---------------------------------------------------------------------------- the rig


@dataclass
class Rig:
    """A broker advertising the relay; the relay; kiproxy on fixed ports in front of it."""

    broker: TansuBroker | KafkaCluster
    relay: FaultRelay
    tap: ProduceTap
    listen_port: int
    broker_port_start: int
    lines: list[str]
    proxy: ProxyProcess | None = None

    def start_proxy(self, *flags: str) -> ProxyProcess:
        self.proxy = launch_proxy_at(self.relay.address, self.listen_port,
                                     self.broker_port_start, *flags, lines=self.lines)
        return self.proxy

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.listen_port}"


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    relay_port = free_port()
    broker = TansuBroker(advertised_port=relay_port, log_path=tmp_path / "tansu.log").start()
    tap = ProduceTap()
    relay = FaultRelay(broker.address, relay_port, seed=SEED, on_request=tap,
                       response_delay=RESPONSE_DELAY).start()
    rig = Rig(broker, relay, tap, free_port(), free_broker_port_start(), [])
    try:
        yield rig
    finally:
        if rig.proxy is not None:
            rig.proxy.stop()
        relay.close()
        broker.stop()


@pytest.fixture
def kafka_rig() -> Iterator[Rig]:
    """The rig with a 1-node Apache Kafka whose PLAINTEXT listener advertises the relay."""
    home = kafka_home_or_skip()
    relay_port = free_port()
    cluster = KafkaCluster(home, nodes=1, overrides={
        "advertised.listeners": f"PLAINTEXT://127.0.0.1:{relay_port}"})
    cluster.start()
    tap = ProduceTap()
    relay = FaultRelay(("127.0.0.1", cluster.port(1)), relay_port, seed=SEED, on_request=tap,
                       response_delay=RESPONSE_DELAY).start()
    rig = Rig(cluster, relay, tap, free_port(), free_broker_port_start(node_id=1), [])
    try:
        yield rig
    finally:
        if rig.proxy is not None:
            rig.proxy.stop()
        relay.close()
        cluster.stop()


def create_topics(bootstrap: str, *names: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    for future in admin.create_topics([NewTopic(n, PARTITIONS, 1) for n in names]).values():
        future.result(30)


class Restarter:
    """Stops the rig's proxy every 2-4 s (SIGKILL or SIGTERM) and starts it again."""

    def __init__(self, rig: Rig, *flags: str) -> None:
        self.rig = rig
        self.flags = flags
        self.random = random.Random(SEED + 1)
        self.restarts: list[tuple[str, int, float]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self.error: BaseException | None = None

    def __enter__(self) -> Restarter:
        self._thread.start()
        return self

    def _run(self) -> None:
        try:
            while not self._stop.wait(self.random.uniform(*RESTART_EVERY)):
                sig = self.random.choice((signal.SIGKILL, signal.SIGTERM))
                assert self.rig.proxy is not None
                down = time.monotonic()
                code = self.rig.proxy.stop(sig)
                self.rig.start_proxy(*self.flags)
                self.restarts.append((sig.name, code, round(time.monotonic() - down, 2)))
        except BaseException as exc:  # reported by the test
            self.error = exc

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(60)


# ---------------------------------------------------------------------------- the test


def test_idempotent_stream_survives_cut_connections_and_proxy_restarts(rig: Rig) -> None:
    stream_through_faults(rig, "Tansu", RECORDS)


def test_idempotent_stream_on_apache_kafka_survives_cut_connections_and_proxy_restarts(
        kafka_rig: Rig) -> None:
    stream_through_faults(kafka_rig, "Apache Kafka", KAFKA_RECORDS, exact=True)


def stream_through_faults(rig: Rig, broker: str, records: int, exact: bool = False) -> None:
    """The stream, without and then with the proxy (see the module docstring).

    ``exact``: the broker keeps idempotence exactly (Apache Kafka), so the baseline
    must be exact too, and so must the run through the proxy.
    """
    suffix = uuid.uuid4().hex[:8]
    direct = f"faults-direct-{suffix}"
    create_topics(rig.relay.address, direct)

    # Baseline: the same stream and faults, without the proxy.
    rig.relay.start_faults(*CUT_EVERY)
    baseline = produce_stream(rig.relay.address, direct, records)
    rig.relay.stop_faults()
    baseline_cuts = rig.relay.stats.cuts
    baseline_tally = Tally.of(baseline, read_back(rig.relay.address, direct,
                                                  set(baseline.acked)), records)

    # Through the proxy, which is also killed and restarted. Whether a fault lands while
    # a batch is in flight is a matter of timing; a run in which none did (rare) proves
    # less, so the stream runs again on a new topic, up to PROXIED_RUNS times. Every
    # run's records must hold what follows.
    rig.start_proxy()
    for run in range(1, PROXIED_RUNS + 1):
        proxied = f"faults-proxied-{suffix}-{run}"
        create_topics(rig.relay.address, proxied)
        cuts_before = rig.relay.stats.cuts
        rig.relay.start_faults(*CUT_EVERY)
        with Restarter(rig) as restarter:
            result = produce_stream(rig.bootstrap, proxied, records,
                                    min_seconds=PROXIED_SECONDS)
        rig.relay.stop_faults()
        cuts = rig.relay.stats.cuts - cuts_before
        tally = Tally.of(result, read_back(rig.relay.address, proxied, set(result.acked)),
                         records)

        tracebacks = sum("Traceback" in line for line in rig.lines)
        report = (
            f"\n{broker}: {records} records, {PARTITIONS} partitions, seed {SEED}\n"
            f"baseline (producer -> relay -> {broker}): {baseline.seconds:.1f} s, "
            f"{baseline_cuts} cuts, {rig.tap.resent(direct)} batches re-sent to the broker, "
            f"failed deliveries "
            f"{dict(baseline.failed)}\n  {baseline_tally.line()}\n"
            f"through kiproxy (run {run}): {result.seconds:.1f} s, {cuts} cuts "
            f"({rig.relay.stats.connections_cut} connections reset in all), "
            f"{len(restarter.restarts)} restarts {restarter.restarts}, "
            f"{rig.tap.resent(proxied)} batches re-sent to the broker, "
            f"failed deliveries {dict(result.failed)}\n  {tally.line()}\n"
            f"unhandled-exception tracebacks in the proxy log: {tracebacks}"
        )
        print(report)

        assert restarter.error is None, f"restarting the proxy failed: {restarter.error}\n{report}"
        assert rig.proxy is not None and rig.proxy.alive(), report
        # the faults really happened
        assert cuts >= 5 and len(restarter.restarts) >= 3, report
        # what the proxy adds beyond the baseline
        assert not result.failed or baseline.failed, f"deliveries failed:\n{report}"
        assert not tally.lost or baseline_tally.lost, f"acknowledged records lost:\n{report}"
        assert not tally.duplicated or baseline_tally.duplicated, (
            f"acknowledged records written twice:\n{report}")
        assert tally.unknown == 0, report
        assert tracebacks == 0, f"the proxy logged unhandled exceptions:\n{report}"
        # and with a baseline that is exact, so is the proxy: every acked record once
        if exact:
            assert not (baseline.failed or baseline_tally.lost or baseline_tally.duplicated), (
                f"{broker} without the proxy was not exact:\n{report}")
        if not (baseline.failed or baseline_tally.lost or baseline_tally.duplicated):
            assert tally.acked == records and tally.stored == records, report
        if rig.tap.resent(proxied) > 0:  # the faults hit records in flight
            return
    pytest.fail(f"no batch had to be re-sent in {PROXIED_RUNS} runs:\n{report}")


# ---------------------------------------------------------------------------- a reset mid-request


def _golden_produce_frame() -> bytes:
    return (GOLDEN / "produce_none.bin").read_bytes()


def test_a_broker_reset_while_a_request_is_forwarded_is_one_warning(rig: Rig) -> None:
    """The broker connection is reset while the proxy holds a Produce request (a plain
    interceptor computing); forwarding it then fails. Expected: the client is closed
    with the same one-line warning as any broken broker connection, counted as such.

    Forwarding writes the request and waits for the broker socket to drain; the
    reset surfaces there (ConnectionResetError, or a transport already closing), and
    must become the upstream warning and ``kiproxy_upstream_connection_errors_total
    {kind="broken"}``, not a traceback from the accept loop.
    """
    rig.start_proxy("--plugins-dir", str(PLUGINS), "--interceptor", "hardening_stall:Stall",
                    "--interceptor-config", json.dumps({"stall_ms": 1500}))
    sock = connect(rig.bootstrap)
    address = local_address(sock)
    try:
        assert wait_until(lambda: rig.relay.live_connections >= 1, 10)
        frame = _golden_produce_frame()
        sock.sendall(struct.pack(">i", len(frame)) + frame)
        time.sleep(0.5)  # the interceptor now holds the proxy's loop
        assert rig.relay.cut() >= 1
        assert closed_by_peer(sock, 10), "the client was not closed"
    finally:
        sock.close()
    time.sleep(0.5)
    assert rig.proxy is not None and rig.proxy.alive()
    lines = [line for line in rig.lines if address in line]
    assert lines, f"no log line names the client {address}:\n{rig.proxy.log}"
    assert "Traceback" not in rig.proxy.log, rig.proxy.log
    assert any("level=WARNING" in line and "upstream" in line for line in lines), rig.proxy.log

