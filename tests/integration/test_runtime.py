"""The proxy runtime end to end: real clients, a real broker (Tansu), kiproxy as a subprocess.

Covers the issue "Proxy runtime": confluent-kafka, kafka-python and aiokafka
producing and consuming through the proxy with no interceptor (keys, headers
with repeated keys and null values, every codec each client can use), admin
clients, a consumer group that commits and resumes, that no client ever
reaches the broker directly, the ApiVersions cut, address rewriting,
pipelining, garbage frames, a broker that goes away and comes back, signals,
config errors and ``kiproxy dev``.

Notes on what the environment allows:

* kafka-python compresses snappy, lz4 and zstd only with the optional
  ``python-snappy``, ``lz4`` and ``zstandard`` packages (it does not use
  cramjam). The test for those codecs runs when the package is installed and is
  skipped (with the reason) otherwise; gzip and no compression always run.
* kafka-python's producer refuses null header values (TypeError), so it sends
  empty ones; its consumer is checked to read null header values that
  confluent-kafka produced.
* aiokafka compresses every codec through cramjam, so all five run.
"""

from __future__ import annotations

import asyncio
import signal
import socket
import struct
import subprocess
import sys
import threading
import time
import typing
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import ROOT, TANSU_NODE_ID, ProxyProcess, consume, launch_proxy
from support.confluent import confluent_producer, poll_messages
from support.dev_mode import running_dev
from support.processes import runtime_env
from support.raw_client import RawClient

from kiproxy.cli import main as kiproxy_main
from kiproxy.protocol.framing import (
    encode_frame,
    parse_response_header,
)
from kiproxy.protocol.messages import ApiKey, parse_response, request_type, serialize
from kiproxy.proxy.brokers.api_versions import PRODUCE_MAX_VERSION, known_version_range
from kiproxy_dev.tansu import EmbeddedBroker, free_port

pytestmark = pytest.mark.timeout(120)

UNSUPPORTED_VERSION = 35

# Records every client test sends: keys (one null), values (one null), headers with a
# repeated key whose order must survive, and null header values.
RECORDS: list[tuple[bytes | None, bytes | None, list[tuple[str, bytes | None]]]] = [
    (b"k0", b"v0", [("h", b"1"), ("h", b"2"), ("n", None)]),
    (None, b"no key", []),
    (b"k2", None, [("only", b"")]),
    (b"k3", b"\x00\xff" * 64, [("a", b"A1"), ("b", None), ("a", b"A2"), ("a", b"A3")]),
    *[(f"r{i}".encode(), b"compressible " * 40 + str(i).encode(), [("i", str(i).encode())])
      for i in range(20)],
]


def _norm_headers(headers: Any) -> list[tuple[str, bytes | None]]:
    return [(k, None if v is None else bytes(v)) for k, v in (headers or [])]


def _without_null_header_values(records: list[Any]) -> list[Any]:
    """RECORDS for a client that cannot send a null header value (kafka-python)."""
    return [(k, v, [(hk, b"" if hv is None else hv) for hk, hv in h]) for k, v, h in records]


def _assert_records(got: list[tuple[Any, Any, Any]], expected: list[Any] = RECORDS) -> None:
    """``got`` holds (key, value, headers) in offset order; compare with ``expected``."""
    assert len(got) == len(expected)
    for i, ((key, value, headers), (ekey, evalue, eheaders)) in enumerate(
        zip(got, expected, strict=True)
    ):
        assert key == ekey, f"record {i} key"
        assert value == evalue, f"record {i} value"
        assert _norm_headers(headers) == eheaders, f"record {i} headers"


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def proxy(broker: EmbeddedBroker) -> Iterator[ProxyProcess]:
    """One passthrough proxy (no interceptor) shared by the client tests of this module."""
    p = launch_proxy(broker.bootstrap)
    yield p
    assert p.alive(), f"proxy died during the module:\n{p.log}"
    p.stop()


def _create_topic(bootstrap: str, partitions: int = 1) -> str:
    """Create a topic through ``bootstrap`` with confluent's AdminClient; return its name."""
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"t-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(name, num_partitions=partitions,
                                            replication_factor=1)], operation_timeout=10)
    futures[name].result(timeout=15)
    return name


# ---------------------------------------------------------------------------- raw protocol


def _api_versions_request(version: int = 3) -> Any:
    cls = request_type(ApiKey.API_VERSIONS, version)
    if version >= 3:
        return cls(client_software_name="kiproxy-test", client_software_version="1.0")
    return cls()


def _metadata_request(version: int) -> Any:
    cls = request_type(ApiKey.METADATA, version)
    if version == 0:
        return cls(topics=())  # v0: an empty list means every topic
    kwargs: dict[str, Any] = {"topics": None}
    if version >= 4:
        kwargs["allow_auto_topic_creation"] = False
    if 8 <= version <= 10:
        kwargs["include_cluster_authorized_operations"] = False
    if version >= 8:
        kwargs["include_topic_authorized_operations"] = False
    return cls(**kwargs)


# ---------------------------------------------------------------------------- confluent-kafka


@pytest.mark.parametrize("codec", ["none", "gzip", "snappy", "lz4", "zstd"])
def test_confluent_produce_consume(proxy: ProxyProcess, codec: str) -> None:
    from confluent_kafka import Consumer, TopicPartition

    topic = f"cf-{codec}-{uuid.uuid4().hex[:8]}"
    producer = confluent_producer({"bootstrap.servers": proxy.bootstrap,
                                   "compression.type": codec, "linger.ms": 20,
                                   "message.timeout.ms": 15000})
    reports: list[tuple[Any, int]] = []
    stamp = 1_700_000_000_123
    for key, value, headers in RECORDS:
        producer.produce(topic, value=value, key=key, headers=headers, partition=0,
                         timestamp=stamp,
                         on_delivery=lambda err, msg: reports.append((err, msg.offset())))
    assert producer.flush(20) == 0
    assert [err for err, _ in reports] == [None] * len(RECORDS)
    assert sorted(off for _, off in reports) == list(range(len(RECORDS)))

    consumer = Consumer({"bootstrap.servers": proxy.bootstrap, "group.id": f"g-{topic}",
                         "enable.auto.commit": False, "auto.offset.reset": "earliest"})
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        msgs: list[Any] = []
        deadline = time.monotonic() + 20
        while len(msgs) < len(RECORDS) and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is not None and not msg.error():
                msgs.append(msg)
    finally:
        consumer.close()
    assert [m.offset() for m in msgs] == list(range(len(RECORDS)))
    assert all(m.timestamp()[1] == stamp for m in msgs)
    _assert_records([(m.key(), m.value(), m.headers()) for m in msgs])


# ---------------------------------------------------------------------------- kafka-python


def _kafka_python_codec_available(codec: str) -> bool:
    from kafka import codec as kcodec

    return {"none": True, "gzip": True, "snappy": kcodec.has_snappy(),
            "lz4": kcodec.has_lz4(), "zstd": kcodec.has_zstd()}[codec]


@pytest.mark.parametrize("codec", ["none", "gzip", "snappy", "lz4", "zstd"])
def test_kafka_python_produce_consume(proxy: ProxyProcess, codec: str) -> None:
    if not _kafka_python_codec_available(codec):
        pytest.skip(f"kafka-python has no {codec} library installed "
                    "(needs python-snappy / lz4 / zstandard; it does not use cramjam)")
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    topic = f"kp-{codec}-{uuid.uuid4().hex[:8]}"
    # kafka-python's producer refuses null header values (TypeError), so it sends
    # empty ones; a confluent-produced record after them checks that kafka-python
    # reads null header values through the proxy.
    sent = _without_null_header_values(RECORDS)
    producer = KafkaProducer(bootstrap_servers=proxy.bootstrap,
                             compression_type=None if codec == "none" else codec,
                             linger_ms=20, request_timeout_ms=15000)
    try:
        futures = [producer.send(topic, value=value, key=key, headers=headers, partition=0)
                   for key, value, headers in sent]
        producer.flush(timeout=20)
        offsets = [f.get(timeout=5).offset for f in futures]
    finally:
        producer.close(timeout=5)
    assert offsets == list(range(len(RECORDS)))
    extra = (b"nulls", b"from confluent", [("x", None), ("x", b"1"), ("x", None)])
    cf = confluent_producer({"bootstrap.servers": proxy.bootstrap, "compression.type": codec})
    cf.produce(topic, key=extra[0], value=extra[1], headers=extra[2], partition=0)
    assert cf.flush(15) == 0
    expected = [*sent, extra]

    consumer = KafkaConsumer(bootstrap_servers=proxy.bootstrap, enable_auto_commit=False,
                             auto_offset_reset="earliest", consumer_timeout_ms=1000)
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        consumer.seek_to_beginning(tp)
        got: list[Any] = []
        deadline = time.monotonic() + 20
        while len(got) < len(expected) and time.monotonic() < deadline:
            for records in consumer.poll(timeout_ms=500).values():
                got.extend(records)
    finally:
        consumer.close()
    assert [r.offset for r in got] == list(range(len(expected)))
    _assert_records([(r.key, r.value, r.headers) for r in got], expected)


# ---------------------------------------------------------------------------- aiokafka


@pytest.mark.parametrize("codec", ["none", "gzip", "snappy", "lz4", "zstd"])
async def test_aiokafka_produce_consume(proxy: ProxyProcess, codec: str) -> None:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer, TopicPartition

    topic = f"ak-{codec}-{uuid.uuid4().hex[:8]}"
    # enable_idempotence stays off: aiokafka's InitProducerId v0 fails on Tansu even
    # without a proxy (see PROTOCOL.md).
    producer = AIOKafkaProducer(bootstrap_servers=proxy.bootstrap,
                                compression_type=None if codec == "none" else codec,
                                linger_ms=20, request_timeout_ms=15000)
    await asyncio.wait_for(producer.start(), 20)
    try:
        futures = [await producer.send(topic, value=value, key=key, headers=headers,
                                       partition=0)
                   for key, value, headers in RECORDS]
        metas = await asyncio.wait_for(asyncio.gather(*futures), 20)
    finally:
        await producer.stop()
    assert [m.offset for m in metas] == list(range(len(RECORDS)))

    consumer = AIOKafkaConsumer(bootstrap_servers=proxy.bootstrap, enable_auto_commit=False,
                                auto_offset_reset="earliest")
    await asyncio.wait_for(consumer.start(), 20)
    try:
        tp = TopicPartition(topic, 0)
        consumer.assign([tp])
        await consumer.seek_to_beginning(tp)
        got: list[Any] = []
        deadline = time.monotonic() + 20
        while len(got) < len(RECORDS) and time.monotonic() < deadline:
            for records in (await consumer.getmany(timeout_ms=500)).values():
                got.extend(records)
    finally:
        await consumer.stop()
    assert [r.offset for r in got] == list(range(len(RECORDS)))
    _assert_records([(r.key, r.value, r.headers) for r in got])


# ---------------------------------------------------------------------------- admin clients


def test_confluent_admin_creates_and_lists_topics(proxy: ProxyProcess,
                                                  broker: EmbeddedBroker) -> None:
    from confluent_kafka.admin import AdminClient

    name = _create_topic(proxy.bootstrap, partitions=3)
    admin = AdminClient({"bootstrap.servers": proxy.bootstrap})
    metadata = admin.list_topics(timeout=10)
    assert name in metadata.topics
    assert sorted(metadata.topics[name].partitions) == [0, 1, 2]
    # Every broker the client is told about is the proxy.
    assert metadata.brokers, "no brokers in metadata"
    for node_id, b in metadata.brokers.items():
        assert (b.host, b.port) == ("127.0.0.1", proxy.broker_port_start + node_id)
        assert b.port in proxy.ports and b.port != broker.port
    assert TANSU_NODE_ID in metadata.brokers


def test_kafka_python_admin_creates_and_lists_topics(proxy: ProxyProcess,
                                                     broker: EmbeddedBroker) -> None:
    from kafka.admin import KafkaAdminClient

    name = f"t-{uuid.uuid4().hex[:10]}"
    admin = KafkaAdminClient(bootstrap_servers=proxy.bootstrap, request_timeout_ms=15000)
    try:
        admin.create_topics({name: {"num_partitions": 2, "replication_factor": 1}})
        deadline = time.monotonic() + 10
        while name not in admin.list_topics() and time.monotonic() < deadline:
            time.sleep(0.2)
        assert name in admin.list_topics()
        described = admin.describe_topics([name])
        assert len(described[0]["partitions"]) == 2
        cluster = admin.describe_cluster()
        ports = {b["port"] for b in cluster["brokers"]}
        hosts = {b["host"] for b in cluster["brokers"]}
    finally:
        admin.close()
    assert hosts == {"127.0.0.1"}
    assert ports <= proxy.ports and broker.port not in ports


# ---------------------------------------------------------------------------- consumer group


def test_consumer_group_commits_and_resumes(proxy: ProxyProcess) -> None:
    from confluent_kafka import Consumer, TopicPartition

    topic = _create_topic(proxy.bootstrap, partitions=1)
    producer = confluent_producer({"bootstrap.servers": proxy.bootstrap})
    for i in range(10):
        producer.produce(topic, value=f"m{i}".encode(), partition=0)
    assert producer.flush(15) == 0

    group = f"grp-{uuid.uuid4().hex[:8]}"
    conf = {"bootstrap.servers": proxy.bootstrap, "group.id": group,
            "enable.auto.commit": False, "auto.offset.reset": "earliest",
            # The lowest a Kafka broker accepts: Tansu holds each first JoinGroup for half.
            "session.timeout.ms": 6000, "heartbeat.interval.ms": 1000}

    first = Consumer(conf)
    try:
        first.subscribe([topic])
        got = poll_messages(first, 4)
        assert [m.value() for m in got] == [f"m{i}".encode() for i in range(4)]
        first.commit(message=got[-1], asynchronous=False)
        committed = first.committed([TopicPartition(topic, 0)], timeout=10)
        assert committed[0].offset == 4
    finally:
        first.close()

    second = Consumer(conf)
    try:
        second.subscribe([topic])
        rest = poll_messages(second, 6)
        assert [m.value() for m in rest] == [f"m{i}".encode() for i in range(4, 10)]
        assert rest[0].offset() == 4
        second.commit(asynchronous=False)
        assert second.committed([TopicPartition(topic, 0)], timeout=10)[0].offset == 10
    finally:
        second.close()


# ---------------------------------------------------------------------------- no escape


def _tcp_connections() -> list[Any]:
    proc = psutil.Process()
    getter = getattr(proc, "net_connections", None) or proc.connections
    return [c for c in getter(kind="tcp") if c.raddr]


async def test_no_client_connects_to_the_broker_directly(proxy: ProxyProcess,
                                                         broker: EmbeddedBroker) -> None:
    from aiokafka import AIOKafkaConsumer, AIOKafkaProducer
    from aiokafka import TopicPartition as AioTP
    from confluent_kafka import Consumer
    from confluent_kafka.admin import AdminClient
    from kafka import KafkaConsumer, KafkaProducer
    from kafka import TopicPartition as KpTP

    before = {(c.laddr, c.raddr) for c in _tcp_connections()}
    topic = _create_topic(proxy.bootstrap, partitions=1)
    group = f"grp-{uuid.uuid4().hex[:8]}"

    cf_producer = confluent_producer({"bootstrap.servers": proxy.bootstrap})
    cf_producer.produce(topic, value=b"confluent", partition=0)
    assert cf_producer.flush(15) == 0
    cf_consumer = Consumer({"bootstrap.servers": proxy.bootstrap, "group.id": group,
                            "auto.offset.reset": "earliest", "session.timeout.ms": 6000})
    cf_consumer.subscribe([topic])
    admin = AdminClient({"bootstrap.servers": proxy.bootstrap})
    kp_producer = KafkaProducer(bootstrap_servers=proxy.bootstrap)
    kp_consumer = KafkaConsumer(bootstrap_servers=proxy.bootstrap, auto_offset_reset="earliest",
                                enable_auto_commit=False)
    ak_producer = AIOKafkaProducer(bootstrap_servers=proxy.bootstrap)
    ak_consumer = AIOKafkaConsumer(bootstrap_servers=proxy.bootstrap,
                                   auto_offset_reset="earliest", enable_auto_commit=False)
    await asyncio.wait_for(ak_producer.start(), 20)
    await asyncio.wait_for(ak_consumer.start(), 20)
    try:
        kp_producer.send(topic, value=b"kafka-python", partition=0).get(timeout=15)
        await asyncio.wait_for(ak_producer.send_and_wait(topic, b"aiokafka", partition=0), 15)
        kp_consumer.assign([KpTP(topic, 0)])
        kp_consumer.seek_to_beginning(KpTP(topic, 0))
        ak_consumer.assign([AioTP(topic, 0)])
        await ak_consumer.seek_to_beginning(AioTP(topic, 0))
        assert admin.list_topics(timeout=10).topics[topic]

        # Every client reads all three records, the group consumer included (group join).
        deadline = time.monotonic() + 30
        seen: dict[str, set[bytes]] = {"cf": set(), "kp": set(), "ak": set()}
        want = {b"confluent", b"kafka-python", b"aiokafka"}
        while any(s != want for s in seen.values()) and time.monotonic() < deadline:
            msg = cf_consumer.poll(0.2)
            if msg is not None and not msg.error():
                seen["cf"].add(msg.value())
            for records in kp_consumer.poll(timeout_ms=200).values():
                seen["kp"].update(r.value for r in records)
            for records in (await ak_consumer.getmany(timeout_ms=200)).values():
                seen["ak"].update(r.value for r in records)
        assert seen == {"cf": want, "kp": want, "ak": want}

        # While all of them are connected: every socket of this process goes to the proxy.
        new = [c for c in _tcp_connections() if (c.laddr, c.raddr) not in before]
        assert new, "the clients hold no TCP connections?"
        assert all(c.raddr.ip == "127.0.0.1" for c in new), new
        assert not [c for c in _tcp_connections() if c.raddr.port == broker.port]
        escaped = [c for c in new if c.raddr.port not in proxy.ports]
        assert not escaped, f"connections that do not go to the proxy: {escaped}"
        used = {c.raddr.port for c in new if c.status == psutil.CONN_ESTABLISHED}
        node_port = proxy.broker_port_start + TANSU_NODE_ID
        assert node_port in used, "no client uses the node listener"
    finally:
        await ak_consumer.stop()
        await ak_producer.stop()
        kp_consumer.close()
        kp_producer.close(timeout=5)
        cf_consumer.close()


# ---------------------------------------------------------------------------- ApiVersions


def test_api_versions_cut_to_what_the_proxy_carries(proxy: ProxyProcess,
                                                    broker: EmbeddedBroker) -> None:
    via_proxy = RawClient(proxy.bootstrap)
    direct = RawClient(broker.bootstrap)
    try:
        for version in (0, 3):
            answer = via_proxy.request(ApiKey.API_VERSIONS, version,
                                       _api_versions_request(version))
            raw = direct.request(ApiKey.API_VERSIONS, version, _api_versions_request(version))
            assert answer.error_code == 0
            offered = {e.api_key: (e.min_version, e.max_version) for e in answer.api_keys}
            broker_offers = {e.api_key: (e.min_version, e.max_version) for e in raw.api_keys}
            assert ApiKey.PRODUCE in offered and ApiKey.METADATA in offered
            for key, (lo, hi) in offered.items():
                known = known_version_range(key)
                assert known is not None, f"api key {key} is unknown to the proxy"
                assert lo <= hi <= known[1]
                assert key in broker_offers
                assert broker_offers[key][0] <= lo and hi <= broker_offers[key][1]
            assert offered[ApiKey.PRODUCE][1] <= PRODUCE_MAX_VERSION <= 13
            # Produce keeps the broker's minimum (KAFKA-18659: librdkafka needs it).
            assert offered[ApiKey.PRODUCE][0] == broker_offers[ApiKey.PRODUCE][0]
            # Nothing the broker offers and the proxy knows is dropped.
            for key, (lo, _hi) in broker_offers.items():
                known = known_version_range(key)
                if known is not None and lo <= known[1]:
                    assert key in offered, f"api key {key} was dropped"
    finally:
        via_proxy.close()
        direct.close()


class _ApiVersionsStub:
    """A fake upstream that answers ApiVersions with a made-up, too generous list.

    Tansu offers nothing the proxy does not know, so the cut is checked against this.
    """

    OFFERS = ((ApiKey.PRODUCE, 0, 15), (ApiKey.FETCH, 4, 99), (ApiKey.METADATA, 0, 12),
              (ApiKey.API_VERSIONS, 0, 3), (ApiKey.FIND_COORDINATOR, 40, 50), (777, 0, 2))

    def __init__(self) -> None:
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        self.listener.close()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        import datetime

        from kio.schema.errors import ErrorCode

        from kiproxy.protocol.framing import encode_response_header, parse_request_header
        from kiproxy.protocol.messages import response_type

        cls = response_type(ApiKey.API_VERSIONS, 3)
        entry = typing.get_args(typing.get_type_hints(cls)["api_keys"])[0]
        body = serialize(cls(
            error_code=ErrorCode(0), throttle_time=datetime.timedelta(0),
            api_keys=tuple(entry(api_key=k, min_version=lo, max_version=hi)
                           for k, lo, hi in self.OFFERS)))
        with conn:
            buffer = b""
            while True:
                try:
                    data = conn.recv(65536)
                except OSError:
                    return
                if not data:
                    return
                buffer += data
                while len(buffer) >= 4 and len(buffer) - 4 >= struct.unpack(">i", buffer[:4])[0]:
                    size = struct.unpack(">i", buffer[:4])[0]
                    frame, buffer = buffer[4:4 + size], buffer[4 + size:]
                    header = parse_request_header(frame)
                    if header.client_id == "kiproxy-discovery":
                        return  # the proxy's own start-up discovery: this stub has no Metadata
                    assert header.api_key == ApiKey.API_VERSIONS and header.api_version == 3
                    conn.sendall(encode_frame(encode_response_header(header.correlation_id, 0)
                                              + body))


def test_api_versions_cut_drops_unknown_keys_and_caps_versions() -> None:
    stub = _ApiVersionsStub()
    proxy = launch_proxy(f"127.0.0.1:{stub.port}")
    client = RawClient(proxy.bootstrap)
    try:
        answer = client.request(ApiKey.API_VERSIONS, 3, _api_versions_request(3))
    finally:
        client.close()
        proxy.stop()
        stub.close()
    offered = {e.api_key: (e.min_version, e.max_version) for e in answer.api_keys}
    fetch_max = known_version_range(ApiKey.FETCH)
    assert fetch_max is not None
    assert offered == {
        ApiKey.PRODUCE: (0, min(PRODUCE_MAX_VERSION, 13)),
        ApiKey.FETCH: (4, fetch_max[1]),
        ApiKey.METADATA: (0, 12),
        ApiKey.API_VERSIONS: (0, 3),
    }, "unknown key 777 and an unreachable FindCoordinator range must be dropped"


def test_api_versions_at_unknown_version_gets_unsupported_version_v0(
        proxy: ProxyProcess) -> None:
    client = RawClient(proxy.bootstrap)
    try:
        # Version 99 with a v2 (flexible) header, as a newer client would send it.
        body = b"\x05kipr\x021\x00"  # compact strings "kipr" and "1", no tagged fields
        header = struct.pack(">hhi", ApiKey.API_VERSIONS, 99, 4242)
        header += struct.pack(">h", 4) + b"test" + b"\x00"
        client.send(encode_frame(header + body))
        frame = client.recv_frame()
        correlation_id, offset = parse_response_header(frame, 0)
        assert correlation_id == 4242
        answer = parse_response(ApiKey.API_VERSIONS, 0, frame, offset)
        assert answer.error_code == UNSUPPORTED_VERSION
        entries = {e.api_key: (e.min_version, e.max_version) for e in answer.api_keys}
        assert ApiKey.API_VERSIONS in entries
        assert entries[ApiKey.API_VERSIONS][1] < 99
        # The client retries lower on the same connection, and that works.
        retry = client.request(ApiKey.API_VERSIONS, entries[ApiKey.API_VERSIONS][1],
                               _api_versions_request(entries[ApiKey.API_VERSIONS][1]))
        assert retry.error_code == 0
    finally:
        client.close()


# ---------------------------------------------------------------------------- addresses


@pytest.mark.parametrize("version", [0, 1, 4, 9, 12])
def test_metadata_names_only_the_proxy(proxy: ProxyProcess, broker: EmbeddedBroker,
                                       version: int) -> None:
    client = RawClient(proxy.bootstrap)
    try:
        answer = client.request(ApiKey.METADATA, version, _metadata_request(version))
    finally:
        client.close()
    assert answer.brokers
    for b in answer.brokers:
        assert b.host == "127.0.0.1"
        assert b.port == proxy.broker_port_start + b.node_id
        assert b.port in proxy.ports and b.port != broker.port


def test_find_coordinator_and_describe_cluster_name_only_the_proxy(
        proxy: ProxyProcess, broker: EmbeddedBroker) -> None:
    from kio.static.primitive import i8

    client = RawClient(proxy.bootstrap)
    try:
        v3 = client.request(ApiKey.FIND_COORDINATOR, 3, request_type(ApiKey.FIND_COORDINATOR, 3)(
            key="some-group", key_type=i8(0)))
        v4 = client.request(ApiKey.FIND_COORDINATOR, 4, request_type(ApiKey.FIND_COORDINATOR, 4)(
            key_type=i8(0), coordinator_keys=("g1", "g2")))
        cluster = client.request(ApiKey.DESCRIBE_CLUSTER, 0,
                                 request_type(ApiKey.DESCRIBE_CLUSTER, 0)(
                                     include_cluster_authorized_operations=False))
    finally:
        client.close()
    assert v3.error_code == 0
    assert (v3.host, v3.port) == ("127.0.0.1", proxy.broker_port_start + v3.node_id)
    assert len(v4.coordinators) == 2
    for c in v4.coordinators:
        assert c.error_code == 0
        assert (c.host, c.port) == ("127.0.0.1", proxy.broker_port_start + c.node_id)
    assert cluster.brokers
    for b in cluster.brokers:
        assert (b.host, b.port) == ("127.0.0.1", proxy.broker_port_start + b.broker_id)
        assert b.port != broker.port


# ---------------------------------------------------------------------------- pipelining


def test_pipelined_requests_answered_in_order(proxy: ProxyProcess) -> None:
    client = RawClient(proxy.bootstrap)
    plan: list[tuple[int, int, int]] = []  # (correlation id, api key, version)
    try:
        batch = b""
        for i in range(16):
            correlation_id = 1000 + i * 7
            if i % 3 == 0:
                api, version, message = ApiKey.API_VERSIONS, 3, _api_versions_request(3)
            elif i % 3 == 1:
                api, version, message = ApiKey.METADATA, 12, _metadata_request(12)
            else:
                api, version, message = ApiKey.METADATA, 1, _metadata_request(1)
            plan.append((correlation_id, api, version))
            batch += RawClient.frame(api, version, correlation_id, message)
        client.send(batch)  # all 16 before reading anything
        answers = []
        for expected_id, api, version in plan:
            correlation_id, answer = RawClient.parse(api, version, client.recv_frame())
            answers.append(correlation_id)
            assert correlation_id == expected_id
            if api == ApiKey.METADATA:
                assert answer.brokers
            else:
                assert answer.error_code == 0
        assert answers == [c for c, _, _ in plan]
    finally:
        client.close()


@pytest.mark.parametrize("prefix", [struct.pack(">I", 0x80000000), struct.pack(">i", -5),
                                    struct.pack(">i", 0x7FFFFFFF)],
                         ids=["int32-min", "negative", "2GiB-1"])
def test_garbage_frame_closes_only_that_connection(proxy: ProxyProcess, prefix: bytes) -> None:
    topic = f"g-{uuid.uuid4().hex[:8]}"
    producer = confluent_producer({"bootstrap.servers": proxy.bootstrap,
                                   "message.timeout.ms": 15000})
    producer.produce(topic, value=b"before", partition=0)
    assert producer.flush(15) == 0

    bystander = RawClient(proxy.bootstrap)
    bad = RawClient(proxy.bootstrap)
    try:
        bystander.request(ApiKey.API_VERSIONS, 3, _api_versions_request(3))
        bad_address = bad.local_address
        bad.send(prefix + b"\x00" * 16)
        try:
            closed = bad.sock.recv(1) == b""
        except ConnectionResetError:
            closed = True
        assert closed, "the proxy kept a connection that sent a garbage frame"
        deadline = time.monotonic() + 5
        while bad_address not in proxy.log and time.monotonic() < deadline:
            time.sleep(0.05)
        assert bad_address in proxy.log, f"no log line names {bad_address}:\n{proxy.log}"
        # Other connections are untouched: a raw one and the producer.
        again = bystander.request(ApiKey.METADATA, 12, _metadata_request(12))
        assert again.brokers
    finally:
        bad.close()
        bystander.close()
    producer.produce(topic, value=b"after", partition=0)
    assert producer.flush(15) == 0
    assert proxy.alive()
    assert [m.value() for m in consume(proxy.bootstrap, topic, 2)] == [b"before", b"after"]


# ---------------------------------------------------------------------------- broker outage


def test_broker_stopped_and_restarted(tmp_path: Path) -> None:
    port = free_port()
    first = EmbeddedBroker(port=port, log_path=tmp_path / "broker1.log")
    first.start()
    second: EmbeddedBroker | None = None
    proxy = launch_proxy(first.bootstrap)
    try:
        topic = f"o-{uuid.uuid4().hex[:8]}"
        producer = confluent_producer({"bootstrap.servers": proxy.bootstrap,
                                       "message.timeout.ms": 3000, "socket.timeout.ms": 2000,
                                       "reconnect.backoff.max.ms": 500})
        errors: list[Any] = []
        producer.produce(topic, value=b"one", partition=0,
                         on_delivery=lambda err, msg: errors.append(err))
        assert producer.flush(15) == 0 and errors == [None]

        first.stop()
        errors.clear()
        producer.produce(topic, value=b"lost", partition=0,
                         on_delivery=lambda err, msg: errors.append(err))
        producer.flush(15)
        assert len(errors) == 1 and errors[0] is not None, "delivery did not fail"
        assert proxy.alive(), f"the proxy died with its broker:\n{proxy.log}"
        del producer

        second = EmbeddedBroker(port=port, log_path=tmp_path / "broker2.log")
        second.start()
        producer = confluent_producer({"bootstrap.servers": proxy.bootstrap,
                                       "message.timeout.ms": 15000})
        errors.clear()
        producer.produce(topic, value=b"two", partition=0,
                         on_delivery=lambda err, msg: errors.append(err))
        assert producer.flush(20) == 0 and errors == [None]
        # Memory storage: the restarted broker holds only the new record.
        assert [m.value() for m in consume(proxy.bootstrap, topic, 1)] == [b"two"]
        assert proxy.alive()
    finally:
        proxy.stop()
        first.stop()
        if second is not None:
            second.stop()


# ---------------------------------------------------------------------------- signals


def _fetch_request(topic: str, max_wait_ms: int) -> Any:
    """A Fetch v4 for partition 0 from offset 0 that the broker holds up to ``max_wait_ms``."""
    import datetime

    from kio.schema.types import BrokerId, TopicName
    from kio.static.primitive import i8, i32, i32Timedelta, i64

    cls = request_type(ApiKey.FETCH, 4)
    topic_cls = typing.get_args(typing.get_type_hints(cls)["topics"])[0]
    part_cls = typing.get_args(typing.get_type_hints(topic_cls)["partitions"])[0]
    return cls(replica_id=BrokerId(-1),
               max_wait=i32Timedelta.parse(datetime.timedelta(milliseconds=max_wait_ms)),
               min_bytes=i32(1), max_bytes=i32(1 << 20), isolation_level=i8(0),
               topics=(topic_cls(topic=TopicName(topic), partitions=(part_cls(
                   partition=i32(0), fetch_offset=i64(0), partition_max_bytes=i32(1 << 20)),)),))


def test_sigterm_exits_zero_within_grace(broker: EmbeddedBroker, tmp_path: Path) -> None:
    """SIGTERM: an in-flight request that finishes within the grace period is answered,
    one that would take longer does not hold the exit past the grace; exit code 0."""
    config = tmp_path / "kiproxy.yaml"
    config.write_text("shutdown_grace_ms: 3000\n")
    proxy = launch_proxy(broker.bootstrap, config_file=config)
    quick = slow = None
    try:
        topic = _create_topic(proxy.bootstrap, partitions=1)  # empty: Fetch long-polls
        producer = confluent_producer({"bootstrap.servers": proxy.bootstrap})
        producer.produce(f"s-{uuid.uuid4().hex[:8]}", value=b"x", partition=0)
        assert producer.flush(15) == 0  # an idle client is connected too
        quick, slow = RawClient(proxy.bootstrap), RawClient(proxy.bootstrap)
        quick.send(RawClient.frame(ApiKey.FETCH, 4, 51, _fetch_request(topic, 1500)))
        slow.send(RawClient.frame(ApiKey.FETCH, 4, 52, _fetch_request(topic, 8000)))
        time.sleep(0.3)
        started = time.monotonic()
        proxy.process.send_signal(signal.SIGTERM)
        correlation_id, answer = RawClient.parse(ApiKey.FETCH, 4, quick.recv_frame())
        assert correlation_id == 51 and answer.responses[0].partitions[0].error_code == 0
        code = proxy.process.wait(10)
        elapsed = time.monotonic() - started
        with pytest.raises((ConnectionError, OSError)):
            slow.recv_frame()  # closed once the grace ran out, unanswered
    finally:
        for client in (quick, slow):
            if client is not None:
                client.close()
        proxy.stop()
    assert code == 0, proxy.log
    assert 1.0 < elapsed < 3 + 2, f"took {elapsed:.1f}s with a 3s grace"
    deadline = time.monotonic() + 2
    while "kiproxy stopped" not in proxy.log and time.monotonic() < deadline:
        time.sleep(0.05)
    assert "kiproxy stopped" in proxy.log
    # What the grace's end dropped is said: the slow Fetch's client, and no other.
    abandoned = [line for line in proxy.lines if "shutdown grace" in line]
    assert len(abandoned) == 1 and "WARNING" in abandoned[0], proxy.log
    assert ("shutdown grace of 3000 ms ran out: closing 1 client connection(s) with 1 "
            "request(s) unanswered: 127.0.0.1:") in abandoned[0], abandoned


def test_sigterm_waits_for_a_request_inside_the_interceptor(
        broker: EmbeddedBroker, tmp_path: Path) -> None:
    """A produce request still in the interceptor when SIGTERM arrives is owed an
    answer like any in-flight request: it is forwarded and acknowledged within the
    grace period, not dropped with the connection."""
    config = tmp_path / "kiproxy.yaml"
    config.write_text("shutdown_grace_ms: 5000\n")
    topic = f"st-{uuid.uuid4().hex[:8]}"
    proxy = launch_proxy(broker.bootstrap, config_file=config,
                         plugins_dir=ROOT / "tests" / "plugins", interceptor="tp_slow:SlowAsync",
                         interceptor_config={"sleep_ms": 1500, "topics": "st-.*"})
    delivered: list[Any] = []
    try:
        producer = confluent_producer({"bootstrap.servers": proxy.bootstrap, "acks": "all",
                                       "message.timeout.ms": 20000})
        producer.produce(f"warm-{uuid.uuid4().hex[:8]}", value=b"w", partition=0)
        assert producer.flush(15) == 0  # connected, metadata known
        producer.produce(topic, value=b"in the interceptor", partition=0,
                         on_delivery=lambda err, msg: delivered.append(err))
        producer.poll(0)
        time.sleep(0.5)  # the request now sleeps in the interceptor
        proxy.process.send_signal(signal.SIGTERM)
        producer.flush(10)
        code = proxy.process.wait(10)
    finally:
        proxy.stop()
    assert delivered == [None], f"delivery: {delivered}\n{proxy.log}"
    assert code == 0, proxy.log
    assert "shutdown grace" not in proxy.log  # nothing was left unanswered
    assert [m.value() for m in consume(broker.bootstrap, topic, 1)] == [b"in the interceptor"]


# ---------------------------------------------------------------------------- CLI and config


def _kiproxy(*args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kiproxy", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout,
                          env=runtime_env())


def _kiproxy_script() -> list[str]:
    script = Path(sys.executable).with_name("kiproxy")
    return [str(script)] if script.exists() else [sys.executable, "-m", "kiproxy"]


@pytest.mark.parametrize(("text", "key"), [
    ("upstream: [127.0.0.1:1]\nbogus_setting: 1\n", "bogus_setting"),
    ("upstream: [127.0.0.1:1]\ninterceptor:\n  timeout_ms: abc\n", "interceptor.timeout_ms"),
    ("upstream: [127.0.0.1:1]\ninterceptor:\n  clas: x:Y\n", "interceptor.clas"),
    ("upstream: [127.0.0.1:1]\nmax_in_flight: -3\n", "max_in_flight"),
])
def test_bad_config_file_names_the_key(tmp_path: Path, text: str, key: str,
                                      capsys: pytest.CaptureFixture[str]) -> None:
    # In this process: a config error is answered before logging or serving is set up.
    config = tmp_path / "bad.yaml"
    config.write_text(text)
    code = kiproxy_main(["run", "--config", str(config), "--listen", f"127.0.0.1:{free_port()}"])
    out, err = capsys.readouterr()
    assert code != 0
    assert key in err, err
    assert "bootstrap address" not in out


def test_missing_upstream_fails_clearly() -> None:
    result = _kiproxy("run", "--listen", f"127.0.0.1:{free_port()}")
    assert result.returncode != 0
    assert "upstream" in result.stderr and "required" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_missing_interceptor_module_fails_clearly(broker: EmbeddedBroker) -> None:
    result = _kiproxy("run", "--upstream", broker.bootstrap,
                      "--listen", f"127.0.0.1:{free_port()}",
                      "--interceptor", "no_such_module_xyz:Nope")
    assert result.returncode != 0
    assert "no_such_module_xyz" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr
    assert "bootstrap address" not in result.stdout


@pytest.mark.parametrize("args", [["--help"], ["run", "--help"], ["dev", "--help"]])
def test_help(args: list[str]) -> None:
    result = subprocess.run([*_kiproxy_script(), *args], cwd=ROOT, capture_output=True,
                            text=True, timeout=30)
    assert result.returncode == 0, result.stderr
    assert "usage: kiproxy" in result.stdout
    if args[0] == "run":
        assert "--upstream" in result.stdout and "--interceptor" in result.stdout
    if args[0] == "--help":
        assert "run" in result.stdout and "dev" in result.stdout


# ---------------------------------------------------------------------------- kiproxy dev


@pytest.mark.parametrize("target", ["group", "kiproxy"])
def test_dev_mode_serves_and_stops_on_ctrl_c(target: str) -> None:
    """``group``: Ctrl-C in a terminal (SIGINT to the whole process group, the embedded
    broker included). ``kiproxy``: SIGINT to kiproxy alone, which must stop its broker."""
    listen = free_port()
    start = free_port() - TANSU_NODE_ID
    with running_dev("--listen", f"127.0.0.1:{listen}",
                     "--broker-port-start", str(start)) as dev:
        dev.wait_bootstrap(40)
        bootstrap_lines = [ln for ln in dev.lines if "bootstrap address" in ln]
        assert bootstrap_lines[0].endswith(f"127.0.0.1:{listen}")
        children = psutil.Process(dev.process.pid).children(recursive=True)
        assert children, "kiproxy dev started no broker process"

        topic = f"d-{uuid.uuid4().hex[:8]}"
        producer = confluent_producer({"bootstrap.servers": f"127.0.0.1:{listen}"})
        producer.produce(topic, key=b"k", value=b"dev", headers=[("h", b"1")], partition=0)
        assert producer.flush(15) == 0
        got = consume(f"127.0.0.1:{listen}", topic, 1)
        assert [(m.key(), m.value()) for m in got] == [(b"k", b"dev")]

        if target == "group":
            dev.interrupt()
        else:
            dev.process.send_signal(signal.SIGINT)
        code = dev.process.wait(20)
        assert code == 0, dev.output
        _gone, alive = psutil.wait_procs(children, timeout=10)
        alive = [p for p in alive if p.status() != psutil.STATUS_ZOMBIE]
        assert not alive, f"embedded broker still running: {alive}"
        assert "Traceback" not in dev.output
