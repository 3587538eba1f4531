"""``record_encryption`` end to end: ``kiproxy run`` as a subprocess in front of a real
broker (Tansu, then Apache Kafka: the ``upstream`` fixture), real clients.

The proxy encrypts ``enc-`` topics (``pass-`` topics too, with ``on_undecryptable:
pass``) under a key file's KEK. What is checked: every codec round-trips through the
proxy exactly (values, keys, headers and their order, offsets, tombstones) while a
consumer straight to the broker reads no plaintext value; a topic outside ``topics:``
is stored as it comes; plaintext records written straight to an encrypted topic reach
consumers through the proxy unchanged; a record that does not decrypt stops the
consumer at its batch, the records before it read (another topic of the same consumer
is served) or, with ``pass``, reaches it as stored; transactional producers and a
read_committed consumer see exactly the committed records. A reload that would name a
key the key file lacks is refused, and records stay sealed.
"""

from __future__ import annotations

import json
import os
import urllib.error
import urllib.request
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import ProxyProcess, Upstream, launch_proxy, tansu_gap
from hardening.fault_relay import wait_until
from support.confluent import confluent_producer

from integration.test_fetch_hook import _create, _produce, _read, _transactions
from kiproxy.interceptors.builtin.record_encryption import MARKER_HEADER
from kiproxy.interceptors.builtin.record_encryption.key_file import write_key_file
from kiproxy_dev.tansu import EmbeddedBroker, free_port

pytestmark = pytest.mark.timeout(240)

CODECS = ("none", "gzip", "snappy", "lz4", "zstd")
HEADERS = [("h", b"2"), ("a", b"1"), ("h", None)]  # what _produce sends


@pytest.fixture(scope="module")
def proxy(upstream: Upstream, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[ProxyProcess]:
    keys = tmp_path_factory.mktemp("keys") / "keys.yaml"
    write_key_file(keys, {"KEK": (1, {1: os.urandom(32)})})
    config = {"kms": {"type": "key_file", "path": str(keys)}, "key": "KEK",
              "topics": {"enc-.*": {}, "pass-.*": {"on_undecryptable": "pass"}}}
    metrics = f"127.0.0.1:{free_port()}"
    p = launch_proxy(upstream.bootstrap, "--metrics-listen", metrics,
                     interceptor="record_encryption", interceptor_config=config,
                     node_ids=upstream.node_ids)
    p.metrics = metrics  # type: ignore[attr-defined]
    yield p
    p.stop()


def _metric(proxy: ProxyProcess, name: str) -> float:
    with urllib.request.urlopen(f"http://{proxy.metrics}/metrics",  # type: ignore[attr-defined]
                                timeout=10) as answer:
        text = answer.read().decode()
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(f"kiproxy_interceptor_{name}_total{{"))


def _write_config(path: Any, upstream: str, metrics: str, settings: dict[str, Any]) -> None:
    """A proxy configuration file running ``record_encryption`` with ``settings``."""
    path.write_text(json.dumps({
        "upstream": [upstream], "metrics_listen": metrics,
        "interceptor": {"class": "record_encryption", "config": settings}}))


def _reload(metrics: str) -> tuple[int, dict[str, Any]]:
    """``POST /reload``: its status and JSON answer (a refusal's included)."""
    request = urllib.request.Request(f"http://{metrics}/reload", method="POST", data=b"")
    try:
        with urllib.request.urlopen(request, timeout=60) as answer:
            return int(answer.status), json.loads(answer.read())
    except urllib.error.HTTPError as refused:
        return refused.code, json.loads(refused.read())


@pytest.mark.parametrize("codec", CODECS)
def test_every_codec_round_trips_and_the_broker_holds_no_plaintext(
        upstream: Upstream, proxy: ProxyProcess, codec: str) -> None:
    topic = f"enc-{codec}-{uuid.uuid4().hex[:6]}"
    _create(upstream.bootstrap, topic)
    encrypted = _metric(proxy, "record_encryption_records_encrypted")
    decrypted = _metric(proxy, "record_encryption_records_decrypted")
    values = [f"secret {i} of {codec} ".encode() * (1 + i % 7) for i in range(200)]
    values[7] = b""
    _produce(proxy.bootstrap, topic, values, **{"compression.type": codec})
    producer = confluent_producer({"bootstrap.servers": proxy.bootstrap,
                                   "compression.type": codec})
    producer.produce(topic, value=None, key=b"gone", partition=0)  # a tombstone
    assert producer.flush(20) == 0

    through = _read(proxy.bootstrap, [topic], len(values) + 1)
    assert [m.value() for m in through] == [*values, None]
    assert [m.key() for m in through] == [f"k{i}".encode() for i in range(200)] + [b"gone"]
    assert all(m.headers() == HEADERS for m in through[:-1])
    assert [m.offset() for m in through] == list(range(len(values) + 1))

    direct = _read(upstream.bootstrap, [topic], len(values) + 1)
    assert [m.key() for m in direct] == [m.key() for m in through]
    assert [m.timestamp() for m in direct] == [m.timestamp() for m in through]
    for stored, value in zip(direct[:-1], values, strict=True):
        assert b"secret" not in stored.value() and stored.value() != value
        assert [k for k, _ in stored.headers()] == ["h", "a", "h", MARKER_HEADER]
    assert direct[-1].value() is None  # a tombstone stays a tombstone
    assert _metric(proxy, "record_encryption_records_encrypted") == encrypted + 200
    assert _metric(proxy, "record_encryption_records_decrypted") >= decrypted + 200


def test_other_topics_and_plaintext_records_pass_as_they_are(
        upstream: Upstream, proxy: ProxyProcess) -> None:
    plain, mixed = f"plain-{uuid.uuid4().hex[:6]}", f"enc-mixed-{uuid.uuid4().hex[:6]}"
    _create(upstream.bootstrap, plain, mixed)
    _produce(proxy.bootstrap, plain, [b"not a secret"])
    assert [m.value() for m in _read(upstream.bootstrap, [plain], 1)] == [b"not a secret"]
    _produce(upstream.bootstrap, mixed, [b"written before encryption"])
    _produce(proxy.bootstrap, mixed, [b"written through the proxy"])
    through = _read(proxy.bootstrap, [mixed], 2)
    assert [m.value() for m in through] == [b"written before encryption",
                                            b"written through the proxy"]
    assert all(m.headers() == HEADERS for m in through)


def _forged(bootstrap: str, topic: str) -> None:
    """A record that claims to be sealed and is not, written straight to the broker."""
    producer = confluent_producer({"bootstrap.servers": bootstrap})
    producer.produce(topic, value=b"not really sealed", partition=0,
                     headers=[(MARKER_HEADER, b"\x01\x01\x00\x03KEK\x00\x01x\x00")])
    assert producer.flush(20) == 0


def test_a_record_that_does_not_decrypt_costs_its_partition_or_passes_as_stored(
        upstream: Upstream, proxy: ProxyProcess) -> None:
    bad, good = f"enc-bad-{uuid.uuid4().hex[:6]}", f"enc-good-{uuid.uuid4().hex[:6]}"
    passing = f"pass-{uuid.uuid4().hex[:6]}"
    _create(upstream.bootstrap, bad, good, passing)
    for topic in (bad, good, passing):
        _produce(proxy.bootstrap, topic, [b"sealed"])
    _forged(upstream.bootstrap, bad)
    _forged(upstream.bootstrap, passing)
    seen = len(proxy.lines)
    got = _read(proxy.bootstrap, [bad, good, passing], 5, timeout=8)
    assert sorted((m.topic(), m.value()) for m in got) == sorted(  # bad: up to the forgery
        [(bad, b"sealed"), (good, b"sealed"), (passing, b"sealed"),
         (passing, b"not really sealed")])
    assert wait_until(lambda: any(bad in line and "does not decrypt" in line
                                  for line in proxy.lines[seen:]), 5), proxy.log
    assert proxy.alive()


def test_read_committed_through_the_proxy_sees_exactly_the_committed_records(
        upstream: Upstream, proxy: ProxyProcess, request: pytest.FixtureRequest) -> None:
    tansu_gap(upstream, request, "a Fetch answer names no aborted transaction, so a "
              "read_committed consumer reads aborted records (direct too)")
    topic = f"enc-tx-{uuid.uuid4().hex[:6]}"
    _create(upstream.bootstrap, topic)
    _transactions(proxy.bootstrap, topic, 5)
    _produce(proxy.bootstrap, topic, [b"after"], **{"enable.idempotence": True})
    committed = _read(proxy.bootstrap, [topic], 6, timeout=15,
                      **{"isolation.level": "read_committed"})
    assert [m.value() for m in committed] == [f"commit {i}".encode() for i in range(5)] + [
        b"after"]
    direct = _read(upstream.bootstrap, [topic], 6, timeout=15,
                   **{"isolation.level": "read_committed"})
    assert all(b"commit" not in m.value() for m in direct)


def _sealed_everywhere(bootstrap: str, topic: str, values: list[bytes]) -> list[Any]:
    """Read ``topic`` straight from the broker: every value sealed, none in plaintext."""
    stored = _read(bootstrap, [topic], len(values))
    assert len(stored) == len(values)
    assert not any(m.value() in values for m in stored)
    assert all((m.headers() or [])[-1][0] == MARKER_HEADER for m in stored)
    return stored


def test_kafka_python_produces_and_consumes_through_the_proxy(
        upstream: Upstream, proxy: ProxyProcess) -> None:
    from kafka import KafkaConsumer, KafkaProducer, TopicPartition

    topic = f"enc-kp-{uuid.uuid4().hex[:6]}"
    _create(upstream.bootstrap, topic)
    values = [f"kafka-python secret {i}".encode() for i in range(60)]
    producer = KafkaProducer(bootstrap_servers=proxy.bootstrap, compression_type="gzip",
                             linger_ms=20)
    for i, value in enumerate(values):
        producer.send(topic, value=value, key=b"k%d" % i, partition=0,
                      headers=[("trace", b"t%d" % i)])
    producer.flush(20)
    producer.close()
    consumer = KafkaConsumer(bootstrap_servers=proxy.bootstrap, enable_auto_commit=False,
                             auto_offset_reset="earliest", consumer_timeout_ms=10000)
    try:
        consumer.assign([TopicPartition(topic, 0)])
        consumer.seek_to_beginning()
        got = [m for _, m in zip(range(len(values)), consumer, strict=False)]
    finally:
        consumer.close()
    assert [m.value for m in got] == values
    assert [m.headers for m in got] == [[("trace", b"t%d" % i)] for i in range(len(values))]
    _sealed_everywhere(upstream.bootstrap, topic, values)


def test_the_java_client_produces_idempotently_and_reads_committed_through_the_proxy(
        upstream: Upstream, proxy: ProxyProcess) -> None:
    if upstream.name == "tansu":
        pytest.skip("the Java client is checked against Apache Kafka (on Tansu, librdkafka "
                    "and kafka-python cover the same path)")
    from support.apache_kafka import kafka_home_or_skip
    from support.java_client import JavaClient

    client = JavaClient.build(kafka_home_or_skip())
    topic = f"enc-java-{uuid.uuid4().hex[:6]}"
    _create(upstream.bootstrap, topic)
    produced = client.produce(proxy.bootstrap, topic, 30, compression="zstd", idempotent=True,
                              headers=[("t", "1"), ("t", "2")], value_prefix="java-secret-")
    assert produced.returncode == 0, produced.stderr
    protocol = "classic" if upstream.name == "tansu" else "consumer"  # Tansu: no KIP-848
    consumed = client.consume(proxy.bootstrap, topic, 30, group=f"g-{topic}",
                              isolation="read_committed", group_protocol=protocol)
    assert consumed.returncode == 0, consumed.stderr
    records = consumed.of("record")
    assert [(r["key"], r["value"], r["offset"]) for r in records] == [
        (f"key-{i}", f"java-secret-{i}", i) for i in range(30)]
    assert all(r["headers"] == [["t", "1"], ["t", "2"]] for r in records)
    _sealed_everywhere(upstream.bootstrap, topic, [f"java-secret-{i}".encode()
                                                   for i in range(30)])


def test_data_keys_rotate_under_load_and_every_key_still_opens(
        upstream: Upstream, tmp_path: Any) -> None:
    """Four producers at once through a proxy whose data keys seal 50 values each: the
    stored records name many data keys, and a consumer through the proxy reads every
    value as produced."""
    import threading

    keys = tmp_path / "keys.yaml"
    write_key_file(keys, {"KEK": (1, {1: os.urandom(32)})})
    rotating = launch_proxy(upstream.bootstrap, interceptor="record_encryption",
                            interceptor_config={
                                "kms": {"type": "key_file", "path": str(keys)}, "key": "KEK",
                                "data_keys": {"max_encryptions_per_key": 50}},
                            node_ids=upstream.node_ids)
    try:
        topic = f"enc-rotate-{uuid.uuid4().hex[:6]}"
        _create(upstream.bootstrap, topic)
        batches = {w: [f"writer {w} value {i}".encode() for i in range(500)] for w in range(4)}
        writers = [threading.Thread(target=_produce, args=(rotating.bootstrap, topic, vals))
                   for vals in batches.values()]
        for writer in writers:
            writer.start()
        for writer in writers:
            writer.join(60)
        everything = [v for vals in batches.values() for v in vals]
        through = _read(rotating.bootstrap, [topic], len(everything), timeout=60)
        assert sorted(m.value() for m in through) == sorted(everything)
        stored = _sealed_everywhere(upstream.bootstrap, topic, everything)
        markers = {(m.headers() or [])[-1][1] for m in stored}
        assert len(markers) >= len(everything) // 50  # a data key seals at most 50 values
    finally:
        rotating.stop()


def test_a_reload_to_a_key_the_key_file_lacks_is_refused_and_records_stay_sealed(
        broker: EmbeddedBroker, tmp_path: Any) -> None:
    """``key: KEK_kf`` names one key for every topic; a reload to ``KEK_missing``, which
    the key file does not hold, would store every record in clear (``unresolved_key:
    pass``): it is refused, naming the key and the file, and the running configuration
    stays."""
    keys = tmp_path / "keys.yaml"
    write_key_file(keys, {"KEK_kf": (1, {1: os.urandom(32)})})
    metrics = f"127.0.0.1:{free_port()}"
    config = tmp_path / "proxy.yaml"

    def write(key: str) -> None:
        _write_config(config, broker.bootstrap, metrics,
                      {"kms": {"type": "key_file", "path": str(keys)}, "key": key})

    write("KEK_kf")
    proxy = launch_proxy(broker.bootstrap, config_file=config)
    topic = f"kf-{uuid.uuid4().hex[:6]}"
    _create(broker.bootstrap, topic)
    try:
        _produce(proxy.bootstrap, topic, [b"before the reload"])
        write("KEK_missing")
        status, answer = _reload(metrics)
        assert status == 500 and answer["ok"] is False, answer
        assert f"key: key file {keys} has no key 'KEK_missing' (it has ['KEK_kf'])" in \
            answer["message"], answer
        _produce(proxy.bootstrap, topic, [b"after the reload"])
        _sealed_everywhere(broker.bootstrap, topic, [b"before the reload", b"after the reload"])
        assert [m.value() for m in _read(proxy.bootstrap, [topic], 2)] == [
            b"before the reload", b"after the reload"]
    finally:
        proxy.stop()


def test_its_counters_go_on_from_their_totals_across_a_reload(
        broker: EmbeddedBroker, tmp_path: Any) -> None:
    """A reload builds a new interceptor; ``records_encrypted`` goes on from what the
    replaced one counted, not from 0 (a counter that drops reads as a reset)."""
    keys = tmp_path / "keys.yaml"
    write_key_file(keys, {"KEK": (1, {1: os.urandom(32)})})
    metrics = f"127.0.0.1:{free_port()}"
    config = tmp_path / "proxy.yaml"

    def write(max_encryptions: int) -> None:
        _write_config(config, broker.bootstrap, metrics, {
            "kms": {"type": "key_file", "path": str(keys)}, "key": "KEK",
            "data_keys": {"max_encryptions_per_key": max_encryptions}})

    write(1000)
    proxy = launch_proxy(broker.bootstrap, config_file=config)
    proxy.metrics = metrics  # type: ignore[attr-defined]
    topic = f"count-{uuid.uuid4().hex[:6]}"
    _create(broker.bootstrap, topic)
    try:
        _produce(proxy.bootstrap, topic, [b"before %d" % i for i in range(5)])
        assert _metric(proxy, "record_encryption_records_encrypted") == 5
        write(500)
        status, answer = _reload(metrics)
        assert status == 200 and answer["ok"] is True, answer
        assert _metric(proxy, "record_encryption_records_encrypted") == 5
        _produce(proxy.bootstrap, topic, [b"after %d" % i for i in range(3)])
        assert _metric(proxy, "record_encryption_records_encrypted") == 8
    finally:
        proxy.stop()
