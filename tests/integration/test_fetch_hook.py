"""The fetch-side hook end to end: real clients, a real broker, kiproxy as a subprocess.

On Tansu and on Apache Kafka (the ``upstream`` fixture). One proxy serves the module
with routes: ``rev-`` topics run ``tp_fetch:Reverse`` (values reversed on produce,
reversed back on consume), ``up-`` topics the fetch-side-only ``UpperOnConsume``,
``bad-`` topics ``RefuseOnConsume`` (refuse, raise, grow, slow), ``sync-`` topics the
plain ``PlainOnConsume`` (slow, or raising on a ``poison`` record), ``obsroute-`` and
``obslink-`` topics ``UpperOnConsume`` on a route and on a link in observe mode, anything
else no hook.

What is checked: every codec round-trips exactly (values, keys, headers and their
order) through the proxy while the broker stores the produced transformation; a
consumer straight to the broker sees what is stored; transactional producers and a
read_committed consumer through the proxy see exactly the committed records; a hook
that refuses, raises, breaks the record count or misses its deadline costs the
consumer that partition only (another topic in the same consumer is served, the
proxy logs the refusal, with the traceback of a hook that raised, the connection stays
open), a plain hook past its deadline included; a batch a hook fails on stops
confluent-kafka, kafka-python and aiokafka consumers at that batch, every record before
it read (not at the start of the answer it came in); a Fetch answer on a topic with no
hook is the broker's bytes, and one whose hook is in observe mode (on its route or its
link) the broker's records; the ApiVersions answer offers only the Fetch versions the
proxy decodes; the Java client and kafka-python consume through the proxy too.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ProxyProcess, Upstream, launch_proxy, tansu_gap
from hardening.fault_relay import wait_until
from support.confluent import confluent_producer

from kiproxy.protocol.fetch_batches import split_fetched_records
from kiproxy.protocol.fetch_response import read_fetch_response
from kiproxy.protocol.messages import ApiKey

pytestmark = pytest.mark.timeout(240)

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
CODECS = ("none", "gzip", "snappy", "lz4", "zstd")
ROUTES = {
    "routes": [
        {"name": "reverse", "match": {"topic": "rev-.*"},
         "interceptors": [{"class": "tp_fetch:Reverse"}]},
        {"name": "upper", "match": {"topic": "up-.*"},
         "interceptors": [{"class": "tp_fetch:UpperOnConsume"}]},
        {"name": "bad", "match": {"topic": "bad-.*"},
         "interceptors": [{"class": "tp_fetch:RefuseOnConsume", "timeout_ms": 300}]},
        {"name": "plain", "match": {"topic": "sync-.*"},
         "interceptors": [{"class": "tp_fetch:PlainOnConsume", "timeout_ms": 300}]},
        {"name": "observed-route", "match": {"topic": "obsroute-.*"}, "mode": "observe",
         "interceptors": [{"class": "tp_fetch:UpperOnConsume"}]},
        {"name": "observed-link", "match": {"topic": "obslink-.*"},
         "interceptors": [{"class": "tp_fetch:UpperOnConsume", "mode": "observe"}]},
    ]
}


@pytest.fixture(scope="module")
def proxy(upstream: Upstream, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[ProxyProcess]:
    config = tmp_path_factory.mktemp("fetch") / "kiproxy.json"
    config.write_text(json.dumps(ROUTES))
    p = launch_proxy(upstream.bootstrap, plugins_dir=PLUGINS, config_file=config,
                     node_ids=upstream.node_ids)
    yield p
    p.stop()


def _create(bootstrap: str, *topics: str) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(t, num_partitions=1, replication_factor=1)
                                   for t in topics], operation_timeout=10)
    for future in futures.values():
        future.result(timeout=15)


def _produce(bootstrap: str, topic: str, values: list[bytes], **conf: Any) -> None:
    producer = confluent_producer({"bootstrap.servers": bootstrap, "linger.ms": 20,
                                   "message.timeout.ms": 20000, **conf})
    for i, value in enumerate(values):
        producer.produce(topic, value=value, key=f"k{i}".encode(), partition=0,
                         headers=[("h", b"2"), ("a", b"1"), ("h", None)])
    assert producer.flush(20) == 0


def _read(bootstrap: str, topics: list[str], count: int, timeout: float = 20,
          **conf: Any) -> list[Any]:
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"g-{uuid.uuid4().hex}",
                         "enable.auto.commit": False, "auto.offset.reset": "earliest",
                         **conf})
    try:
        consumer.assign([TopicPartition(t, 0, 0) for t in topics])
        out: list[Any] = []
        errors: list[Any] = []
        import time
        deadline = time.monotonic() + timeout
        while len(out) < count and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                errors.append(msg.error())
                continue
            out.append(msg)
        return out
    finally:
        consumer.close()


def _transactions(bootstrap: str, topic: str, count: int) -> None:
    """An aborted, then a committed transaction of ``count`` records each (values
    ``abort 0``..., ``commit 0``...) to partition 0, zstd."""
    for outcome in ("abort", "commit"):
        producer = confluent_producer({
            "bootstrap.servers": bootstrap, "compression.type": "zstd",
            "transactional.id": f"tx-{uuid.uuid4().hex[:8]}", "message.timeout.ms": 20000})
        producer.init_transactions(20)
        producer.begin_transaction()
        for i in range(count):
            producer.produce(topic, value=f"{outcome} {i}".encode(), partition=0)
        producer.flush(20)
        getattr(producer, f"{outcome}_transaction")(20)


@pytest.mark.parametrize("codec", CODECS)
def test_every_codec_round_trips_through_both_hooks(upstream: Upstream, proxy: ProxyProcess,
                                                    codec: str) -> None:
    topic = f"rev-{codec}-{uuid.uuid4().hex[:6]}"
    _create(upstream.bootstrap, topic)
    values = [f"value {i} of {codec} ".encode() * (1 + i % 7) for i in range(200)]
    values[7] = b""
    _produce(proxy.bootstrap, topic, values, **{"compression.type": codec})
    through = _read(proxy.bootstrap, [topic], len(values))
    assert [m.value() for m in through] == values
    assert [m.key() for m in through] == [f"k{i}".encode() for i in range(len(values))]
    assert all(m.headers() == [("h", b"2"), ("a", b"1"), ("h", None)] for m in through)
    assert [m.offset() for m in through] == list(range(len(values)))
    direct = _read(upstream.bootstrap, [topic], len(values))
    assert [m.value() for m in direct] == [v[::-1] for v in values]  # what is stored
    assert [m.timestamp() for m in direct] == [m.timestamp() for m in through]


def test_a_fetch_side_only_hook_changes_what_consumers_read(
        upstream: Upstream, proxy: ProxyProcess) -> None:
    topic = f"up-{uuid.uuid4().hex[:6]}"
    _create(upstream.bootstrap, topic)
    _produce(proxy.bootstrap, topic, [b"quiet", b"words"], **{"compression.type": "lz4"})
    assert [m.value() for m in _read(upstream.bootstrap, [topic], 2)] == [b"quiet", b"words"]
    assert [m.value() for m in _read(proxy.bootstrap, [topic], 2)] == [b"QUIET", b"WORDS"]


@pytest.mark.parametrize("prefix", ["obsroute", "obslink"])
def test_a_fetch_side_hook_in_observe_mode_leaves_what_consumers_read(
        upstream: Upstream, proxy: ProxyProcess, prefix: str) -> None:
    """Observe mode forwards as received, on a route as on a link: a consumer reads
    the broker's records, not the hook's."""
    topic = f"{prefix}-{uuid.uuid4().hex[:6]}"
    _create(upstream.bootstrap, topic)
    _produce(proxy.bootstrap, topic, [b"quiet", b"words"], **{"compression.type": "lz4"})
    assert [m.value() for m in _read(proxy.bootstrap, [topic], 2)] == [b"quiet", b"words"]


def test_read_committed_through_the_proxy_sees_exactly_the_committed_records(
        upstream: Upstream, proxy: ProxyProcess, request: pytest.FixtureRequest) -> None:
    tansu_gap(upstream, request, "a Fetch answer names no aborted transaction, so a "
              "read_committed consumer reads aborted records (direct too)")
    topic = f"rev-tx-{uuid.uuid4().hex[:6]}"
    _create(upstream.bootstrap, topic)
    _transactions(proxy.bootstrap, topic, 5)
    _produce(proxy.bootstrap, topic, [b"after"])
    committed = _read(proxy.bootstrap, [topic], 6, timeout=15,
                      **{"isolation.level": "read_committed"})
    assert [m.value() for m in committed] == [f"commit {i}".encode() for i in range(5)] + [
        b"after"]
    everything = _read(proxy.bootstrap, [topic], 11, timeout=15,
                       **{"isolation.level": "read_uncommitted"})
    assert [m.value() for m in everything] == [
        *(f"abort {i}".encode() for i in range(5)), *(f"commit {i}".encode() for i in range(5)),
        b"after"]


def _traceback(line: str, last: str) -> bool:
    """Whether the log ``line`` carries a traceback through tp_fetch.py ending in
    ``last``."""
    return "Traceback (most recent call last)" in line and "tp_fetch.py" in line \
        and last in line


@pytest.mark.parametrize("fault", ["refuse", "raise", "grow", "slow"])
def test_a_failing_hook_costs_only_its_partition(upstream: Upstream, proxy: ProxyProcess,
                                                 fault: str) -> None:
    bad = f"bad-{fault}-{uuid.uuid4().hex[:6]}"
    good = f"bad-fine-{uuid.uuid4().hex[:6]}"
    plain = f"plain-{uuid.uuid4().hex[:6]}"
    _create(upstream.bootstrap, bad, good, plain)
    for topic in (bad, good, plain):
        _produce(proxy.bootstrap, topic, [b"one", b"two"])
    seen = len(proxy.lines)
    got = _read(proxy.bootstrap, [bad, good, plain], 4, timeout=8)
    assert sorted((m.topic(), m.value()) for m in got) == sorted(
        [(good, b"one"), (good, b"two"), (plain, b"one"), (plain, b"two")])
    assert wait_until(lambda: any(bad in line and "answered with an error" in line
                                  for line in proxy.lines[seen:]), 5), proxy.log
    if fault == "raise":  # the hook's traceback, as for a produce-side plugin
        assert wait_until(lambda: any(_traceback(line, "RuntimeError: the hook broke")
                                      for line in proxy.lines[seen:]), 5), proxy.log
    assert proxy.alive()
    # Straight to the broker the records are there: the hook refused only the reading.
    assert len(_read(upstream.bootstrap, [bad], 2)) == 2


def test_a_plain_hook_that_returns_past_its_deadline_costs_its_partition(
        upstream: Upstream, proxy: ProxyProcess) -> None:
    """A plain hook cannot be stopped at ``timeout_ms``; what it returns late is refused
    as an ``async def`` hook's is (the consumer gets no records from that partition)."""
    slow = f"sync-slow-{uuid.uuid4().hex[:6]}"
    good = f"sync-fine-{uuid.uuid4().hex[:6]}"
    _create(upstream.bootstrap, slow, good)
    for topic in (slow, good):
        _produce(proxy.bootstrap, topic, [b"one", b"two"])
    seen = len(proxy.lines)
    got = _read(proxy.bootstrap, [slow, good], 4, timeout=8)
    assert sorted((m.topic(), m.value()) for m in got) == [(good, b"one"), (good, b"two")]
    assert wait_until(lambda: any(  # the route named, as a produce-side rejection names it
        f"on route plain: {slow}[0] answered with an error: batch at offset 0: "
        "tp_fetch:PlainOnConsume did not answer within 300 ms" in line
        for line in proxy.lines[seen:]), 5), proxy.log
    assert len(_read(upstream.bootstrap, [slow], 2)) == 2


POISONED = [*(f"record {i}".encode() for i in range(10)), b"poison",
            *(f"after {i}".encode() for i in range(3))]


def _poisoned_topic(upstream: Upstream) -> str:
    """A topic holding :data:`POISONED`, one batch per record (the poison at offset 10)."""
    topic = f"sync-poison-{uuid.uuid4().hex[:6]}"
    _create(upstream.bootstrap, topic)
    producer = confluent_producer({"bootstrap.servers": upstream.bootstrap, "linger.ms": 0,
                                   "message.timeout.ms": 20000})
    for value in POISONED:
        producer.produce(topic, value=value, partition=0)
        assert producer.flush(20) == 0
    return topic


def _confluent_up_to_the_error(bootstrap: str, topic: str) -> tuple[list[bytes], int, Any]:
    """What a confluent-kafka consumer reads from offset 0 until its first error: the
    values, its position then and the error."""
    from confluent_kafka import Consumer, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"g-{uuid.uuid4().hex}",
                         "enable.auto.commit": False})
    try:
        consumer.assign([TopicPartition(topic, 0, 0)])
        values: list[bytes] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            if msg.error():
                (position,) = consumer.position([TopicPartition(topic, 0)])
                return values, position.offset, msg.error()
            values.append(msg.value())
        raise AssertionError(f"no error in 30 s; read {values}")
    finally:
        consumer.close()


def _kafka_python_up_to_the_error(bootstrap: str, topic: str
                                  ) -> tuple[list[bytes], int, Any]:
    """:func:`_confluent_up_to_the_error` with kafka-python (which raises the error)."""
    from kafka import KafkaConsumer, TopicPartition
    from kafka.errors import KafkaError

    consumer = KafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
    tp = TopicPartition(topic, 0)
    try:
        consumer.assign([tp])
        consumer.seek(tp, 0)
        values: list[bytes] = []
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                batches = consumer.poll(timeout_ms=500)
            except KafkaError as exc:
                return values, consumer.position(tp), exc
            values.extend(m.value for m in batches.get(tp, ()))
        raise AssertionError(f"no error in 30 s; read {values}")
    finally:
        consumer.close()


def _aiokafka_up_to_the_error(bootstrap: str, topic: str, caplog: pytest.LogCaptureFixture
                              ) -> tuple[list[bytes], int, Any]:
    """:func:`_confluent_up_to_the_error` with aiokafka (which logs the error, a WARNING
    from its fetcher, and fetches again)."""
    from aiokafka import AIOKafkaConsumer, TopicPartition

    async def read() -> tuple[list[bytes], int, Any]:
        consumer = AIOKafkaConsumer(bootstrap_servers=bootstrap, enable_auto_commit=False)
        tp = TopicPartition(topic, 0)
        await consumer.start()
        try:
            consumer.assign([tp])
            consumer.seek(tp, 0)
            values: list[bytes] = []
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                errors = [r for r in caplog.records if "while fetching data: UnknownError"
                          in r.getMessage()]  # aiokafka's name for UNKNOWN_SERVER_ERROR
                if errors:
                    return values, await consumer.position(tp), errors[0].getMessage()
                batches = await consumer.getmany(tp, timeout_ms=500)
                values.extend(m.value for m in batches.get(tp, ()))
            raise AssertionError(f"no error in 30 s; read {values}")
        finally:
            await consumer.stop()

    with caplog.at_level("WARNING", "aiokafka"):
        return asyncio.run(read())


@pytest.mark.parametrize("client", ["confluent-kafka", "kafka-python", "aiokafka"])
def test_a_batch_a_hook_fails_on_stops_the_consumer_there(
        upstream: Upstream, proxy: ProxyProcess, client: str,
        caplog: pytest.LogCaptureFixture) -> None:
    """Ten good batches and one the hook raises on (offset 10), fetched in one answer:
    the consumer reads the ten, then gets the error with its position at 10; the log
    names that batch, with the hook's traceback."""
    topic = _poisoned_topic(upstream)
    seen = len(proxy.lines)
    if client == "aiokafka":
        values, position, error = _aiokafka_up_to_the_error(proxy.bootstrap, topic, caplog)
    else:
        read = _confluent_up_to_the_error if client == "confluent-kafka" \
            else _kafka_python_up_to_the_error
        values, position, error = read(proxy.bootstrap, topic)
    assert values == POISONED[:10]
    assert position == 10
    assert "UNKNOWN" in str(error).upper(), error
    assert wait_until(lambda: any(
        f"{topic}[0] answered with an error: batch at offset 10: tp_fetch:PlainOnConsume "
        "raised KeyError: 'boom'" in line for line in proxy.lines[seen:]), 5), proxy.log
    assert wait_until(lambda: any(_traceback(line, "KeyError: 'boom'")
                                  for line in proxy.lines[seen:]), 5), proxy.log


def test_an_answer_on_a_topic_without_a_hook_is_the_brokers_bytes(
        upstream: Upstream, proxy: ProxyProcess) -> None:
    from support.raw_client import RawClient

    from integration.test_fetch_layout import Written, _fetch, _metadata_topic_id

    topic = f"plain-bytes-{uuid.uuid4().hex[:6]}"
    _create(upstream.bootstrap, topic)
    _produce(upstream.bootstrap, topic, [b"a" * 100, b"b" * 100], **{"compression.type": "gzip"})
    with RawClient(upstream.bootstrap) as client:
        topic_id = _metadata_topic_id(client, topic)
    with RawClient(proxy.bootstrap) as client:  # the proxy learns the id, as a consumer's
        assert _metadata_topic_id(client, topic) == topic_id
    written = Written(topic, topic_id, 2, 0)
    for version in (4, 12, 13):
        direct, _ = _fetch(upstream.bootstrap, version, written)
        through, _ = _fetch(proxy.bootstrap, version, written)
        assert through == direct, f"Fetch v{version}"


def test_api_versions_offers_only_what_the_proxy_decodes(proxy: ProxyProcess) -> None:
    from support.raw_client import RawClient

    from kiproxy.protocol.messages import request_type

    cls = request_type(ApiKey.API_VERSIONS, 3)
    with RawClient(proxy.bootstrap) as client:
        answer = client.request(ApiKey.API_VERSIONS, 3, cls(
            client_software_name="t", client_software_version="1"))
    offered = {k.api_key: (k.min_version, k.max_version) for k in answer.api_keys}
    low, high = offered[ApiKey.FETCH]
    assert low >= 4 and high <= 18


def test_kafka_python_consumes_through_the_hook(upstream: Upstream,
                                                proxy: ProxyProcess) -> None:
    from kafka import KafkaConsumer, TopicPartition

    topic = f"rev-kp-{uuid.uuid4().hex[:6]}"
    _create(upstream.bootstrap, topic)
    values = [f"kafka-python {i}".encode() for i in range(50)]
    _produce(proxy.bootstrap, topic, values, **{"compression.type": "snappy"})
    consumer = KafkaConsumer(bootstrap_servers=proxy.bootstrap, enable_auto_commit=False,
                             auto_offset_reset="earliest", consumer_timeout_ms=10000)
    try:
        consumer.assign([TopicPartition(topic, 0)])
        consumer.seek_to_beginning()
        got = [m.value for _, m in zip(range(len(values)), consumer, strict=False)]
    finally:
        consumer.close()
    assert got == values


def test_a_hook_that_returns_equal_records_sends_the_brokers_bytes(
        upstream: Upstream, proxy: ProxyProcess) -> None:
    """A hook that rebuilds every record but changes none (upper-casing values that are
    upper case already) is taken as unchanged, as on produce: the batch is not
    re-encoded, and the consumer gets the broker's bytes."""
    from support.raw_client import RawClient

    from integration.test_fetch_layout import Written, _fetch, _metadata_topic_id

    topic = f"up-same-{uuid.uuid4().hex[:6]}"
    _create(upstream.bootstrap, topic)
    for codec in CODECS:
        _produce(upstream.bootstrap, topic, [f"{codec} {i} ".upper().encode() * 30
                                             for i in range(4)],
                 **{"compression.type": codec})
    with RawClient(proxy.bootstrap) as client:
        topic_id = _metadata_topic_id(client, topic)
    written = Written(topic, topic_id, 0, 0)
    direct, _ = _fetch(upstream.bootstrap, 12, written)
    through, _ = _fetch(proxy.bootstrap, 12, written)
    assert through == direct


@pytest.mark.parametrize("max_bytes", [1 << 20, 1500])
def test_a_hooked_answer_no_hook_changed_is_the_brokers_bytes(
        upstream: Upstream, proxy: ProxyProcess, max_bytes: int) -> None:
    """On a hooked topic whose hook changes nothing, the answer is byte for byte the
    broker's: control batches (both transaction markers), every codec and, at a byte
    limit below the partition's size, the cut last batch (Kafka cuts; Tansu sends whole
    batches only)."""
    from support.raw_client import RawClient

    from integration.test_fetch_layout import Written, _fetch, _metadata_topic_id

    topic = f"bad-fine-{uuid.uuid4().hex[:6]}"
    _create(upstream.bootstrap, topic)
    for codec in CODECS:
        _produce(upstream.bootstrap, topic, [f"{codec} {i} ".encode() * 30 for i in range(4)],
                 **{"compression.type": codec})
    _transactions(upstream.bootstrap, topic, 1)
    with RawClient(proxy.bootstrap) as client:
        topic_id = _metadata_topic_id(client, topic)
    written = Written(topic, topic_id, 0, 0)
    cut = []
    for version in (4, 12, 13):
        for isolation in (0, 1):
            for _ in range(50):  # the answer through the proxy, between two equal direct ones
                direct, body = _fetch(upstream.bootstrap, version, written, max_bytes,
                                      isolation)
                through, _ = _fetch(proxy.bootstrap, version, written, max_bytes, isolation)
                again, _ = _fetch(upstream.bootstrap, version, written, max_bytes, isolation)
                if again == direct:  # else the log moved meanwhile (a marker, the LSO)
                    break
                time.sleep(0.1)
            assert again == direct, "the partition kept changing"
            assert through == direct, f"Fetch v{version}, isolation {isolation}"
            layout = read_fetch_response(direct, body, version)
            (part,) = layout.topics[0].partitions
            cut.append(split_fetched_records(direct, part.data_start, part.data_end).partial)
    # Kafka cuts the last batch at the byte limit (past a first batch it always sends whole).
    assert any(cut) == (upstream.name == "kafka" and max_bytes < 1 << 20), cut


def test_the_java_client_round_trips_through_both_hooks(upstream: Upstream,
                                                        proxy: ProxyProcess) -> None:
    from support.apache_kafka import kafka_home_or_skip
    from support.java_client import JavaClient

    if upstream.name == "tansu":
        pytest.skip("the Java client is checked against Apache Kafka here (on Tansu, "
                    "librdkafka and kafka-python cover the fetch path)")
    client = JavaClient.build(kafka_home_or_skip())
    topic = f"rev-java-{uuid.uuid4().hex[:6]}"
    _create(upstream.bootstrap, topic)
    produced = client.produce(proxy.bootstrap, topic, 20, compression="zstd",
                              idempotent=True, headers=[("t", "1"), ("t", "2")],
                              value_prefix="java-")
    assert produced.returncode == 0, produced.stderr
    protocol = "classic" if upstream.name == "tansu" else "consumer"  # Tansu: no KIP-848
    consumed = client.consume(proxy.bootstrap, topic, 20, group=f"g-{topic}",
                              isolation="read_committed", group_protocol=protocol)
    assert consumed.returncode == 0, consumed.stderr
    records = consumed.of("record")
    assert [(r["key"], r["value"], r["offset"]) for r in records] == [
        (f"key-{i}", f"java-{i}", i) for i in range(20)]
    assert all(r["headers"] == [["t", "1"], ["t", "2"]] for r in records)
    stored = _read(upstream.bootstrap, [topic], 20)
    assert [m.value() for m in stored] == [f"java-{i}"[::-1].encode() for i in range(20)]


def test_a_large_batch_is_decoded_and_re_encoded_off_the_loop_and_round_trips(
        upstream: Upstream, proxy: ProxyProcess) -> None:
    """A 2 MB batch (past the inline decode and encode bounds) round-trips exactly."""
    topic = f"rev-big-{uuid.uuid4().hex[:6]}"
    _create(upstream.bootstrap, topic)
    values = [f"{i:06d}".encode() * 170 for i in range(2000)]  # 1020 B each
    _produce(proxy.bootstrap, topic, values, **{
        "compression.type": "zstd", "batch.size": 4_000_000, "linger.ms": 500,
        "message.max.bytes": 4_000_000})
    through = _read(proxy.bootstrap, [topic], len(values), **{
        "fetch.max.bytes": 8_000_000, "max.partition.fetch.bytes": 8_000_000})
    assert [m.value() for m in through] == values
