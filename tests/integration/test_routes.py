"""Routes end to end: who produces picks the chain (real broker, real clients, kiproxy process).

One proxy serves the module, configured with four routes (no ``default``):

* ``shout`` - client ids ``shouter-*``: upper-cases every value;
* ``refuse`` - client ids ``blocked-*``: rejects with POLICY_VIOLATION;
* ``validate-mask-stamp`` - topics ``chain-*``: a chain of three built-ins in order,
  JSON Schema validation (POLICY_VIOLATION), e-mail masking, a stamped header;
* ``count-broken`` - topics ``count-*``: upper-case, then a link that drops a record
  (the record-count rule is checked after that link), then a stamp that must never run.

Any other client and topic passes untouched. The audit log names each partition's
route, ``/metrics`` counts per route, and a reload swaps the routes live.
"""

from __future__ import annotations

import json
import signal
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from conftest import ROOT, ProxyProcess, launch_proxy

from kiproxy_dev.tansu import EmbeddedBroker, free_port

pytestmark = pytest.mark.timeout(120)

POLICY_VIOLATION = 44
INVALID_RECORD = 87

ROUTES: list[dict[str, Any]] = [
    {"name": "shout", "match": {"client_id": "shouter-.*"},
     "interceptors": [{"class": "uppercase"}]},
    {"name": "refuse", "match": {"client_id": "blocked-.*"},
     "interceptors": [{"class": "tp_reject:Reject", "config": {"message": "blocked by route"}}]},
    {"name": "validate-mask-stamp", "match": {"topic": "chain-.*"},
     "interceptors": [
         {"class": "json_schema", "config": {
             "default_schema": {"type": "object", "required": ["email"]},
             "error": "POLICY_VIOLATION"}},
         {"class": "pii_masker", "config": {"topics": {"*": ["email"]}}},
         {"class": "stamp_headers", "config": {"headers": {"stage": "stamped"},
                                               "stamp": False}}]},
    {"name": "count-broken", "match": {"topic": "count-.*"},
     "interceptors": [
         {"class": "uppercase"},
         {"class": "tp_count:ChangeCount", "config": {"delta": -1}},
         {"class": "stamp_headers", "config": {"headers": {"stage": "never"}}}]},
    {"name": "twice", "match": {"topic": "twice-.*"},
     "interceptors": [
         {"class": "tp_reject:Reject", "config": {"topics": "^twice-a-.*"}},
         {"class": "tp_reject:Reject", "config": {"topics": "^twice-b-.*",
                                                  "message": "the second says no"}}]},
]


@pytest.fixture(scope="module")
def routed(broker: EmbeddedBroker,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ProxyProcess, Path, str]]:
    d = tmp_path_factory.mktemp("routes")
    audit = d / "audit.jsonl"
    metrics = f"127.0.0.1:{free_port()}"
    config = d / "kiproxy.yaml"
    config.write_text(yaml.safe_dump({
        "plugins_dir": str(ROOT / "tests" / "plugins"), "routes": ROUTES,
        "audit": {"path": str(audit), "flush_interval_ms": 50}, "metrics_listen": metrics}))
    proxy = launch_proxy(broker.bootstrap, config_file=config)
    yield proxy, audit, metrics
    assert proxy.alive(), proxy.log
    proxy.stop()


def _name(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def produce(bootstrap: str, topic: str, values: list[bytes], **conf: Any) -> list[Any]:
    """Produce ``values`` to partition 0 with confluent-kafka; each delivery error or None."""
    from confluent_kafka import Producer

    errors: dict[int, Any] = {}
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5,
                         "message.timeout.ms": 20000, **conf})
    for i, value in enumerate(values):
        producer.produce(topic, value=value, partition=0,
                         on_delivery=lambda err, _msg, i=i: errors.__setitem__(i, err))
    producer.flush(30)
    return [errors.get(i, "no delivery report") for i in range(len(values))]


def read(bootstrap: str, topic: str, count: int, timeout: float = 20, **conf: Any) -> list[Any]:
    """``count`` records of partition 0 from the start, then one more look for extras."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": _name("read"),
                  "enable.auto.commit": False, "auto.offset.reset": "earliest", **conf})
    try:
        c.assign([TopicPartition(topic, 0, 0)])
        out: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(out) < count and time.monotonic() < deadline:
            out.extend(m for m in c.consume(num_messages=1000, timeout=0.2) if not m.error())
        out.extend(m for m in c.consume(num_messages=1000, timeout=0.5) if not m.error())
        return out
    finally:
        c.close()


def audit_events(path: Path, topic: str, count: int, timeout: float = 10) -> list[dict[str, Any]]:
    """The produce events of ``topic`` once ``count`` of them are in the audit log."""
    deadline = time.monotonic() + timeout
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        events = [e for e in map(json.loads, lines)
                  if e.get("event") == "produce" and e["topic"] == topic]
        if len(events) >= count or time.monotonic() > deadline:
            return events
        time.sleep(0.05)


def scrape(address: str) -> str:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as answer:
        text: str = answer.read().decode()
        return text


def metric(text: str, name: str, **labels: str) -> float:
    """The value of one sample of ``text`` (0 when absent)."""
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and line.split("}")[0][len(name) + 1:] == want:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_three_producers_with_different_client_ids_get_different_chains(
        routed: tuple[ProxyProcess, Path, str]) -> None:
    from confluent_kafka import KafkaError

    proxy, audit, metrics = routed
    topic = _name("orders")
    values = [b"value-%d" % i for i in range(5)]

    shouted = produce(proxy.bootstrap, topic, values, **{"client.id": _name("shouter")})
    blocked = produce(proxy.bootstrap, topic, values, **{"client.id": _name("blocked")})
    plain = produce(proxy.bootstrap, topic, values, **{"client.id": _name("plain")})

    assert shouted == [None] * 5 and plain == [None] * 5
    assert all(e is not None and e.code() == KafkaError.POLICY_VIOLATION == POLICY_VIOLATION
               for e in blocked), blocked
    stored = [m.value() for m in read(proxy.bootstrap, topic, 10)]
    assert stored == [v.upper() for v in values] + values  # nothing of the blocked client

    events = audit_events(audit, topic, 3)
    assert [(e["route"], e["outcome"]) for e in events] == [
        ("shout", "transformed"), ("refuse", "rejected"), (None, "forwarded")]
    line = next(x for x in proxy.lines if f"rejected {topic}[0]" in x)
    assert "on route refuse, link tp_reject:Reject: error 44: blocked by route" in line

    text = scrape(metrics)
    assert metric(text, "kiproxy_route_records_total", route="shout",
                  outcome="transformed") >= 5
    assert metric(text, "kiproxy_route_rejections_total", route="refuse",
                  error="POLICY_VIOLATION") >= 1


def test_a_chain_of_three_runs_in_order(routed: tuple[ProxyProcess, Path, str]) -> None:
    proxy, audit, _ = routed
    topic = _name("chain")
    good = [json.dumps({"email": f"user{i}@example.com", "n": i}).encode() for i in range(3)]

    assert produce(proxy.bootstrap, topic, good) == [None] * 3

    stored = read(proxy.bootstrap, topic, 3)
    assert [json.loads(m.value()) for m in stored] == [
        {"email": "***@***", "n": i} for i in range(3)]  # validated, then masked
    assert all(m.headers() == [("stage", b"stamped")] for m in stored)  # then stamped

    # The first link refuses a value without an e-mail: later links never see it.
    bad = _name("chain")
    errors = produce(proxy.bootstrap, bad, [b'{"n": 1}'])
    assert errors[0] is not None and errors[0].code() == POLICY_VIOLATION
    assert read(proxy.bootstrap, bad, 0, timeout=1) == []
    events = audit_events(audit, topic, 1) + audit_events(audit, bad, 1)
    assert [(e["route"], e["outcome"]) for e in events] == [
        ("validate-mask-stamp", "transformed"), ("validate-mask-stamp", "rejected")]


def test_the_record_count_rule_is_checked_after_each_link(
        routed: tuple[ProxyProcess, Path, str]) -> None:
    proxy, _, _ = routed
    topic = _name("count")
    errors = produce(proxy.bootstrap, topic, [b"a", b"b", b"c"], **{"linger.ms": 50})
    assert all(e is not None and e.code() == INVALID_RECORD for e in errors), errors
    assert read(proxy.bootstrap, topic, 0, timeout=1) == []
    line = next(x for x in proxy.lines if f"rejected {topic}[0]" in x)
    assert "on route count-broken" in line
    assert "interceptor tp_count:ChangeCount broke the record-count rule" in line


def test_links_of_one_class_are_told_apart_in_logs_and_audit_events(
        routed: tuple[ProxyProcess, Path, str]) -> None:
    """A chain with one class twice: the second link is ``CLASS#2`` wherever a link is
    named, so a refusal says which of the two refused."""
    proxy, audit, _ = routed
    first, second = _name("twice-a"), _name("twice-b")
    for topic in (first, second):
        errors = produce(proxy.bootstrap, topic, [b"x"])
        assert errors[0] is not None and errors[0].code() == POLICY_VIOLATION
    lines = {topic: next(x for x in proxy.lines if f"rejected {topic}[0]" in x)
             for topic in (first, second)}
    assert "on route twice, link tp_reject:Reject: error 44" in lines[first]
    assert "on route twice, link tp_reject:Reject#2: error 44: the second says no" \
        in lines[second]
    events = audit_events(audit, first, 1) + audit_events(audit, second, 1)
    assert [e["link"] for e in events] == ["tp_reject:Reject", "tp_reject:Reject#2"]


def test_a_reload_swaps_the_routes(broker: EmbeddedBroker, tmp_path: Path) -> None:
    from confluent_kafka import KafkaError

    config = tmp_path / "kiproxy.yaml"
    plugins = str(ROOT / "tests" / "plugins")
    first = {"plugins_dir": plugins, "routes": [
        {"name": "first", "match": {"topic": "swap-.*"}, "interceptors": [{"class": "uppercase"}]}]}
    second = {"plugins_dir": plugins, "routes": [
        {"name": "second", "match": {"topic": "swap-.*"},
         "interceptors": [{"class": "tp_reject:Reject"}]}]}
    config.write_text(yaml.safe_dump(first))
    proxy = launch_proxy(broker.bootstrap, config_file=config)
    try:
        topic = _name("swap")
        assert produce(proxy.bootstrap, topic, [b"before"]) == [None]
        config.write_text(yaml.safe_dump(second))
        proxy.process.send_signal(signal.SIGHUP)
        deadline = time.monotonic() + 30
        while not any("configuration generation 2" in x for x in proxy.lines):
            assert time.monotonic() < deadline, proxy.log
            time.sleep(0.05)
        errors = produce(proxy.bootstrap, topic, [b"after"])
        assert errors[0] is not None and errors[0].code() == KafkaError.POLICY_VIOLATION
        assert [m.value() for m in read(proxy.bootstrap, topic, 1)] == [b"BEFORE"]
        assert any("on route second" in x for x in proxy.lines)
    finally:
        assert proxy.stop() == 0, proxy.log
