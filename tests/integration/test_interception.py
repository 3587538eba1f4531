"""Produce interception end to end: real clients, a real broker, kiproxy as a subprocess.

Every test runs twice, on Tansu and on Apache Kafka (the ``upstream`` fixture of
tests/conftest.py: ids ``tansu`` and ``kafka``). Where Tansu differs from Kafka
the Tansu variant is a strict expected failure naming the gap.

Two proxies serve the whole module:

* ``router`` runs the built-in TopicRouter with plugins from ``tests/plugins``: the
  topic prefix picks the behaviour (``up-`` upper-cases, ``rej-`` rejects with
  POLICY_VIOLATION, ``inv-`` rejects with INVALID_RECORD and record_errors,
  ``mix-`` rejects only ``mix-rej-`` topics and traces every batch it sees,
  ``raise-`` raises, ``shrink-``/``grow-`` break the record-count rule,
  ``badrec-``/``badhdr-`` return records that cannot be encoded; anything else
  passes untouched).
* ``slow`` runs ``tp_slow:SlowAsync`` directly with ``--interceptor-timeout-ms 200``:
  ``slow-`` topics sleep past the deadline, others pass.

What each client can show (checked below, and why some checks go over a raw socket):

* kafka-python (Produce v9) reports a rejection's ``error_message``; librdkafka
  (confluent-kafka, Produce v10) receives it but reports only the code, and aiokafka
  speaks Produce v7, which has no ``error_message``. The message is checked on the
  wire, at every Produce version the proxy offers, by the raw-socket tests.
* librdkafka (2.16) sends one ProduceRequest per partition, so it cannot put two
  topics in one request; kafka-python and aiokafka do, and the ``mix-`` trace (one
  ``received_at_ms`` per request) proves they did. The raw-socket tests build
  multi-topic requests by hand.
* kafka-python cannot send a null header value (TypeError); it sends empty ones.
* "Nothing stored" is a high watermark of 0. Tansu's watermark is the last batch's
  base offset + 1 (with or without the proxy), so record counts are checked by
  reading the records back instead.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import struct
import time
import typing
import uuid
import zlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ProxyProcess, Upstream, high_watermark, launch_proxy, tansu_gap
from crc32c import crc32c
from support.confluent import confluent_producer, group_consumer_conf, poll_messages
from support.raw_client import RawClient

from kiproxy.protocol.records import Compression, Record, build_batch

pytestmark = pytest.mark.timeout(120)

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
CODECS = ["none", "gzip", "snappy", "lz4", "zstd"]

CORRUPT_MESSAGE = 2
REQUEST_TIMED_OUT = 7
UNSUPPORTED_FOR_MESSAGE_FORMAT = 43
POLICY_VIOLATION = 44
UNSUPPORTED_COMPRESSION_TYPE = 76
INVALID_RECORD = 87

REJECT_MESSAGE = "rej-* topics are closed for writes"
INVALID_MESSAGE = "inv-* records are refused one by one"
MIX_MESSAGE = "mix-rej-* is read-only"
ROUTER_NAME = "kiproxy.interceptors.builtin.route:TopicRouter"


# ---------------------------------------------------------------------------- proxies


@pytest.fixture(scope="module")
def trace_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """JSON lines written by the ``mix-`` route: one per batch it saw."""
    return tmp_path_factory.mktemp("interception") / "mix-trace.jsonl"


@pytest.fixture(scope="module")
def router(upstream: Upstream, trace_path: Path) -> Iterator[ProxyProcess]:
    """The proxy whose behaviour is picked by the topic prefix (see the module docstring)."""
    routes = [
        {"topic": "up-.*", "interceptor": "kiproxy.interceptors.builtin.uppercase:Uppercase"},
        {"topic": "rej-.*", "interceptor": "tp_reject:Reject",
         "config": {"error": "POLICY_VIOLATION", "message": REJECT_MESSAGE}},
        {"topic": "inv-.*", "interceptor": "tp_reject:Reject",
         "config": {"error": "INVALID_RECORD", "message": INVALID_MESSAGE,
                    "record_errors": True}},
        {"topic": "mix-.*", "interceptor": "tp_reject:Reject",
         "config": {"topics": "mix-rej-.*", "message": MIX_MESSAGE, "trace": str(trace_path)}},
        {"topic": "raise-.*", "interceptor": "tp_raise:Raise"},
        {"topic": "shrink-.*", "interceptor": "tp_count:ChangeCount", "config": {"delta": -1}},
        {"topic": "grow-.*", "interceptor": "tp_count:ChangeCount", "config": {"delta": 1}},
        {"topic": "badrec-.*", "interceptor": "tp_bad_records:BadRecords",
         "config": {"mode": "tuples"}},
        {"topic": "badhdr-.*", "interceptor": "tp_bad_records:BadRecords",
         "config": {"mode": "surrogate"}},
    ]
    p = launch_proxy(upstream.bootstrap, interceptor=ROUTER_NAME,
                     interceptor_config={"routes": routes}, plugins_dir=PLUGINS,
                     node_ids=upstream.node_ids)
    yield p
    assert p.alive(), f"the router proxy died during the module:\n{p.log}"
    p.stop()


@pytest.fixture(scope="module")
def slow(upstream: Upstream) -> Iterator[ProxyProcess]:
    """The proxy with an async interceptor that sleeps 3 s on ``slow-`` topics; deadline 200 ms."""
    p = launch_proxy(upstream.bootstrap, "--interceptor-timeout-ms", "200",
                     node_ids=upstream.node_ids,
                     interceptor="tp_slow:SlowAsync",
                     interceptor_config={"topics": "slow-.*", "sleep_ms": 3000},
                     plugins_dir=PLUGINS)
    yield p
    assert p.alive(), f"the slow proxy died during the module:\n{p.log}"
    p.stop()


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:10]}"


# ---------------------------------------------------------------------------- clients

def _cf_producer(bootstrap: str, **conf: Any) -> Any:
    """A confluent-kafka Producer, closed when the test ends."""
    return confluent_producer({"bootstrap.servers": bootstrap, "message.timeout.ms": 20000,
                               **conf})


def _create_topics(bootstrap: str, *names: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(n, num_partitions=1, replication_factor=1)
                                   for n in names], operation_timeout=10)
    for f in futures.values():
        f.result(timeout=15)
    # Apache Kafka answers CreateTopics before its broker leads the new partitions, and
    # the broker's metadata (which Produce checks) may come after its replica (which
    # ListOffsets reads): a Produce would get UNKNOWN_TOPIC_OR_PARTITION or
    # NOT_LEADER_OR_FOLLOWER. Wait until both answer.
    for name in names:
        _wait_led(bootstrap, name, admin)


def _wait_led(bootstrap: str, topic: str, admin: Any, timeout: float = 30) -> None:
    from confluent_kafka import KafkaException

    deadline = time.monotonic() + timeout
    while True:
        try:
            _stored(bootstrap, topic)
            known = admin.list_topics(topic=topic, timeout=5).topics[topic]
            if known.error is None and known.partitions[0].leader >= 0:
                return
        except (KafkaException, KeyError):
            pass
        assert time.monotonic() < deadline, f"{topic}[0] has no leader after {timeout} s"
        time.sleep(0.1)


def _read(bootstrap: str, topic: str, count: int, timeout: float = 30, exact: bool = True,
          conf: dict[str, Any] | None = None) -> list[Any]:
    """``count`` messages of partition 0 from offset 0 (confluent-kafka, explicit assignment).

    With ``exact``, one more poll looks for records beyond them (they would show up
    in the test's assertions on the returned list).
    """
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": _name("read"),
                  "enable.auto.commit": False, "auto.offset.reset": "earliest", **(conf or {})})
    try:
        c.assign([TopicPartition(topic, 0, 0)])
        out: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(out) < count and time.monotonic() < deadline:
            out.extend(m for m in c.consume(num_messages=10000, timeout=0.1) if not m.error())
        if exact:
            out.extend(m for m in c.consume(num_messages=10000, timeout=0.3) if not m.error())
        return out
    finally:
        c.close()


def _stored(bootstrap: str, topic: str) -> int:
    """The high watermark of partition 0; 0 means the broker holds nothing.

    Only compared with 0: Tansu answers ListOffsets(latest) with the last batch's base
    offset + 1, not the offset after the last record (the same without the proxy).
    """
    return high_watermark(bootstrap, topic)


# ---------------------------------------------------------------------------- records

Headers = list[tuple[str, bytes | None]]

RecordTuple = tuple[bytes | None, bytes | None, Headers]

_BULK: list[RecordTuple] = [
    (f"r{i}".encode(), b"compressible lower-case text, " * 30 + str(i).encode(),
     [("i", str(i).encode()), ("i", b"again")]) for i in range(20)]
RECORDS: list[RecordTuple] = [
    (b"k0", b"hello world", [("h", b"1"), ("h", b"2"), ("n", None)]),
    (None, b"no key here", []),
    (b"k2", None, [("only", b"")]),
    (b"k3", b"Mixed Case \x00\xff bytes", [("a", b"A1"), ("b", None), ("a", b"A2"), ("a", b"A3")]),
    *_BULK,
]
STAMP = 1_700_000_000_123


def _no_null_header_values(records: list[Any]) -> list[Any]:
    return [(k, v, [(hk, b"" if hv is None else hv) for hk, hv in h]) for k, v, h in records]


def _upper(records: list[Any]) -> list[Any]:
    return [(k, None if v is None else v.upper(), h) for k, v, h in records]


def _norm(headers: Any) -> Headers:
    return [(k, None if v is None else bytes(v)) for k, v in (headers or [])]


def _assert_read(msgs: list[Any], expected: list[Any]) -> None:
    """Confluent messages ``msgs`` are exactly ``expected`` (key, value, headers), in order."""
    assert [m.offset() for m in msgs] == list(range(len(expected)))
    got = [(m.key(), m.value(), _norm(m.headers())) for m in msgs]
    for i, (g, e) in enumerate(zip(got, expected, strict=True)):
        assert g == tuple(e), f"record {i}"


def _kafka_python_has(codec: str) -> bool:
    from kafka import codec as kcodec

    return bool({"none": True, "gzip": True, "snappy": kcodec.has_snappy(),
                 "lz4": kcodec.has_lz4(), "zstd": kcodec.has_zstd()}[codec])


def _log_line(proxy: ProxyProcess, *needles: str, timeout: float = 10) -> str:
    """The first line the proxy printed that holds every one of ``needles`` (waits for it)."""
    deadline = time.monotonic() + timeout
    while True:
        found = [ln for ln in list(proxy.lines) if all(n in ln for n in needles)]
        if found:
            return found[0]
        if time.monotonic() > deadline:
            raise AssertionError(f"no log line with {needles}:\n{proxy.log}")
        time.sleep(0.05)


def _trace(path: Path, *topics: str) -> list[dict[str, Any]]:
    if not path.exists():
        return []
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    return [line for line in lines if line["topic"] in topics]


# ============================================================================ transform


@pytest.mark.parametrize("codec", CODECS)
def test_confluent_transform(router: ProxyProcess, codec: str) -> None:
    topic = _name(f"up-cf-{codec}")
    producer = _cf_producer(router.bootstrap, **{"compression.type": codec, "linger.ms": 20})
    reports: list[Any] = []
    for key, value, headers in RECORDS:
        producer.produce(topic, key=key, value=value, headers=headers, partition=0,
                         timestamp=STAMP, on_delivery=lambda err, msg: reports.append(err))
    assert producer.flush(20) == 0
    assert reports == [None] * len(RECORDS)
    msgs = _read(router.bootstrap, topic, len(RECORDS))
    _assert_read(msgs, _upper(RECORDS))
    assert all(m.timestamp()[1] == STAMP for m in msgs)


@pytest.mark.parametrize("codec", CODECS)
def test_kafka_python_transform(router: ProxyProcess, codec: str) -> None:
    if not _kafka_python_has(codec):
        pytest.skip(f"kafka-python has no {codec} library installed")
    from kafka import KafkaProducer

    topic = _name(f"up-kp-{codec}")
    sent = _no_null_header_values(RECORDS)
    producer = KafkaProducer(bootstrap_servers=router.bootstrap, linger_ms=20,
                             compression_type=None if codec == "none" else codec)
    try:
        futures = [producer.send(topic, key=k, value=v, headers=h, partition=0,
                                 timestamp_ms=STAMP) for k, v, h in sent]
        producer.flush(timeout=20)
        offsets = [f.get(timeout=5).offset for f in futures]
    finally:
        producer.close(timeout=5)
    assert offsets == list(range(len(sent)))
    msgs = _read(router.bootstrap, topic, len(sent))
    _assert_read(msgs, _upper(sent))
    assert all(m.timestamp()[1] == STAMP for m in msgs)


@pytest.mark.parametrize("codec", CODECS)
async def test_aiokafka_transform(router: ProxyProcess, codec: str) -> None:
    from aiokafka import AIOKafkaProducer

    topic = _name(f"up-ak-{codec}")
    producer = AIOKafkaProducer(bootstrap_servers=router.bootstrap, linger_ms=20,
                                compression_type=None if codec == "none" else codec)
    await asyncio.wait_for(producer.start(), 20)
    try:
        futures = [await producer.send(topic, key=k, value=v, headers=h, partition=0,
                                       timestamp_ms=STAMP) for k, v, h in RECORDS]
        metas = await asyncio.wait_for(asyncio.gather(*futures), 20)
    finally:
        await producer.stop()
    assert [m.offset for m in metas] == list(range(len(RECORDS)))
    msgs = await asyncio.to_thread(_read, router.bootstrap, topic, len(RECORDS))
    _assert_read(msgs, _upper(RECORDS))
    assert all(m.timestamp()[1] == STAMP for m in msgs)


# ============================================================================ rejection


def test_confluent_rejection(router: ProxyProcess) -> None:
    from confluent_kafka import KafkaError

    topic = _name("rej-cf")
    producer = _cf_producer(router.bootstrap, **{"linger.ms": 20})
    errors: list[Any] = []
    for i in range(3):
        producer.produce(topic, value=b"v%d" % i, partition=0,
                         on_delivery=lambda err, msg: errors.append(err))
    producer.flush(20)
    assert len(errors) == 3
    assert all(e is not None and e.code() == KafkaError.POLICY_VIOLATION == POLICY_VIOLATION
               for e in errors), errors
    assert not any(e.retriable() for e in errors)
    assert _stored(router.bootstrap, topic) == 0
    # librdkafka does not report the error_message it receives; the proxy logs it.
    assert "error 44" in _log_line(router, f"rejected {topic}[0]", REJECT_MESSAGE)


def test_kafka_python_rejection(router: ProxyProcess) -> None:
    from kafka import KafkaProducer
    from kafka.errors import PolicyViolationError

    topic = _name("rej-kp")
    producer = KafkaProducer(bootstrap_servers=router.bootstrap, linger_ms=20)
    try:
        futures = [producer.send(topic, value=b"v%d" % i, partition=0) for i in range(3)]
        producer.flush(timeout=20)
        for f in futures:
            with pytest.raises(PolicyViolationError) as info:
                f.get(timeout=5)
            assert info.value.errno == POLICY_VIOLATION
            assert REJECT_MESSAGE in str(info.value)
    finally:
        producer.close(timeout=5)
    assert _stored(router.bootstrap, topic) == 0


async def test_aiokafka_rejection(router: ProxyProcess) -> None:
    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import PolicyViolationError

    topic = _name("rej-ak")
    producer = AIOKafkaProducer(bootstrap_servers=router.bootstrap, linger_ms=20)
    await asyncio.wait_for(producer.start(), 20)
    try:
        futures = [await producer.send(topic, value=b"v%d" % i, partition=0) for i in range(3)]
        results = await asyncio.wait_for(asyncio.gather(*futures, return_exceptions=True), 20)
    finally:
        await producer.stop()
    assert all(isinstance(r, PolicyViolationError) for r in results), results
    assert all(typing.cast(PolicyViolationError, r).errno == POLICY_VIOLATION for r in results)
    assert await asyncio.to_thread(_stored, router.bootstrap, topic) == 0


# ==================================================================== two topics, one request

MIX_OK = [(b"a", b"kept one", [("h", b"1")]), (None, b"kept two", [])]
MIX_REJ = [(b"b", b"refused one", []), (b"c", b"refused two", [("h", b"2")])]


def _assert_mix(router: ProxyProcess, ok: str, rej: str) -> None:
    """The accepted topic holds exactly its records (untouched); the rejected one nothing."""
    _assert_read(_read(router.bootstrap, ok, len(MIX_OK)), MIX_OK)
    assert _stored(router.bootstrap, rej) == 0


def _assert_one_request(trace_path: Path, ok: str, rej: str) -> None:
    """Both topics' batches came in the same request (same connection, same receive time)."""
    seen = _trace(trace_path, ok, rej)
    assert {line["topic"] for line in seen} == {ok, rej}
    requests = {(line["client_address"], line["received_at_ms"]) for line in seen}
    assert len(requests) == 1, f"the client split the topics over requests: {seen}"


def test_confluent_two_topics_one_rejected(router: ProxyProcess, trace_path: Path) -> None:
    """librdkafka sends one request per partition (see the module docstring): this checks
    the outcome; the raw-socket test below checks one request spanning both."""
    from confluent_kafka import KafkaError

    ok, rej = _name("mix-ok-cf"), _name("mix-rej-cf")
    producer = _cf_producer(router.bootstrap, **{"linger.ms": 200})
    results: dict[str, list[Any]] = {ok: [], rej: []}
    for (ka, va, ha), (kb, vb, hb) in zip(MIX_OK, MIX_REJ, strict=True):
        producer.produce(ok, key=ka, value=va, headers=ha, partition=0,
                         on_delivery=lambda err, msg: results[msg.topic()].append(err))
        producer.produce(rej, key=kb, value=vb, headers=hb, partition=0,
                         on_delivery=lambda err, msg: results[msg.topic()].append(err))
    producer.flush(20)
    assert results[ok] == [None, None]
    assert [e.code() for e in results[rej]] == [KafkaError.POLICY_VIOLATION] * 2
    _assert_mix(router, ok, rej)
    assert {line["topic"] for line in _trace(trace_path, ok, rej)} == {ok, rej}


def test_kafka_python_two_topics_one_rejected(router: ProxyProcess, trace_path: Path) -> None:
    from kafka import KafkaProducer
    from kafka.errors import PolicyViolationError

    ok, rej = _name("mix-ok-kp"), _name("mix-rej-kp")
    producer = KafkaProducer(bootstrap_servers=router.bootstrap, linger_ms=200)
    try:
        # Metadata first, so that the first send does not go out alone.
        producer.partitions_for(ok)
        producer.partitions_for(rej)
        ok_futures, rej_futures = [], []
        for (ka, va, ha), (kb, vb, hb) in zip(MIX_OK, MIX_REJ, strict=True):
            ok_futures.append(producer.send(ok, key=ka, value=va, headers=ha, partition=0))
            rej_futures.append(producer.send(rej, key=kb, value=vb, headers=hb, partition=0))
        producer.flush(timeout=20)
        assert [f.get(timeout=5).offset for f in ok_futures] == [0, 1]
        for f in rej_futures:
            with pytest.raises(PolicyViolationError, match=re.escape(MIX_MESSAGE)):
                f.get(timeout=5)
    finally:
        producer.close(timeout=5)
    _assert_mix(router, ok, rej)
    _assert_one_request(trace_path, ok, rej)


async def test_aiokafka_two_topics_one_rejected(router: ProxyProcess, trace_path: Path) -> None:
    from aiokafka import AIOKafkaProducer
    from aiokafka.errors import PolicyViolationError

    ok, rej = _name("mix-ok-ak"), _name("mix-rej-ak")
    producer = AIOKafkaProducer(bootstrap_servers=router.bootstrap, linger_ms=200)
    await asyncio.wait_for(producer.start(), 20)
    try:
        await producer.partitions_for(ok)
        await producer.partitions_for(rej)
        ok_futures, rej_futures = [], []
        for (ka, va, ha), (kb, vb, hb) in zip(MIX_OK, MIX_REJ, strict=True):
            ok_futures.append(await producer.send(ok, key=ka, value=va, headers=ha, partition=0))
            rej_futures.append(await producer.send(rej, key=kb, value=vb, headers=hb,
                                                   partition=0))
        oks = await asyncio.wait_for(asyncio.gather(*ok_futures), 20)
        rejs = await asyncio.wait_for(asyncio.gather(*rej_futures, return_exceptions=True), 20)
    finally:
        await producer.stop()
    assert [m.offset for m in oks] == [0, 1]
    assert all(isinstance(r, PolicyViolationError) for r in rejs), rejs
    await asyncio.to_thread(_assert_mix, router, ok, rej)
    _assert_one_request(trace_path, ok, rej)


# =================================================================== idempotence, transactions


@pytest.mark.timeout(240)
def test_idempotent_producer_100k_records_transformed(router: ProxyProcess) -> None:
    from confluent_kafka import KafkaError

    topic = _name("up-idem")
    total = 100_000
    errors: list[Any] = []
    offsets: list[int] = []

    def delivered(err: Any, msg: Any) -> None:
        if err is not None:
            errors.append(err)
        else:
            offsets.append(msg.offset())

    global_errors: list[Any] = []
    producer = _cf_producer(router.bootstrap, **{
        "enable.idempotence": True, "acks": "all", "linger.ms": 5,
        "max.in.flight.requests.per.connection": 5, "queue.buffering.max.messages": 200_000,
        "message.timeout.ms": 120_000, "compression.type": "lz4",
        "error_cb": global_errors.append,
    })
    for i in range(total):
        producer.produce(topic, key=b"%d" % (i % 7), value=b"rec-%06d" % i, partition=0,
                         on_delivery=delivered)
        if i % 10_000 == 0:
            producer.poll(0)
    assert producer.flush(120) == 0
    assert errors == [], errors[:5]
    assert not [e for e in global_errors
                if e.code() == KafkaError.OUT_OF_ORDER_SEQUENCE_NUMBER], global_errors
    assert global_errors == []
    assert sorted(offsets) == list(range(total))

    msgs = _read(router.bootstrap, topic, total, timeout=90)
    assert len(msgs) == total  # nothing lost, nothing twice
    assert [m.offset() for m in msgs] == list(range(total))
    values = [m.value() for m in msgs]
    assert values == [b"REC-%06d" % i for i in range(total)]  # in order, transformed
    assert "OUT_OF_ORDER_SEQUENCE_NUMBER" not in router.log


def test_transactional_producer_commits(router: ProxyProcess, upstream: Upstream,
                                        trace_path: Path) -> None:
    from confluent_kafka import KafkaException, Producer

    topic, traced = _name("up-tx"), _name("mix-ok-tx")
    txid = _name("txid")
    producer = _cf_producer(router.bootstrap, **{"transactional.id": txid})
    try:
        producer.init_transactions(20)
    except KafkaException as exc:
        # Proxy or broker? Try the same straight against the broker.
        direct = Producer({"bootstrap.servers": upstream.bootstrap,
                           "transactional.id": _name("txid-direct")})
        try:
            direct.init_transactions(20)
        except KafkaException as direct_exc:
            pytest.skip(f"the broker does not support transactions: InitProducerId with a "
                        f"transactional.id failed even without the proxy ({direct_exc})")
        raise AssertionError(f"transactions work against the broker but not through the "
                             f"proxy: {exc}") from exc
    producer.begin_transaction()
    for i in range(10):
        producer.produce(topic, key=b"k%d" % i, value=b"in a transaction %d" % i, partition=0)
        producer.produce(traced, value=b"traced %d" % i, partition=0)
    producer.commit_transaction(20)

    # Read committed: the ten transformed records (the commit marker follows them).
    msgs = _read(router.bootstrap, topic, 10, conf={"isolation.level": "read_committed"})
    assert [m.value() for m in msgs] == [b"IN A TRANSACTION %d" % i for i in range(10)]
    assert [m.key() for m in msgs] == [b"k%d" % i for i in range(10)]
    assert [m.value() for m in _read(router.bootstrap, traced, 10)] == [
        b"traced %d" % i for i in range(10)]
    # What the interceptor was told about the batches.
    seen = _trace(trace_path, traced)
    assert seen and sum(line["records"] for line in seen) == 10
    for line in seen:
        assert line["transactional"] is True
        assert line["transactional_id"] == txid
        assert line["producer_id"] >= 0 and line["producer_epoch"] >= 0
        assert line["base_sequence"] >= 0


def test_read_committed_sees_committed_records_and_never_aborted_ones(
        router: ProxyProcess, upstream: Upstream, request: pytest.FixtureRequest) -> None:
    """Commit, abort, commit, through the transforming route: a read_committed consumer
    reads the committed records (transformed), a read_uncommitted one reads all three
    transactions, and the broker holds exactly that."""
    tansu_gap(upstream, request, "read_committed consumers also get aborted records "
                                 "(Tansu keeps no aborted-transaction index)")
    topic = _name("up-abort")
    producer = _cf_producer(router.bootstrap, **{"transactional.id": _name("txid-abort")})
    producer.init_transactions(20)
    for outcome, values in [("commit", [b"first %d" % i for i in range(3)]),
                            ("abort", [b"aborted %d" % i for i in range(3)]),
                            ("commit", [b"last %d" % i for i in range(2)])]:
        producer.begin_transaction()
        for value in values:
            producer.produce(topic, value=value, partition=0)
        assert producer.flush(20) == 0
        if outcome == "commit":
            producer.commit_transaction(20)
        else:
            producer.abort_transaction(20)

    committed = [b"FIRST %d" % i for i in range(3)] + [b"LAST %d" % i for i in range(2)]
    for bootstrap in (router.bootstrap, upstream.bootstrap):
        msgs = _read(bootstrap, topic, 5, conf={"isolation.level": "read_committed"})
        assert [m.value() for m in msgs] == committed
    everything = _read(router.bootstrap, topic, 8, conf={"isolation.level": "read_uncommitted"})
    assert sorted(m.value() for m in everything) == sorted(
        [*committed, *(b"ABORTED %d" % i for i in range(3))])


# ============================================================================ consumer groups


@pytest.mark.parametrize("group_protocol", ["classic", "consumer"])
def test_consumer_group_commits_and_resumes(router: ProxyProcess, upstream: Upstream,
                                            request: pytest.FixtureRequest,
                                            group_protocol: str) -> None:
    """A group member reads 4 records and commits; the next member of the same group
    resumes at offset 4 and reads the other 6, all through the proxy."""
    from confluent_kafka import Consumer, TopicPartition

    if group_protocol == "consumer":
        # Not run on Tansu: its consumer waits out the test's whole minute first.
        tansu_gap(upstream, request, "no KIP-848 consumer groups (ConsumerGroupHeartbeat)",
                  run=False)
    topic = _name("up-group")
    _create_topics(router.bootstrap, topic)
    producer = _cf_producer(router.bootstrap, **{"linger.ms": 5})
    for i in range(10):
        producer.produce(topic, value=b"m%d" % i, partition=0)
    assert producer.flush(20) == 0

    conf = group_consumer_conf(router.bootstrap, _name("grp"), group_protocol)
    first = Consumer(conf)
    try:
        first.subscribe([topic])
        got = poll_messages(first, 4)
        assert [m.value() for m in got][:4] == [b"M%d" % i for i in range(4)]
        first.commit(offsets=[TopicPartition(topic, 0, 4)], asynchronous=False)
        assert first.committed([TopicPartition(topic, 0)], timeout=10)[0].offset == 4
    finally:
        first.close()
    second = Consumer(conf)
    try:
        second.subscribe([topic])
        rest = poll_messages(second, 6)
        assert [m.value() for m in rest] == [b"M%d" % i for i in range(4, 10)]
        second.commit(asynchronous=False)
        assert second.committed([TopicPartition(topic, 0)], timeout=10)[0].offset == 10
    finally:
        second.close()


# ============================================================================ acks=0


def test_acks_zero_rejection_keeps_the_producer_working(router: ProxyProcess) -> None:
    rej, ok = _name("rej-acks0"), _name("up-acks0")
    producer = _cf_producer(router.bootstrap, **{"acks": 0, "linger.ms": 5})
    reports: list[Any] = []
    for i in range(5):
        producer.produce(rej, value=b"dropped %d" % i, partition=0,
                         on_delivery=lambda err, msg: reports.append(err))
    assert producer.flush(20) == 0
    # acks=0: nothing to wait for - the client counts them as sent.
    assert reports == [None] * 5
    for i in range(3):
        producer.produce(ok, value=b"after %d" % i, partition=0)
    assert producer.flush(20) == 0
    # The later records are stored (the same broker connection still works) ...
    assert [m.value() for m in _read(router.bootstrap, ok, 3)] == [b"AFTER %d" % i
                                                                     for i in range(3)]
    # ... and the rejected ones are not.
    assert _stored(router.bootstrap, rej) == 0
    assert router.alive()


def test_acks_zero_rejection_then_acks_one_on_the_same_connection(
        router: ProxyProcess) -> None:
    rej, ok = _name("rej-raw-acks0"), _name("up-raw-acks1")
    _create_topics(router.bootstrap, rej, ok)
    with RawClient(router.bootstrap) as client:
        # acks=0 rejected: no answer. Then acks=1: its answer is the first frame back.
        client.send(client.produce(9, [(rej, _batch([b"dropped"]))], acks=0, correlation_id=1))
        client.send(client.produce(9, [(ok, _batch([b"kept"]))], acks=1, correlation_id=2))
        correlation_id, response = client.read_produce(9)
        assert correlation_id == 2
        assert _partitions(response) == {(ok, 0): (0, 0)}
        # A rejected acks=0 in the middle of acknowledged ones changes nothing either.
        client.send(client.produce(9, [(rej, _batch([b"dropped"]))], acks=0, correlation_id=3))
        client.send(client.produce(9, [(ok, _batch([b"kept"]))], acks=-1, correlation_id=4))
        correlation_id, response = client.read_produce(9)
        assert correlation_id == 4
        assert _partitions(response) == {(ok, 0): (0, 1)}
    assert _stored(router.bootstrap, rej) == 0
    assert [m.value() for m in _read(router.bootstrap, ok, 2)] == [b"KEPT", b"KEPT"]


def test_acks_zero_records_all_arrive_whether_or_not_the_broker_answers_them(
        router: ProxyProcess) -> None:
    """Kafka never answers an acks=0 Produce request; Tansu does. Either way every record
    arrives and the connection stays open: the proxy drops an answer to an acks=0 request
    instead of taking it for an answer out of order."""
    up, plain = _name("up-acks0-each"), _name("plain-acks0-each")
    _create_topics(router.bootstrap, up, plain)
    producer = _cf_producer(router.bootstrap, **{"acks": 0, "linger.ms": 0})
    for i in range(100):  # one record per request
        producer.produce(up, value=b"u%d" % i, partition=0)
        assert producer.flush(10) == 0
        producer.produce(plain, value=b"p%d" % i, partition=0)
        assert producer.flush(10) == 0
    assert [m.value() for m in _read(router.bootstrap, up, 100)] == [
        b"U%d" % i for i in range(100)]
    assert [m.value() for m in _read(router.bootstrap, plain, 100)] == [
        b"p%d" % i for i in range(100)]
    assert "answers no request" not in router.log
    with RawClient(router.bootstrap) as client:
        # acks=0 and acks=1 requests interleaved: exactly the acks=1 answers come back,
        # in order, whether the broker answered the others or not.
        for correlation_id in range(10, 40):
            acks = 1 if correlation_id % 3 == 0 else 0
            client.send(client.produce(9, [(plain, _batch([b"raw"]))], acks=acks,
                                       correlation_id=correlation_id))
        for expected in range(12, 40, 3):
            correlation_id, response = client.read_produce(9)
            assert correlation_id == expected
            assert _partition(response, plain).error_code == 0
    assert _stored(router.bootstrap, plain) > 100


# ============================================================================ plugin failures


# Who the rejection names: the router's routes are routes of the proxy (named by their
# index), so a verdict names the routed plugin and an encoding failure its route.
_ROUTED = {"raise": "tp_raise:Raise", "shrink": "tp_count:ChangeCount",
           "grow": "tp_count:ChangeCount", "badrec": "of route 7", "badhdr": "of route 8"}


@pytest.mark.parametrize(("prefix", "message"), [
    ("raise", "failed: RuntimeError: tp_raise exploded"),
    ("shrink", "broke the record-count rule: returned 1 records for a batch of 2"),
    ("grow", "broke the record-count rule: returned 3 records for a batch of 2"),
    ("badrec", "returned records that cannot be encoded: TypeError: record 0 is a tuple"),
    ("badhdr", "returned records that cannot be encoded: UnicodeEncodeError"),
], ids=["raise", "shrink", "grow", "not-records", "bad-header-key"])
def test_plugin_failure_rejects_with_invalid_record(router: ProxyProcess, prefix: str,
                                                    message: str) -> None:
    from confluent_kafka import KafkaError
    from kafka import KafkaProducer
    from kafka.errors import InvalidRecordError

    bad, after = _name(prefix), _name("up-after")
    # kafka-python: the code and the message.
    kp = KafkaProducer(bootstrap_servers=router.bootstrap, linger_ms=50, retries=0)
    try:
        kp.partitions_for(bad)
        futures = [kp.send(bad, value=b"v%d" % i, partition=0) for i in range(2)]
        kp.flush(timeout=20)
        for f in futures:
            with pytest.raises(InvalidRecordError) as info:
                f.get(timeout=5)
            assert info.value.errno == INVALID_RECORD
            assert message in str(info.value), str(info.value)
            assert f"interceptor {_ROUTED[prefix]} " in str(info.value), str(info.value)
        # The same producer (and connection) keeps working.
        assert kp.send(after, value=b"kp after", partition=0).get(timeout=15).offset == 0
    finally:
        kp.close(timeout=5)
    # confluent-kafka: the code, then a produce that succeeds.
    cf = _cf_producer(router.bootstrap, **{"linger.ms": 50})
    errors: list[Any] = []
    for i in range(2):
        cf.produce(bad, value=b"v%d" % i, partition=0,
                   on_delivery=lambda err, msg: errors.append(err))
    cf.flush(20)
    assert [e.code() if e else None for e in errors] == [KafkaError.INVALID_RECORD] * 2
    errors.clear()
    cf.produce(after, value=b"cf after", partition=0,
               on_delivery=lambda err, msg: errors.append(err))
    assert cf.flush(20) == 0 and errors == [None]

    assert _stored(router.bootstrap, bad) == 0
    assert [m.value() for m in _read(router.bootstrap, after, 2)] == [b"KP AFTER", b"CF AFTER"]
    assert router.alive()


def test_plugin_exception_is_logged_with_traceback(router: ProxyProcess) -> None:
    from confluent_kafka import KafkaError

    topic = _name("raise-log")
    cf = _cf_producer(router.bootstrap)
    errors: list[Any] = []
    cf.produce(topic, value=b"x", partition=0, on_delivery=lambda err, msg: errors.append(err))
    cf.flush(20)
    assert [e.code() for e in errors] == [KafkaError.INVALID_RECORD]
    # Plugin bugs are WARNINGs, rate-limited per plugin and fault: the first one the
    # module's proxy saw (maybe another test's raise- topic) carries the traceback.
    line = _log_line(router, "rejected raise-", "failed: RuntimeError: tp_raise exploded")
    assert "Traceback" in line and "tp_raise.py" in line
    assert "level=WARNING" in line  # a plugin bug, not a policy rejection (INFO)


def test_slow_async_plugin_times_out(slow: ProxyProcess) -> None:
    from confluent_kafka import KafkaError
    from kafka import KafkaProducer
    from kafka.errors import RequestTimedOutError

    topic, after = _name("slow"), _name("fast")
    # REQUEST_TIMED_OUT is retriable: retries=0 lets the client report it at once.
    cf = _cf_producer(slow.bootstrap, retries=0)
    errors: list[Any] = []
    cf.produce(topic, value=b"late", partition=0, on_delivery=lambda err, msg: errors.append(err))
    cf.flush(20)
    assert [e.code() if e else None for e in errors] == [KafkaError.REQUEST_TIMED_OUT]
    assert errors[0].code() == REQUEST_TIMED_OUT
    errors.clear()
    cf.produce(after, value=b"on time", partition=0,
               on_delivery=lambda err, msg: errors.append(err))
    assert cf.flush(20) == 0 and errors == [None]

    kp = KafkaProducer(bootstrap_servers=slow.bootstrap, retries=0)
    try:
        with pytest.raises(RequestTimedOutError) as info:
            kp.send(topic, value=b"late too", partition=0).get(timeout=15)
        assert info.value.errno == REQUEST_TIMED_OUT
        assert "tp_slow:SlowAsync did not finish within 200 ms" in str(info.value)
        assert kp.send(after, value=b"kp on time", partition=0).get(timeout=15).offset == 1
    finally:
        kp.close(timeout=5)

    assert _stored(slow.bootstrap, topic) == 0
    assert [m.value() for m in _read(slow.bootstrap, after, 2)] == [b"on time", b"kp on time"]
    assert slow.alive()


# ============================================================================ a large record


@pytest.mark.parametrize("codec", ["none", "zstd"])
def test_one_mebibyte_record_is_transformed_intact(router: ProxyProcess, codec: str) -> None:
    topic = _name(f"up-big-{codec}")
    rng = random.Random(7)
    value = bytes(rng.choice(b"abcdefghijklmnopqrstuvwxyz0123456789 \n\x00\xff")
                  for _ in range(1 << 20))
    headers = [("h", b"1"), ("h", b"2")]
    producer = _cf_producer(router.bootstrap, **{
        "message.max.bytes": 8 << 20, "compression.type": codec, "linger.ms": 5})
    errors: list[Any] = []
    producer.produce(topic, key=b"big", value=value, headers=headers, partition=0,
                     on_delivery=lambda err, msg: errors.append(err))
    producer.produce(topic, key=b"small", value=b"after", partition=0,
                     on_delivery=lambda err, msg: errors.append(err))
    assert producer.flush(30) == 0
    assert errors == [None, None]
    msgs = _read(router.bootstrap, topic, 2, conf={
        "fetch.max.bytes": 16 << 20, "max.partition.fetch.bytes": 16 << 20,
        "receive.message.max.bytes": 32 << 20})
    assert [m.key() for m in msgs] == [b"big", b"small"]
    assert len(msgs[0].value()) == 1 << 20
    assert msgs[0].value() == value.upper()
    assert _norm(msgs[0].headers()) == headers
    assert msgs[1].value() == b"AFTER"


# ============================================================================ raw socket


def _batch(values: list[bytes], compression: Compression = Compression.NONE) -> bytes:
    return build_batch([Record(key=b"k", value=v, headers=[("h", b"1")], timestamp=STAMP + i)
                        for i, v in enumerate(values)], compression=compression)


def _partitions(response: Any) -> dict[tuple[str, int], tuple[int, int]]:
    """(topic, partition) -> (error code, base offset) of a Produce response."""
    return {(t.name, int(p.index)): (int(p.error_code), int(p.base_offset))
            for t in response.responses for p in t.partition_responses}


def _partition(response: Any, topic: str) -> Any:
    [found] = [p for t in response.responses if t.name == topic for p in t.partition_responses]
    return found


def _bad_crc() -> bytes:
    data = bytearray(_batch([b"lower case value"]))
    data[-5] ^= 0x20  # a byte of the value: the declared CRC-32C no longer matches
    return bytes(data)


def _unknown_codec() -> bytes:
    data = bytearray(_batch([b"lower case value"]))
    attributes = struct.unpack_from(">h", data, 21)[0]
    struct.pack_into(">h", data, 21, (attributes & ~0x07) | 5)  # codec id 5 does not exist
    struct.pack_into(">I", data, 17, crc32c(bytes(data[21:])))  # ... with a valid CRC
    return bytes(data)


def _magic_v1() -> bytes:
    """An old-format (magic 1) message set of one message."""

    def field(b: bytes | None) -> bytes:
        return struct.pack(">i", -1) if b is None else struct.pack(">i", len(b)) + b

    body = struct.pack(">bbq", 1, 0, STAMP) + field(b"k") + field(b"lower case value")
    message = struct.pack(">I", zlib.crc32(body)) + body
    return struct.pack(">qi", 0, len(message)) + message


def _truncated() -> bytes:
    return _batch([b"lower case value", b"another"])[:-7]


CORRUPT = {
    "bad-crc": (_bad_crc, CORRUPT_MESSAGE, "CRC-32C mismatch"),
    "unknown-codec": (_unknown_codec, UNSUPPORTED_COMPRESSION_TYPE,
                      "unknown compression codec id 5"),
    "magic-v1": (_magic_v1, UNSUPPORTED_FOR_MESSAGE_FORMAT, "magic 1"),
    "truncated": (_truncated, CORRUPT_MESSAGE, "runs past"),
}


@pytest.mark.parametrize("version", [3, 9])
@pytest.mark.parametrize("case", list(CORRUPT))
def test_corrupt_data_is_rejected_and_not_forwarded(router: ProxyProcess, case: str,
                                                    version: int) -> None:
    make, code, detail = CORRUPT[case]
    bad, good = _name("up-corrupt"), _name("up-good")
    _create_topics(router.bootstrap, bad, good)
    with RawClient(router.bootstrap) as client:
        # Alone: the proxy answers the whole request itself.
        client.send(client.produce(version, [(bad, make())], correlation_id=11))
        correlation_id, response = client.read_produce(version)
        assert correlation_id == 11
        assert _partitions(response) == {(bad, 0): (code, -1)}
        if version >= 8:
            assert detail in _partition(response, bad).error_message
        # Next to a good partition: that one is forwarded, the answers merged.
        client.send(client.produce(version, [(bad, make()), (good, _batch([b"good one"]))],
                                   correlation_id=12))
        correlation_id, response = client.read_produce(version)
        assert correlation_id == 12
        assert _partitions(response) == {(bad, 0): (code, -1), (good, 0): (0, 0)}
        # The connection stays open and keeps working.
        client.send(client.produce(version, [(bad, _batch([b"valid now"]))], correlation_id=13))
        correlation_id, response = client.read_produce(version)
        assert correlation_id == 13
        assert _partitions(response) == {(bad, 0): (0, 0)}
    msgs = _read(router.bootstrap, bad, 1)
    assert [m.value() for m in msgs] == [b"VALID NOW"]  # nothing of the corrupt data
    assert [m.value() for m in _read(router.bootstrap, good, 1)] == [b"GOOD ONE"]
    assert router.alive()


@pytest.mark.parametrize("version", [3, 7, 8, 9, 10, 11])
def test_rejection_on_the_wire_every_version(router: ProxyProcess, version: int) -> None:
    """One request: a rejected topic with record_errors, a POLICY_VIOLATION topic and an
    upper-cased one; the broker's answer for the last is merged with the two rejections."""
    inv, rej, up = _name("inv-wire"), _name("rej-wire"), _name("up-wire")
    _create_topics(router.bootstrap, inv, rej, up)
    with RawClient(router.bootstrap) as client:
        client.send(client.produce(version, [
            (inv, _batch([b"a", b"b"]) + _batch([b"c"], Compression.GZIP)),
            (rej, _batch([b"x"])),
            (up, _batch([b"kept", b"too"], Compression.SNAPPY)),
        ], correlation_id=21))
        correlation_id, response = client.read_produce(version)
    assert correlation_id == 21
    assert _partitions(response) == {(inv, 0): (INVALID_RECORD, -1),
                                     (rej, 0): (POLICY_VIOLATION, -1), (up, 0): (0, 0)}
    if version >= 8:
        p_inv, p_rej = _partition(response, inv), _partition(response, rej)
        assert p_inv.error_message == INVALID_MESSAGE
        # The first batch of the partition is rejected: its records are 0 and 1.
        assert [(int(e.batch_index), e.batch_index_error_message)
                for e in p_inv.record_errors] == [(0, "record 0 refused"),
                                                  (1, "record 1 refused")]
        assert p_rej.error_message == REJECT_MESSAGE
        assert tuple(p_rej.record_errors) == ()
        assert _partition(response, up).error_message is None
    assert [m.value() for m in _read(router.bootstrap, up, 2)] == [b"KEPT", b"TOO"]
    assert _stored(router.bootstrap, inv) == 0
    assert _stored(router.bootstrap, rej) == 0
