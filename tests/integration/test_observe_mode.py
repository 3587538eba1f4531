"""Observe mode and the dead-letter copy, end to end (Apache Kafka, confluent-kafka clients).

One proxy serves the module, in front of the session's Apache Kafka cluster (Tansu
is weak on idempotent and transactional producers), configured with the
interface a first try uses (``watch`` and ``guard``, exactly as the issue writes
them) and a few more routes:

* ``watch`` - topics ``trial`` and ``rej-observe``: ``my_policy:MyPolicy`` (refuses
  a batch holding a ``bad`` value) in observe mode;
* ``guard`` - topic ``payments``: the same rule enforced, refused records copied to
  ``payments-dlq``;
* ``shout-watch`` - topic ``shout-watch``: ``uppercase`` in observe mode;
* ``three`` - topic ``three-links``: uppercase, the rule in observe mode, a stamp;
* ``watch-copy`` - topic ``watch-copy``: the rule in observe mode, what it would
  refuse copied to ``watch-copy-dlq`` (``dead_letter_observed``);
* ``guard-gone`` - topic ``guard-gone``: the rule enforced, copies to a topic that
  does not exist.

A second proxy (Tansu) is reloaded observe -> enforce -> observe under one producer.
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

from kiproxy_dev.kafka_cluster import KafkaCluster
from kiproxy_dev.tansu import EmbeddedBroker, free_port

pytestmark = pytest.mark.timeout(180)

POLICY_VIOLATION = 44
RULE = "my_policy:MyPolicy"
FIRST_TRY = """
routes:
  - name: watch
    match: {topic: "trial|rej-observe"}
    mode: observe
    interceptors: [{class: my_policy:MyPolicy}]
  - name: guard
    match: {topic: "payments"}
    dead_letter: {topic: payments-dlq}
    interceptors: [{class: my_policy:MyPolicy}]
"""
MORE_ROUTES: list[dict[str, Any]] = [
    {"name": "shout-watch", "match": {"topic": "shout-watch"}, "mode": "observe",
     "interceptors": [{"class": "uppercase"}]},
    {"name": "three", "match": {"topic": "three-links"}, "interceptors": [
        {"class": "uppercase"}, {"class": RULE, "mode": "observe"},
        {"class": "stamp_headers", "config": {"headers": {"stage": "stamped"},
                                              "stamp": False}}]},
    {"name": "watch-copy", "match": {"topic": "watch-copy"}, "mode": "observe",
     "dead_letter": {"topic": "watch-copy-dlq"}, "dead_letter_observed": True,
     "interceptors": [{"class": RULE}]},
    {"name": "guard-gone", "match": {"topic": "guard-gone"},
     "dead_letter": {"topic": "gone-dlq"}, "interceptors": [{"class": RULE}]},
]
TOPICS = ("trial", "rej-observe", "payments", "payments-dlq", "shout-watch", "three-links",
          "watch-copy", "watch-copy-dlq", "guard-gone")


def create_topics(bootstrap: str, names: tuple[str, ...]) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(n, num_partitions=1, replication_factor=1)
                                   for n in names])
    for future in futures.values():
        future.result(20)


@pytest.fixture(scope="module")
def watched(apache_kafka: KafkaCluster,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ProxyProcess, Path, str]]:
    create_topics(apache_kafka.bootstrap, TOPICS)
    d = tmp_path_factory.mktemp("observe")
    audit = d / "audit.jsonl"
    metrics = f"127.0.0.1:{free_port()}"
    config = yaml.safe_load(FIRST_TRY)
    config["routes"] += MORE_ROUTES
    config.update({"plugins_dir": str(ROOT / "tests" / "plugins"), "metrics_listen": metrics,
                   "audit": {"path": str(audit), "flush_interval_ms": 50},
                   "dead_letter_sink": {"topic_check_interval_ms": 500}})
    path = d / "kiproxy.yaml"
    path.write_text(yaml.safe_dump(config))
    proxy = launch_proxy(apache_kafka.bootstrap, config_file=path,
                         node_ids=tuple(apache_kafka.broker_ids))
    yield proxy, audit, metrics
    assert proxy.alive(), proxy.log
    proxy.stop()


def sent_records(prefix: str, n: int, bad: set[int]) -> list[tuple[bytes, bytes, list[Any]]]:
    """(key, value, headers) of ``n`` records; those in ``bad`` break the rule."""
    return [(b"k%d" % i, (b"bad-%s-%d" if i in bad else b"good-%s-%d") % (prefix.encode(), i),
             [("trace", b"t%d" % i), ("empty", b"")]) for i in range(n)]


def produce(bootstrap: str, topic: str, records: list[tuple[bytes, bytes, list[Any]]],
            transactional: bool = False, **conf: Any) -> list[Any]:
    """Produce to partition 0 (idempotent; in one transaction when ``transactional``);
    the delivery error of each record, or None."""
    from confluent_kafka import Producer

    settings: dict[str, Any] = {"bootstrap.servers": bootstrap, "linger.ms": 20,
                                "enable.idempotence": True, "message.timeout.ms": 20000,
                                **conf}
    if transactional:
        settings["transactional.id"] = f"tx-{uuid.uuid4().hex[:8]}"
    producer = Producer(settings)
    errors: dict[int, Any] = {}
    if transactional:
        producer.init_transactions(20)
        producer.begin_transaction()
    for i, (key, value, headers) in enumerate(records):
        producer.produce(topic, key=key, value=value, headers=headers, partition=0,
                         on_delivery=lambda err, _m, i=i: errors.__setitem__(i, err))
    if transactional:
        producer.commit_transaction(20)
    producer.flush(30)
    return [errors.get(i, "no delivery report") for i in range(len(records))]


def stored(bootstrap: str, topic: str, count: int, timeout: float = 20) -> list[Any]:
    """Every record of partition 0 once ``count`` are there (read_committed)."""
    from confluent_kafka import Consumer, TopicPartition

    c = Consumer({"bootstrap.servers": bootstrap, "group.id": f"r-{uuid.uuid4().hex[:6]}",
                  "enable.auto.commit": False, "auto.offset.reset": "earliest",
                  "isolation.level": "read_committed"})
    try:
        c.assign([TopicPartition(topic, 0, 0)])
        out: list[Any] = []
        deadline = time.monotonic() + timeout
        while len(out) < count and time.monotonic() < deadline:
            out.extend(m for m in c.consume(num_messages=1000, timeout=0.2) if not m.error())
        out.extend(m for m in c.consume(num_messages=1000, timeout=0.3) if not m.error())
        return out
    finally:
        c.close()


def as_sent(messages: list[Any]) -> list[tuple[bytes, bytes, list[Any]]]:
    return [(m.key(), m.value(), list(m.headers() or [])) for m in messages]


def audit_events(path: Path, topic: str, count: int, timeout: float = 10) -> list[dict[str, Any]]:
    deadline = time.monotonic() + timeout
    while True:
        lines = path.read_text().splitlines() if path.exists() else []
        events = [e for e in map(json.loads, lines)
                  if e.get("event") == "produce" and e["topic"] == topic]
        if len(events) >= count or time.monotonic() > deadline:
            return events
        time.sleep(0.05)


def metric(address: str, name: str, **labels: str) -> float:
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as answer:
        text = answer.read().decode()
    want = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and line.split("}")[0][len(name) + 1:] == want:
            return float(line.rsplit(" ", 1)[1])
    return 0.0


@pytest.mark.parametrize(("topic", "transactional"), [("rej-observe", False),
                                                      ("trial", True)])
def test_observe_mode_stores_what_it_would_refuse_and_says_why(
        watched: tuple[ProxyProcess, Path, str], topic: str, transactional: bool) -> None:
    proxy, audit, metrics = watched
    sent = sent_records(topic, 6, bad={1, 4})
    assert produce(proxy.bootstrap, topic, sent, transactional) == [None] * 6
    assert as_sent(stored(proxy.bootstrap, topic, 6)) == sent  # every byte as sent

    labels = {"route": "watch", "link": RULE, "reason": "POLICY_VIOLATION"}
    assert metric(metrics, "kiproxy_would_reject_batches_total", **labels) >= 1
    assert metric(metrics, "kiproxy_would_reject_records_total", **labels) >= 2
    assert metric(metrics, "kiproxy_route_rejections_total", route="watch",
                  error="POLICY_VIOLATION") == 0
    events = audit_events(audit, topic, 1)
    assert events and all(e["outcome"] == "forwarded" and e["route"] == "watch"
                          for e in events)
    assert sum(e["records"] for e in events) == 6
    refused = [e for e in events if e["observed_outcome"] == "rejected"]
    assert refused and all(e["observed_error_code"] == POLICY_VIOLATION
                           and e["observed_link"] == RULE
                           and "records say bad" in e["observed_error_message"]
                           for e in refused)
    # One line per route, link and outcome per 10 s: the first of the two topics logs it.
    assert any("would have rejected" in x and "on route watch" in x
               and "(observe mode: forwarded as received)" in x for x in proxy.lines)


@pytest.mark.parametrize("transactional", [False, True])
def test_observe_mode_forwards_what_it_would_transform_as_received(
        watched: tuple[ProxyProcess, Path, str], transactional: bool) -> None:
    proxy, audit, metrics = watched
    before = metric(metrics, "kiproxy_would_transform_records_total", route="shout-watch",
                    link="uppercase")
    sent = sent_records(f"shout{int(transactional)}", 4, bad=set())
    assert produce(proxy.bootstrap, "shout-watch", sent, transactional) == [None] * 4
    messages = stored(proxy.bootstrap, "shout-watch", 8 if transactional else 4)
    assert as_sent(messages)[-4:] == sent  # not upper-cased
    assert metric(metrics, "kiproxy_would_transform_records_total", route="shout-watch",
                  link="uppercase") == before + 4
    events = audit_events(audit, "shout-watch", 1)
    assert any(e["outcome"] == "forwarded" and e["observed_outcome"] == "transformed"
               for e in events)


def test_a_link_in_observe_mode_hands_on_the_batch_it_was_given(
        watched: tuple[ProxyProcess, Path, str]) -> None:
    proxy, audit, metrics = watched
    sent = sent_records("three", 3, bad={0})
    assert produce(proxy.bootstrap, "three-links", sent) == [None] * 3
    messages = stored(proxy.bootstrap, "three-links", 3)
    # The first link's output went past the observing one to the third, which stamped it.
    assert [(m.key(), m.value(), m.headers()) for m in messages] == [
        (key, value.upper(), [*headers, ("stage", b"stamped")])
        for key, value, headers in sent]
    assert metric(metrics, "kiproxy_would_reject_records_total", route="three", link=RULE,
                  reason="POLICY_VIOLATION") == 3
    [event] = audit_events(audit, "three-links", 1)
    assert (event["outcome"], event["observed_outcome"], event["observed_link"]) == (
        "transformed", "rejected", RULE)
    # The log says what happened to the batch: the other links' verdicts stood.
    [line] = [x for x in proxy.lines if "would have rejected three-links[0]" in x]
    assert f"on route three, link {RULE} (link in observe mode: its verdict not " \
           "applied)" in line and "forwarded as received" not in line


def test_refused_records_are_copied_to_the_dead_letter_topic(
        watched: tuple[ProxyProcess, Path, str]) -> None:
    from confluent_kafka import KafkaError

    proxy, _, _ = watched
    sent = sent_records("pay", 3, bad={2})
    errors = produce(proxy.bootstrap, "payments", sent, **{"client.id": "orders-svc"})
    assert all(e is not None and e.code() == KafkaError.POLICY_VIOLATION for e in errors)
    assert stored(proxy.bootstrap, "payments", 0, timeout=1) == []
    copies = stored(proxy.bootstrap, "payments-dlq", 3, timeout=30)
    assert [(m.key(), m.value()) for m in copies] == [(k, v) for k, v, _ in sent]
    for i, (message, (_, _, headers)) in enumerate(zip(copies, sent, strict=True)):
        got = message.headers()
        assert got[:2] == headers  # the record's own, first and in order
        facts = {k: (v.decode() if v is not None else None) for k, v in got[2:]}
        assert facts["kiproxy.topic"] == "payments" and facts["kiproxy.partition"] == "0"
        assert facts["kiproxy.route"] == "guard" and facts["kiproxy.link"] == RULE
        assert facts["kiproxy.error.code"] == str(POLICY_VIOLATION)
        assert facts["kiproxy.error.name"] == "POLICY_VIOLATION"
        assert facts["kiproxy.reason"] == ("record 2 says bad" if i == 2
                                           else "1 of 3 records say bad")
        assert facts["kiproxy.client.id"] == "orders-svc"
        assert facts["kiproxy.principal"] is None and int(facts["kiproxy.time"]) > 0
        assert facts["kiproxy.observed"] == "false"


def test_observed_refusals_are_copied_and_still_stored(
        watched: tuple[ProxyProcess, Path, str]) -> None:
    proxy, _, _ = watched
    sent = sent_records("wc", 2, bad={0})
    assert produce(proxy.bootstrap, "watch-copy", sent) == [None, None]
    assert as_sent(stored(proxy.bootstrap, "watch-copy", 2)) == sent
    copies = stored(proxy.bootstrap, "watch-copy-dlq", 2, timeout=30)
    assert [m.value() for m in copies] == [v for _, v, _ in sent]
    assert all(dict(m.headers())["kiproxy.observed"] == b"true" for m in copies)


def test_a_missing_dead_letter_topic_changes_nothing_for_producers(
        watched: tuple[ProxyProcess, Path, str]) -> None:
    from confluent_kafka import KafkaError

    proxy, _, metrics = watched
    before = metric(metrics, "kiproxy_sink_dropped_total", sink="dead_letter",
                    reason="topic_missing")
    errors = produce(proxy.bootstrap, "guard-gone", sent_records("gone", 2, bad={0}))
    assert all(e is not None and e.code() == KafkaError.POLICY_VIOLATION for e in errors)
    deadline = time.monotonic() + 30
    while metric(metrics, "kiproxy_sink_dropped_total", sink="dead_letter",
                 reason="topic_missing") < before + 2:
        assert time.monotonic() < deadline, proxy.log
        time.sleep(0.1)
    assert proxy.alive()


def test_a_reload_moves_a_route_between_observe_and_enforce_under_a_producer(
        broker: EmbeddedBroker, tmp_path: Path) -> None:
    from confluent_kafka import KafkaError, Producer

    def config(mode: str) -> str:
        return yaml.safe_dump({"plugins_dir": str(ROOT / "tests" / "plugins"), "routes": [
            {"name": "rollout", "mode": mode, "interceptors": [{"class": RULE}]}]})

    path = tmp_path / "kiproxy.yaml"
    path.write_text(config("observe"))
    proxy = launch_proxy(broker.bootstrap, config_file=path)
    transport: list[Any] = []
    producer = Producer({"bootstrap.servers": proxy.bootstrap, "linger.ms": 0,
                         "message.timeout.ms": 10000,
                         "error_cb": lambda err: transport.append(err)})
    topic = f"rollout-{uuid.uuid4().hex[:8]}"
    try:
        outcomes: list[Any] = []

        def send(n: int) -> None:
            for i in range(n):  # one request each: the switch shows from the next one on
                producer.produce(topic, value=b"bad %d" % i, partition=0,
                                 on_delivery=lambda err, _m: outcomes.append(
                                     None if err is None else err.code()))
                producer.flush(15)

        send(3)
        for generation, mode in ((2, "enforce"), (3, "observe")):
            path.write_text(config(mode))
            proxy.process.send_signal(signal.SIGHUP)
            proxy.wait_for_line(f"configuration generation {generation}")
            send(3)
        assert outcomes == [None] * 3 + [KafkaError.POLICY_VIOLATION] * 3 + [None] * 3
        assert transport == []  # the producer's connections never dropped
    finally:
        assert proxy.stop() == 0, proxy.log
