"""Extism plugins through a real proxy: Tansu, ``kiproxy run`` as a subprocess,
confluent-kafka (and kafka-python, which shows the partition's error message)
producing. The plugins are AssemblyScript built with Extism's PDK by the
``extism_plugins`` fixture. One proxy serves the module, configured from a
broker-style properties file (``--interceptor-properties``) plus config."""

from __future__ import annotations

import json
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ProxyProcess, consume, launch_proxy

from kiproxy_dev.tansu import EmbeddedBroker

pytestmark = pytest.mark.timeout(180)

POLICY_VIOLATION, INVALID_RECORD = 44, 87
LOOP_TIMEOUT_MS = 1500


def _name(prefix: str) -> str:
    return f"extism-{prefix}-{uuid.uuid4().hex[:8]}"


TOPICS = {k: _name(k) for k in ("up", "batch", "shout", "loop", "twice", "base64")}


def produce(bootstrap: str, topic: str, records: list[tuple[Any, ...]],
            timeout: float = 20) -> list[Any]:
    """Produce ``(key, value, headers[, timestamp])`` records in one batch; the delivery
    errors in order (None: stored)."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 50, "retries": 0,
                         "message.timeout.ms": int(timeout * 1000)})
    reports: dict[int, Any] = {}
    for i, (key, value, headers, *stamp) in enumerate(records):
        producer.produce(topic, key=key, value=value, headers=headers, partition=0,
                         timestamp=stamp[0] if stamp else 0,
                         on_delivery=lambda err, msg, i=i: reports.__setitem__(i, err))
    producer.flush(timeout + 5)
    assert len(reports) == len(records)
    return [reports[i] for i in range(len(records))]


def codes(errors: list[Any]) -> list[int | None]:
    return [None if e is None else e.code() for e in errors]


@pytest.fixture(scope="module")
def proxy(broker: EmbeddedBroker, extism_plugins: dict[str, Path],
          tmp_path_factory: pytest.TempPathFactory) -> Iterator[ProxyProcess]:
    folder = tmp_path_factory.mktemp("extism")
    (folder / "uppercase.wasm").write_bytes(extism_plugins["uppercase"].read_bytes())
    props = folder / "server.properties"
    prefix = "produce.request.interceptor.wasm"
    props.write_text(f"# a broker's file, brought unchanged\nbroker.id=1\nlog.dirs=/tmp/x\n"
                     f"{prefix}.topics={TOPICS['up']},{TOPICS['shout']}\n"
                     f"{prefix}.{TOPICS['up']}.path=uppercase.wasm\n"
                     f"{prefix}.{TOPICS['shout']}.path={extism_plugins['shouting']}\n")
    config = {"topics": {
        TOPICS["batch"]: {"plugin": str(extism_plugins["uppercase"]),
                          "batch_function": "transform_batch"},
        TOPICS["loop"]: {"plugin": str(extism_plugins["loop"]), "timeout_ms": LOOP_TIMEOUT_MS},
        TOPICS["twice"]: str(extism_plugins["twice"]),
        TOPICS["base64"]: {"plugin": str(extism_plugins["shouting"]), "binary": "base64"},
    }}
    p = launch_proxy(broker.bootstrap, "--interceptor-properties", str(props),
                     interceptor="extism", interceptor_config=config)
    yield p
    assert p.alive(), f"the proxy died during the module:\n{p.log}"
    p.stop()


HEADERS = [("h", b"1"), ("n", None), ("h", b"2"), ("a", b"\xc3\xa9")]


@pytest.mark.parametrize("which", ["up", "batch"])
def test_uppercase_is_stored_exactly(proxy: ProxyProcess, which: str) -> None:
    topic = TOPICS[which]
    records = [(b"k1", b'hello "kafka"', HEADERS, 1_700_000_000_001),
               (None, b"mixed \xc3\xa9 Case", [], 1_700_000_000_002),
               (b"k3", None, HEADERS, 1_700_000_000_003)]
    assert produce(proxy.bootstrap, topic, records) == [None, None, None]
    got = consume(proxy.bootstrap, topic, 3)
    stored = [(m.key(), m.value(), [(k, None if v is None else bytes(v))
                                    for k, v in (m.headers() or [])], m.timestamp()[1])
              for m in got]
    assert stored == [(b"k1", b'HELLO "KAFKA"', HEADERS, 1_700_000_000_001),
                      (None, b"MIXED \xc3\xa9 CASE", [], 1_700_000_000_002),
                      (b"k3", None, HEADERS, 1_700_000_000_003)]


def test_the_validators_message_reaches_the_producer(proxy: ProxyProcess) -> None:
    from kafka import KafkaProducer

    topic = TOPICS["shout"]
    assert codes(produce(proxy.bootstrap, topic, [(None, b"calm", []), (None, b"LOUD", [])])) \
        == [POLICY_VIOLATION, POLICY_VIOLATION]
    producer = KafkaProducer(bootstrap_servers=proxy.bootstrap, retries=0)
    try:
        with pytest.raises(Exception, match="stop shouting, you are hurting my ears"):
            producer.send(topic, b"SHOUTING", partition=0).get(20)
    finally:
        producer.close(5)
    assert produce(proxy.bootstrap, topic, [(None, b"quiet", [])]) == [None]


def test_an_infinite_loop_is_stopped_while_another_client_is_served(
        proxy: ProxyProcess) -> None:
    served: list[Any] = []

    def spin() -> None:
        errors = codes(produce(proxy.bootstrap, TOPICS["loop"], [(None, b"spin", [])]))
        served.append(("loop", time.monotonic(), errors))

    looping = threading.Thread(target=spin)
    started = time.monotonic()
    looping.start()
    time.sleep(0.3)  # the loop is running in the plugin now
    errors = produce(proxy.bootstrap, TOPICS["up"], [(b"other", b"client", [])])
    served.append(("other", time.monotonic(), errors))
    looping.join(30)
    (first, first_at, first_errors), (_, loop_at, loop_errors) = served
    assert (first, first_errors) == ("other", [None])
    assert first_at < loop_at, "the other client was answered before the loop was stopped"
    assert loop_errors == [INVALID_RECORD]
    assert loop_at - started >= LOOP_TIMEOUT_MS / 1000
    assert proxy.alive()
    assert produce(proxy.bootstrap, TOPICS["up"], [(None, b"after", [])]) == [None]


def test_two_records_for_one_breaks_the_count_rule(proxy: ProxyProcess) -> None:
    assert codes(produce(proxy.bootstrap, TOPICS["twice"], [(None, b"a", []), (None, b"b", [])])) \
        == [INVALID_RECORD, INVALID_RECORD]
    proxy.wait_for_line("broke the record-count rule: returned 4 records for a batch of 2")


def test_non_utf8_is_refused_or_kept_as_bytes_with_base64(proxy: ProxyProcess) -> None:
    assert codes(produce(proxy.bootstrap, TOPICS["up"], [(None, b"\x80abc", [])])) \
        == [INVALID_RECORD]
    topic = TOPICS["base64"]
    records = [(b"\xff\x00k", b"\x80abc\xfe", [("h", b"\x81xyz")])]
    assert produce(proxy.bootstrap, topic, records) == [None]
    m = consume(proxy.bootstrap, topic, 1)[0]
    assert (m.key(), m.value(), m.headers()) == (b"\xff\x00k", b"\x80abc\xfe", [("h", b"\x81xyz")])


def test_an_edited_plugin_file_is_reloaded_and_a_broken_one_refused(
        broker: EmbeddedBroker, extism_plugins: dict[str, Path], tmp_path: Path) -> None:
    topic = _name("reload")
    wasm = tmp_path / "live.wasm"
    wasm.write_bytes(extism_plugins["uppercase"].read_bytes())
    config = tmp_path / "proxy.json"
    config.write_text(json.dumps({
        "reload": {"watch": True, "watch_interval_ms": 100, "debounce_ms": 200},
        "interceptor": {"class": "extism", "config": {"topics": {topic: {
            "plugin": str(wasm), "config": {"greeting": "edited"}}}}}}))
    p = launch_proxy(broker.bootstrap, config_file=config)
    try:
        assert produce(p.bootstrap, topic, [(None, b"one", [])]) == [None]
        tmp = tmp_path / "live.tmp"
        tmp.write_bytes(extism_plugins["config"].read_bytes())
        tmp.rename(wasm)
        p.wait_for_line("reload (watch) applied")
        assert produce(p.bootstrap, topic, [(None, b"two", [])]) == [None]
        tmp.write_bytes(b"\0asm not a module")
        tmp.rename(wasm)
        p.wait_for_line("reload (watch) failed", "live.wasm does not load")
        assert produce(p.bootstrap, topic, [(None, b"three", [])]) == [None]
        assert [m.value() for m in consume(p.bootstrap, topic, 3)] == [b"ONE", b"edited",
                                                                         b"edited"]
    finally:
        p.stop()
