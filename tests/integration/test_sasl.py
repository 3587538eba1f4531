"""SASL through kiproxy, end to end, with real clients and a broker that requires it.

The issue asks that PLAIN and SCRAM-SHA-256/512 pass through the proxy unchanged
to a broker that requires them, and that the proxy adds no way around the
broker's authentication. These tests check both with confluent-kafka
(librdkafka) and kafka-python:

* With the right password, records produced through the proxy are stored by
  the broker and read back through the proxy, for every mechanism; the proxy
  learns the principal (its log says ``authenticated as 'alice'``, the audit log
  carries it), and a KIP-368 re-authentication keeps the connection going.
* With a wrong password the client fails through the proxy exactly as it fails
  against the broker directly (same librdkafka error code and text), and no
  record reaches the topic. An unsupported mechanism, likewise.
* A client without SASL gets neither metadata nor a produce through the proxy,
  and neither does the proxy itself (its node discovery is refused).

The broker: Tansu stores the records, behind
:class:`hardening.sasl_gateway.SaslGateway`, which plays the authentication layer
of a Kafka broker (real PLAIN and SCRAM server side, Kafka's error codes and
messages, connection closed on failure). Tansu itself cannot hold SCRAM users
nor offer PLAIN, and no Apache Kafka is available here; the module docstring of
the gateway says why, and tests/containers/test_apache_kafka_sasl.py runs the
same scenarios against Apache Kafka where Docker is available.
"""

from __future__ import annotations

import functools
import json
import re
import struct
import time
import uuid
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from conftest import TANSU_NODE_ID, ProxyProcess, consume, high_watermark, launch_proxy
from hardening.fault_relay import wait_until
from hardening.raw_kafka import (
    api_versions_frame,
    connect,
    local_address,
    metadata_frame,
    request_frame,
)
from hardening.sasl_gateway import SaslGateway, kafka_failure_message

from kiproxy.protocol.framing import encode_frame, encode_request_header, parse_response_header
from kiproxy.protocol.messages import ApiKey, parse_response, request_type
from kiproxy.protocol.records import Record, build_batch
from kiproxy_dev.tansu import EmbeddedBroker

pytestmark = [
    pytest.mark.timeout(120),
    # kafka-python 3 loads its schemas through importlib.resources' legacy functions.
    pytest.mark.filterwarnings("ignore:(read|open)_text is deprecated:DeprecationWarning"),
]

USERS = {"alice": "alice-secret", "bob": "bob-secret"}
SCRAM = ["SCRAM-SHA-256", "SCRAM-SHA-512"]
MECHANISMS = [*SCRAM, "PLAIN"]
RECORDS = 200

_AUTHENTICATION = -169  # librdkafka RD_KAFKA_RESP_ERR__AUTHENTICATION
_MSG_TIMED_OUT = -192  # RD_KAFKA_RESP_ERR__MSG_TIMED_OUT


# ---------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def gateway(broker: EmbeddedBroker) -> Iterator[SaslGateway]:
    """The session's Tansu broker behind a SASL gateway (PLAIN, SCRAM-SHA-256/512)."""
    gw = SaslGateway(broker.bootstrap, USERS).start()
    yield gw
    gw.stop()


@pytest.fixture(scope="module")
def proxy(gateway: SaslGateway) -> Iterator[ProxyProcess]:
    """kiproxy in front of the gateway (no interceptor: pass-through is what is tested)."""
    p = launch_proxy(gateway.address)
    yield p
    assert p.alive(), f"the proxy died during the module:\n{p.log}"
    p.stop()


# ---------------------------------------------------------------------------- helpers


def _sasl(mechanism: str, user: str = "alice", password: str | None = None) -> dict[str, Any]:
    return {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": mechanism,
            "sasl.username": user, "sasl.password": USERS[user] if password is None else password}


def _client_id(what: str) -> str:
    return f"{what}-{uuid.uuid4().hex[:6]}"


def _produce(bootstrap: str, topic: str, count: int, **conf: Any) -> list[Any]:
    """Produce ``count`` records to partition 0; the delivery error (or None) of each."""
    from confluent_kafka import Producer

    results: dict[int, Any] = {}

    def report(i: int, err: Any, _msg: Any) -> None:
        results[i] = err

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5, "acks": "all", **conf})
    for i in range(count):
        producer.produce(topic, key=f"k{i}".encode(), value=f"record {i}".encode(), partition=0,
                         headers=[("n", str(i).encode()), ("n", b"again")],
                         on_delivery=functools.partial(report, i))
        producer.poll(0)
    producer.flush(30)
    return [results.get(i, "no delivery report") for i in range(count)]


def _consume(bootstrap: str, topic: str, count: int, timeout: float = 30,
             **conf: Any) -> list[Any]:
    """Read ``count`` records of partition 0 from the start (explicit assignment)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"read-{uuid.uuid4().hex[:6]}",
                  "enable.auto.commit": False, "auto.offset.reset": "earliest", **conf})
    try:
        c.assign([TopicPartition(topic, 0, 0)])
        out: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(out) < count and time.monotonic() < deadline:
            msg = c.poll(0.2)
            if msg is not None and not msg.error():
                out.append(msg)
        return out
    finally:
        c.close()


def _expected(count: int) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    return [(f"k{i}".encode(), f"record {i}".encode(), [("n", str(i).encode()), ("n", b"again")])
            for i in range(count)]


def _records(msgs: list[Any]) -> list[tuple[bytes, bytes, list[tuple[str, bytes]]]]:
    return [(m.key(), m.value(), m.headers()) for m in msgs]


def _stored(broker: EmbeddedBroker, topic: str, count: int = 1,
            timeout: float = 2.0) -> list[Any]:
    """What the broker itself holds (read straight from Tansu, past gateway and proxy)."""
    return list(consume(broker.bootstrap, topic, count, timeout=timeout))


def _lines(proxy: ProxyProcess, client_id: str) -> list[str]:
    return [line for line in proxy.lines if f"(client_id '{client_id}')" in line]


_LIBRDKAFKA_ERROR = re.compile(
    r"^\S+: (?P<text>.*?)(?: \(after \d+ms in state [A-Z_]+"
    r"(?:, \d+ identical error\(s\) suppressed)?\))?$")


def _normalised(text: str) -> str:
    """A librdkafka error string without the broker name and the timing suffix."""
    match = _LIBRDKAFKA_ERROR.match(text)
    return match["text"] if match else text


def _failed_attempt(bootstrap: str, topic: str, conf: dict[str, Any]) -> dict[str, Any]:
    """Produce with ``conf`` until librdkafka reports an authentication error; what it saw."""
    from confluent_kafka import Producer

    errors: list[Any] = []
    deliveries: list[Any] = []
    producer = Producer({"bootstrap.servers": bootstrap, "message.timeout.ms": 1500,
                         "error_cb": errors.append, **conf})
    for i in range(3):
        producer.produce(topic, value=f"must not arrive {i}".encode(), partition=0,
                         on_delivery=lambda err, _msg: deliveries.append(err))
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and not any(e.code() == _AUTHENTICATION for e in errors):
        producer.poll(0.1)
    producer.flush(10)
    auth = [e for e in errors if e.code() == _AUTHENTICATION]
    return {
        "first": (auth[0].code(), _normalised(auth[0].str())) if auth else None,
        "auth_texts": {_normalised(e.str()) for e in auth},
        "deliveries": [d.code() if d is not None else None for d in deliveries],
    }


def _failed_attempts(direct: str, through: str, topic: str,
                     conf: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """:func:`_failed_attempt` against the broker and through the proxy, side by side."""
    with ThreadPoolExecutor(2) as pool:
        a = pool.submit(_failed_attempt, direct, topic, conf)
        b = pool.submit(_failed_attempt, through, topic, conf)
        return a.result(), b.result()


def _recv_or_close(sock: Any, timeout: float = 10) -> bytes | None:
    """The next response frame, or ``None`` if the peer closes (or resets) first."""
    sock.settimeout(timeout)
    buf = b""
    try:
        while len(buf) < 4:
            chunk = sock.recv(4 - len(buf))
            if not chunk:
                return None
            buf += chunk
        (size,) = struct.unpack(">i", buf)
        body = b""
        while len(body) < size:
            chunk = sock.recv(size - len(body))
            if not chunk:
                return None
            body += chunk
        return body
    except (ConnectionResetError, BrokenPipeError):
        return None


def _handshake_frame(correlation_id: int, mechanism: str, version: int = 1) -> bytes:
    cls = request_type(ApiKey.SASL_HANDSHAKE, version)
    return bytes(request_frame(ApiKey.SASL_HANDSHAKE, version, correlation_id,
                               cls(mechanism=mechanism)))


def _produce_frame(correlation_id: int, topic: str) -> bytes:
    """A Produce v9 request (acks=1) with one ordinary record batch for partition 0."""
    import datetime

    cls = request_type(ApiKey.PRODUCE, 9)
    topic_cls = _nested(cls, "topic_data")
    part_cls = _nested(topic_cls, "partition_data")
    batch = build_batch([Record(key=b"k", value=b"unauthenticated",
                                timestamp=int(time.time() * 1000))])
    message = cls(transactional_id=None, acks=1, timeout=datetime.timedelta(seconds=5),
                  topic_data=(topic_cls(name=topic, partition_data=(
                      part_cls(index=0, records=batch),)),))
    return bytes(request_frame(ApiKey.PRODUCE, 9, correlation_id, message))


def _nested(cls: Any, field: str) -> Any:
    import typing

    return typing.get_args(typing.get_type_hints(cls)[field])[0]


# ---------------------------------------------------------------------------- success


@pytest.mark.parametrize("mechanism", MECHANISMS)
def test_records_pass_through_with_each_mechanism(
        proxy: ProxyProcess, gateway: SaslGateway, broker: EmbeddedBroker, topic: str,
        mechanism: str) -> None:
    client_id = _client_id(f"sasl-{mechanism}")
    conf = {**_sasl(mechanism), "client.id": client_id}
    assert _produce(proxy.bootstrap, topic, RECORDS, **conf) == [None] * RECORDS

    # Read back through the proxy, authenticated the same way.
    got = _consume(proxy.bootstrap, topic, RECORDS, **conf)
    assert _records(got) == _expected(RECORDS)
    assert [m.offset() for m in got] == list(range(RECORDS))
    # The broker stored exactly what was produced (read past gateway and proxy).
    assert _records(_stored(broker, topic, RECORDS, timeout=30)) == _expected(RECORDS)

    # The proxy learned the principal on its bootstrap and on its node connection.
    lines = _lines(proxy, client_id)
    authenticated = [line for line in lines
                     if f"authenticated as 'alice' (SASL {mechanism})" in line]
    assert authenticated, f"no principal line for {client_id}:\n{proxy.log}"
    assert any(f"node_id={TANSU_NODE_ID}" in line for line in authenticated), proxy.log
    assert not any("failed" in line for line in lines), proxy.log
    assert USERS["alice"] not in proxy.log
    assert (mechanism, "alice") in gateway.stats.authenticated
    # The proxy reaches node 111 through the gateway, never at Tansu's own port.
    assert f"node {TANSU_NODE_ID} ({gateway.address}) gets listener port" in proxy.log
    assert f"node {TANSU_NODE_ID} moved" not in proxy.log


@pytest.mark.parametrize("mechanism", ["SCRAM-SHA-512", "PLAIN"])
def test_kafka_python_produces_and_consumes_through_the_proxy(
        proxy: ProxyProcess, broker: EmbeddedBroker, topic: str, mechanism: str) -> None:
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    client_id = _client_id(f"kp-{mechanism}")
    conf: dict[str, Any] = {"bootstrap_servers": proxy.bootstrap,
                            "security_protocol": "SASL_PLAINTEXT", "sasl_mechanism": mechanism,
                            "sasl_plain_username": "bob", "sasl_plain_password": USERS["bob"],
                            "client_id": client_id}
    producer = KafkaProducer(**conf, acks="all")
    try:
        futures = [producer.send(topic, key=f"k{i}".encode(), value=f"record {i}".encode(),
                                 partition=0, headers=[("n", str(i).encode()), ("n", b"again")])
                   for i in range(RECORDS)]
        producer.flush(30)
        assert [f.get(10).offset for f in futures] == list(range(RECORDS))
    finally:
        producer.close(5)

    consumer = KafkaConsumer(**conf, auto_offset_reset="earliest", enable_auto_commit=False)
    try:
        consumer.assign([TopicPartition(topic, 0)])
        got: list[Any] = []
        deadline = time.monotonic() + 30
        while len(got) < RECORDS and time.monotonic() < deadline:
            for batch in consumer.poll(200).values():
                got.extend(batch)
    finally:
        consumer.close()
    assert [(r.key, r.value, list(r.headers)) for r in got] == _expected(RECORDS)
    assert _records(_stored(broker, topic, RECORDS, timeout=30)) == _expected(RECORDS)
    assert any(f"authenticated as 'bob' (SASL {mechanism})" in line
               for line in _lines(proxy, client_id)), proxy.log


# ---------------------------------------------------------------------------- failures


@pytest.mark.parametrize(("mechanism", "message"), [
    ("SCRAM-SHA-256", kafka_failure_message("SCRAM-SHA-256")),
    ("SCRAM-SHA-512", kafka_failure_message("SCRAM-SHA-512")),
    ("PLAIN", "Authentication failed: Invalid username or password"),
])
def test_wrong_password_fails_as_it_does_without_the_proxy(
        proxy: ProxyProcess, gateway: SaslGateway, broker: EmbeddedBroker, topic: str,
        mechanism: str, message: str) -> None:
    client_id = _client_id(f"wrong-{mechanism}")
    conf = {**_sasl(mechanism, password="not-the-password"), "client.id": client_id}
    direct, through = _failed_attempts(gateway.address, proxy.bootstrap, topic, conf)

    expected = (_AUTHENTICATION, f"SASL authentication error: {message}")
    assert direct["first"] == expected, direct
    assert through["first"] == direct["first"], (through, direct)
    assert through["auth_texts"] == direct["auth_texts"] == {expected[1]}
    assert direct["deliveries"] == through["deliveries"] == [_MSG_TIMED_OUT] * 3
    assert high_watermark(broker.bootstrap, topic) == 0, "a record reached the topic"

    # The proxy saw the failure, and never a principal, for this client.
    lines = _lines(proxy, client_id)
    assert any(f"as 'alice' failed: error_code 58 (SASL_AUTHENTICATION_FAILED): {message} "
               f"(SASL {mechanism})" in line for line in lines), proxy.log
    assert not any("authenticated as" in line for line in lines), proxy.log
    assert "not-the-password" not in proxy.log
    # The broker closing each failed login's connection is not logged again per retry.
    assert not any("closed the connection; closing client" in line for line in lines), lines


def test_unsupported_mechanism_fails_as_it_does_without_the_proxy(
        proxy: ProxyProcess, gateway: SaslGateway, broker: EmbeddedBroker, topic: str) -> None:
    conf = {"security.protocol": "SASL_PLAINTEXT", "sasl.mechanism": "OAUTHBEARER",
            "enable.sasl.oauthbearer.unsecure.jwt": True,
            "sasl.oauthbearer.config": "principal=alice", "client.id": _client_id("oauth")}
    direct, through = _failed_attempts(gateway.address, proxy.bootstrap, topic, conf)
    assert direct["first"] is not None, direct
    assert "PLAIN,SCRAM-SHA-256,SCRAM-SHA-512" in direct["first"][1], direct
    assert through["first"] == direct["first"], (through, direct)
    assert direct["deliveries"] == through["deliveries"] == [_MSG_TIMED_OUT] * 3
    assert high_watermark(broker.bootstrap, topic) == 0


def test_a_client_without_sasl_gets_no_metadata_and_no_produce(
        proxy: ProxyProcess, gateway: SaslGateway, broker: EmbeddedBroker, topic: str) -> None:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    # The proxy has no credentials of its own: its node discovery is refused too.
    proxy.wait_for_line("does it require SASL or TLS?")
    with pytest.raises(KafkaException):
        AdminClient({"bootstrap.servers": proxy.bootstrap}).list_topics(timeout=3)
    errors = _produce(proxy.bootstrap, topic, 3, **{"message.timeout.ms": 1500})
    assert [e.code() for e in errors] == [_MSG_TIMED_OUT] * 3

    # The same, request by request on a bare socket.
    sock = connect(proxy.bootstrap)
    try:
        sock.sendall(api_versions_frame(1))
        answer = _recv_or_close(sock)
        assert answer is not None, "ApiVersions is answered before authentication"
        _, offset = parse_response_header(answer, 0)
        keys = {e.api_key for e in parse_response(ApiKey.API_VERSIONS, 3, answer, offset).api_keys}
        assert {ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE} <= keys
        sock.sendall(metadata_frame(2, topics=[topic]))
        assert _recv_or_close(sock) is None, "Metadata was answered without authentication"
    finally:
        sock.close()
    for prelude in ([], [_handshake_frame(1, "SCRAM-SHA-256")]):
        sock = connect(proxy.bootstrap)
        try:
            for frame in prelude:
                sock.sendall(frame)
                assert _recv_or_close(sock) is not None
            sock.sendall(_produce_frame(9, topic))
            assert _recv_or_close(sock) is None, "Produce was answered without authentication"
        finally:
            sock.close()
    assert "Metadata before authentication (ILLEGAL_SASL_STATE)" in gateway.stats.refused
    assert "Produce before authentication (ILLEGAL_SASL_STATE)" in gateway.stats.refused
    # Mid-exchange the proxy refuses the Produce itself, as the broker would: it never
    # reaches the broker (nor an interceptor).
    assert "Produce during SASL authentication (ILLEGAL_SASL_STATE)" not in gateway.stats.refused
    refusal = "Produce request before its SASL SCRAM-SHA-256 authentication succeeded"
    assert wait_until(lambda: refusal in proxy.log, 5), proxy.log  # the log is read by a thread
    assert high_watermark(broker.bootstrap, topic) == 0, "a record reached the topic"


def _old_format_produce_frame(correlation_id: int, topic: str) -> bytes:
    """A Produce v2 request (acks=1, an empty message set for partition 0)."""
    name = topic.encode()
    body = (struct.pack(">hii", 1, 5000, 1) + struct.pack(">h", len(name)) + name
            + struct.pack(">iii", 1, 0, 0))
    return encode_frame(encode_request_header(ApiKey.PRODUCE, 2, correlation_id, "old", 1)
                        + body)


def test_a_request_the_proxy_refuses_mid_authentication_is_not_answered(
        proxy: ProxyProcess, gateway: SaslGateway, topic: str) -> None:
    direct = connect(gateway.address)
    try:
        direct.sendall(_handshake_frame(1, "SCRAM-SHA-256"))
        assert _recv_or_close(direct) is not None
        direct.sendall(_old_format_produce_frame(2, topic))
        assert _recv_or_close(direct) is None  # what the broker does
    finally:
        direct.close()
    sock = connect(proxy.bootstrap)
    try:
        sock.sendall(_handshake_frame(1, "SCRAM-SHA-256"))
        assert _recv_or_close(sock) is not None
        sock.sendall(_old_format_produce_frame(2, topic))
        assert _recv_or_close(sock, timeout=5) is None, "the proxy answered for the broker"
    finally:
        sock.close()


def test_legacy_raw_token_flow_is_refused_by_the_proxy(
        proxy: ProxyProcess, gateway: SaslGateway) -> None:
    """SaslHandshake v0 (raw tokens outside Kafka framing) is not carried: the proxy
    closes the client at the handshake with a warning that says so, and nothing reaches
    the broker. Directly, the broker accepts the same flow (modern clients use v1)."""
    token = b"\x00alice\x00" + USERS["alice"].encode()
    before = (len(gateway.stats.authenticated), len(gateway.stats.failures))

    direct = connect(gateway.address)
    try:
        direct.sendall(_handshake_frame(1, "PLAIN", version=0))
        assert _recv_or_close(direct) is not None
        direct.sendall(struct.pack(">i", len(token)) + token)
        assert _recv_or_close(direct) == b""  # PLAIN's empty server token: authenticated
        direct.sendall(metadata_frame(2, version=9))
        answer = _recv_or_close(direct)
        assert answer is not None
        _, offset = parse_response_header(answer, 1)
        brokers = parse_response(ApiKey.METADATA, 9, answer, offset).brokers
        assert [(b.node_id, f"{b.host}:{b.port}") for b in brokers] == \
            [(TANSU_NODE_ID, gateway.address)]
    finally:
        direct.close()
    assert len(gateway.stats.authenticated) == before[0] + 1

    seen = len(proxy.lines)  # an earlier test's client may have had the same port
    sock = connect(proxy.bootstrap)
    address = local_address(sock)
    try:
        sock.sendall(_handshake_frame(1, "PLAIN", version=0))
        assert _recv_or_close(sock) is None, "SaslHandshake v0 was answered"
    finally:
        sock.close()

    def refusal() -> list[str]:
        return [line for line in proxy.lines[seen:]
                if address in line and "closing client" in line]

    assert wait_until(refusal, 5), proxy.log  # the log is read by a thread
    assert "SaslHandshake v0" in refusal()[0] and "level=WARNING" in refusal()[0], proxy.log
    assert (len(gateway.stats.authenticated), len(gateway.stats.failures)) == \
        (before[0] + 1, before[1]), "the raw token reached the broker"


# ---------------------------------------------------------------------------- principal


def test_the_principal_reaches_the_audit_log(tmp_path: Path, gateway: SaslGateway,
                                             topic: str) -> None:
    audit = tmp_path / "audit.jsonl"
    p = launch_proxy(gateway.address, "--audit-log", str(audit))
    try:
        assert _produce(p.bootstrap, topic, 20, **_sasl("SCRAM-SHA-256")) == [None] * 20
    finally:
        assert p.stop() == 0
    events = [json.loads(line) for line in audit.read_text().splitlines()]
    produce = [e for e in events if e.get("event") == "produce"]
    assert sum(e["records"] for e in produce) == 20
    assert {e["principal"] for e in produce} == {"alice"}


def test_reauthentication_keeps_the_connection_and_a_failed_one_ends_it(
        broker: EmbeddedBroker, topic: str) -> None:
    """KIP-368: the broker gives a 1.5 s session; librdkafka re-authenticates through the
    proxy and keeps producing. Then the password changes: the next re-authentication
    fails, the proxy logs it, and what is produced after that is not stored."""
    from confluent_kafka import Producer

    gw = SaslGateway(broker.bootstrap, USERS, session_lifetime_ms=1500).start()
    p = launch_proxy(gw.address)
    client_id = _client_id("reauth")
    try:
        delivered: list[Any] = []
        producer = Producer({"bootstrap.servers": p.bootstrap, "client.id": client_id,
                             "linger.ms": 0, "message.timeout.ms": 2000,
                             **_sasl("SCRAM-SHA-512")})
        sent = 0
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and len(gw.stats.reauthenticated) < 3:
            producer.produce(topic, value=f"r{sent}".encode(), partition=0,
                             on_delivery=lambda err, _m: delivered.append(err))
            sent += 1
            producer.poll(0.05)
        assert producer.flush(10) == 0
        assert len(gw.stats.reauthenticated) >= 3, gw.stats
        assert delivered == [None] * sent
        assert set(gw.stats.reauthenticated) == {("SCRAM-SHA-512", "alice")}
        lines = _lines(p, client_id)
        assert not any("failed" in line for line in lines), p.log
        # Logged once per connection: re-authenticating as the same user changes nothing.
        assert len([line for line in lines if "authenticated as 'alice'" in line]) == \
            len(gw.stats.authenticated)

        gw.set_password("alice", "changed")
        failed = len(gw.stats.failures)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and len(gw.stats.failures) == failed:
            producer.poll(0.1)
        reauth_failure = kafka_failure_message("SCRAM-SHA-512", reauthentication=True)
        assert gw.stats.failures[failed:][:1] == [("SCRAM-SHA-512", "alice", reauth_failure)]
        # By one session lifetime later, every connection has failed to re-authenticate
        # or seen its session expire (the broker then closes it at the next request).
        deadline = time.monotonic() + 1.6
        while time.monotonic() < deadline:
            producer.poll(0.1)
        late: list[Any] = []
        for i in range(3):
            producer.produce(topic, value=f"late {i}".encode(), partition=0,
                             on_delivery=lambda err, _m: late.append(err))
        producer.flush(10)
        assert [e.code() if e else None for e in late] == [_MSG_TIMED_OUT] * 3
        lines = _lines(p, client_id)
        assert any(f"as 'alice' failed: error_code 58 (SASL_AUTHENTICATION_FAILED): "
                   f"{reauth_failure} (SASL SCRAM-SHA-512)" in line for line in lines), p.log
    finally:
        p.stop()
        gw.stop()
    stored = _stored(broker, topic, sent + 3, timeout=1.5)
    assert [m.value() for m in stored] == [f"r{i}".encode() for i in range(sent)]
