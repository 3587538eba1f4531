"""Observers, the audit log, metrics and health checks, with real producers and a real broker."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
import uuid
from collections import defaultdict
from pathlib import Path
from typing import Any

import yaml
from conftest import consume, consume_until, launch_proxy
from prometheus_client.parser import text_string_to_metric_families

from kiproxy_dev.tansu import EmbeddedBroker, free_port

PLUGINS = Path(__file__).parent / "observe_plugins"


def _get(url: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=10) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode()


def _metrics(addr: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    status, text = _get(f"http://{addr}/metrics")
    assert status == 200
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def _metric(m: dict[Any, float], name: str, **labels: str) -> float:
    return m.get((name, tuple(sorted(labels.items()))), 0.0)


def _read_audit(path: Path) -> list[dict[str, Any]]:
    events = []
    for f in sorted(path.parent.glob(path.name + "*")):
        for line in f.read_text().splitlines():
            events.append(json.loads(line))
    return events


def _create_topics(bootstrap: str, topics: dict[str, int]) -> None:
    from confluent_kafka.admin import AdminClient, NewTopic

    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics([NewTopic(t, n, 1) for t, n in topics.items()])
    for f in futures.values():
        f.result(30)


def _produce(bootstrap: str, plan: dict[tuple[str, int], int], client_id: str,
             **conf: Any) -> tuple[dict[tuple[str, int], list[int]], dict[str, list[Any]]]:
    """Produce ``plan[(topic, partition)]`` records each; return delivered offsets and errors."""
    from confluent_kafka import Producer

    producer = Producer({"bootstrap.servers": bootstrap, "client.id": client_id,
                         "acks": "all", "linger.ms": 5, "retries": 0, **conf})
    offsets: dict[tuple[str, int], list[int]] = defaultdict(list)
    errors: dict[str, list[Any]] = defaultdict(list)

    def report(err: Any, msg: Any) -> None:
        if err is not None:
            errors[msg.topic()].append(err)
        else:
            offsets[(msg.topic(), msg.partition())].append(msg.offset())

    for (topic, partition), n in plan.items():
        for i in range(n):
            producer.produce(topic, value=b"value-%05d" % i, key=b"k%d" % i,
                             partition=partition, on_delivery=report)
            producer.poll(0)
    assert producer.flush(60) == 0
    return offsets, errors


def _tile(events: list[dict[str, Any]]) -> list[int]:
    """Offsets covered by events' [base_offset, base_offset + records) ranges."""
    covered: list[int] = []
    for e in sorted(events, key=lambda e: e["base_offset"]):
        covered.extend(range(e["base_offset"], e["base_offset"] + e["records"]))
    return covered


def test_audit_metrics_and_acknowledgements_match_the_traffic(tmp_path: Path,
                                                             broker: EmbeddedBroker) -> None:
    suffix = uuid.uuid4().hex[:8]
    up, plain, rej = f"up-{suffix}", f"plain-{suffix}", f"rej-{suffix}"
    audit = tmp_path / "audit.jsonl"
    acks = tmp_path / "acks.jsonl"
    metrics_addr = f"127.0.0.1:{free_port()}"
    proxy = launch_proxy(broker.bootstrap, "--audit-log", str(audit), "--audit-requests",
                         "--metrics-listen", metrics_addr, plugins_dir=PLUGINS,
                         interceptor="obs:UpperOrReject",
                         interceptor_config={"acks_path": str(acks)})
    try:
        assert f"metrics on http://{metrics_addr}/metrics" in proxy.log
        _create_topics(proxy.bootstrap, {up: 2, plain: 1, rej: 1})
        plan = {(up, 0): 30, (up, 1): 20, (plain, 0): 25, (rej, 0): 10}
        offsets, errors = _produce(proxy.bootstrap, plan, "audit-test")
        assert not errors[up] and not errors[plain]
        assert len(errors[rej]) == 10
        assert all(e.code() == 44 for e in errors[rej])  # POLICY_VIOLATION
        assert sorted(offsets[(up, 0)]) == list(range(30))
        assert sorted(offsets[(plain, 0)]) == list(range(25))
        stored = consume(proxy.bootstrap, up, 50, partitions=2)
        assert sorted(m.value() for m in stored) == sorted(
            [b"VALUE-%05d" % i for i in range(30)] + [b"VALUE-%05d" % i for i in range(20)])
        m = _metrics(metrics_addr)
    finally:
        assert proxy.stop() == 0

    events = _read_audit(audit)
    produce = [e for e in events if e["event"] == "produce"]
    requests = [e for e in events if e["event"] == "request"]
    by_tp: dict[tuple[str, int], list[dict[str, Any]]] = defaultdict(list)
    for e in produce:
        by_tp[(e["topic"], e["partition"])].append(e)
    assert set(by_tp) == set(plan)
    for tp, n in plan.items():
        assert sum(e["records"] for e in by_tp[tp]) == n, tp
        for e in by_tp[tp]:
            assert e["client_id"] == "audit-test"
            assert e["client_address"].startswith("127.0.0.1:")
            assert e["principal"] is None
            assert e["bytes"] > 0 and e["latency_ms"] >= 0 and e["ts"] > 1.7e12
    for tp in [(up, 0), (up, 1)]:
        assert {e["outcome"] for e in by_tp[tp]} == {"transformed"}
        assert _tile(by_tp[tp]) == list(range(plan[tp]))
        assert {e["error_code"] for e in by_tp[tp]} == {0}
    assert {e["outcome"] for e in by_tp[(plain, 0)]} == {"forwarded"}
    assert _tile(by_tp[(plain, 0)]) == list(range(25))
    for e in by_tp[(rej, 0)]:
        assert (e["outcome"], e["error_code"], e["base_offset"]) == ("rejected", 44, -1)
        assert e["error_message"] == f"no writes to {rej}"
    # Other APIs are audited too (with --audit-requests), produce is not double counted.
    assert {"Metadata", "ApiVersions"} <= {e["api_name"] for e in requests}
    assert "Produce" not in {e["api_name"] for e in requests}

    # Metrics moved by exactly the workload.
    assert _metric(m, "kiproxy_produce_records_total", topic=up, outcome="transformed") == 50
    assert _metric(m, "kiproxy_produce_records_total", topic=plain, outcome="forwarded") == 25
    assert _metric(m, "kiproxy_produce_records_total", topic=rej, outcome="rejected") == 10
    for t in (up, plain, rej):
        assert _metric(m, "kiproxy_produce_bytes_total", topic=t, outcome=by_tp[(t, 0)][0][
            "outcome"]) == sum(e["bytes"] for e in produce if e["topic"] == t)
    produce_requests = {(e["client_address"], e["correlation_id"]) for e in produce}
    assert _metric(m, "kiproxy_messages_total", direction="request", api="Produce") == len(
        produce_requests)
    assert _metric(m, "kiproxy_messages_total", direction="response", api="Produce") == len(
        produce_requests)
    assert _metric(m, "kiproxy_interceptor_duration_seconds_count", route="default") == sum(
        e["batches"] for e in produce)
    assert _metric(m, "kiproxy_connections_total") >= 2

    # on_acknowledgement saw every forwarded batch with the broker's offsets.
    acked = [json.loads(line) for line in acks.read_text().splitlines()]
    for tp in [(up, 0), (up, 1), (plain, 0)]:
        mine = [a for a in acked if (a["topic"], a["partition"]) == tp]
        assert all(a["error"] is None for a in mine)
        assert _tile(mine) == list(range(plan[tp]))
        assert all(a["transformed"] == tp[0].startswith("up") for a in mine)
    assert not [a for a in acked if a["topic"] == rej]


def test_raising_and_slow_observers_do_not_change_what_clients_see(
        tmp_path: Path, broker: EmbeddedBroker, topic: str) -> None:
    recorded = tmp_path / "recorded.jsonl"
    config = tmp_path / "kiproxy.yaml"
    config.write_text(yaml.safe_dump({
        "observer_queue_size": 20,
        "observers": [
            {"class": "obs:Raising"},
            {"class": "obs:Slow", "config": {"delay_s": 0.2}},
            {"class": "obs:Recorder", "config": {"path": str(recorded)}},
        ],
    }))
    metrics_addr = f"127.0.0.1:{free_port()}"
    proxy = launch_proxy(broker.bootstrap, "--metrics-listen", metrics_addr,
                         plugins_dir=PLUGINS, config_file=config)
    try:
        from confluent_kafka import Producer

        producer = Producer({"bootstrap.servers": proxy.bootstrap, "linger.ms": 0})
        delivered: list[Any] = []
        for i in range(150):
            producer.produce(topic, value=b"r%d" % i, partition=0,
                             on_delivery=lambda err, msg: delivered.append(err))
            producer.flush(10)  # one request each: many events
        assert delivered == [None] * 150
        got = consume(proxy.bootstrap, topic, 150)
        assert [m.value() for m in got] == [b"r%d" % i for i in range(150)]
        m = _metrics(metrics_addr)
        assert _metric(m, "kiproxy_observer_errors_total", observer="obs:Raising") > 0
        assert _metric(m, "kiproxy_observer_dropped_events_total", observer="obs:Slow") > 0
        assert proxy.alive()
    finally:
        assert proxy.stop() == 0
    assert "observer obs:Raising: on_request failed" in proxy.log \
        or "observer obs:Raising: on_response failed" in proxy.log
    assert "observer obs:Slow is falling behind" in proxy.log
    lines = [json.loads(x) for x in recorded.read_text().splitlines()]
    produce_responses = [x for x in lines if x["kind"] == "response" and x["api"] == "Produce"]
    recorder_dropped = _metric(m, "kiproxy_observer_dropped_events_total",
                               observer="obs:Recorder")
    # Every produce response is either recorded or counted as dropped, never silently lost.
    assert len(produce_responses) + recorder_dropped >= 150
    assert all(x["produce"] == 1 for x in produce_responses)


def test_health_and_readiness_follow_the_upstream(tmp_path: Path) -> None:
    own = EmbeddedBroker(log_path=tmp_path / "broker.log")
    own.start()
    metrics_addr = f"127.0.0.1:{free_port()}"
    proxy = launch_proxy(own.bootstrap, "--metrics-listen", metrics_addr)
    try:
        assert _get(f"http://{metrics_addr}/healthz") == (200, "ok\n")
        assert _get(f"http://{metrics_addr}/readyz") == (200, "ready\n")
        own.stop()
        status, body = _get(f"http://{metrics_addr}/readyz")
        assert status == 503
        assert "no upstream broker reachable" in body and own.bootstrap in body
        assert _get(f"http://{metrics_addr}/healthz")[0] == 200
        assert _get(f"http://{metrics_addr}/nothing")[0] == 404
    finally:
        own.stop()
        assert proxy.stop() == 0


def test_audit_rotation_under_load_loses_nothing_and_shutdown_flushes(
        tmp_path: Path, broker: EmbeddedBroker, topic: str) -> None:
    audit = tmp_path / "audit" / "events.jsonl"
    config = tmp_path / "kiproxy.yaml"
    config.write_text(yaml.safe_dump({"audit": {
        "path": str(audit), "max_bytes": 4096, "rotate_interval_s": 0, "backups": 0,
        "flush_interval_ms": 60000}}))  # only rotation and shutdown flush here
    proxy = launch_proxy(broker.bootstrap, config_file=config)
    try:
        offsets, errors = _produce(proxy.bootstrap, {(topic, 0): 3000}, "rotation",
                                   **{"linger.ms": 0, "batch.num.messages": 10})
        assert not errors
    finally:
        assert proxy.stop() == 0
    files = sorted(audit.parent.iterdir())
    assert len(files) > 3, files
    events = _read_audit(audit)
    assert sum(e["records"] for e in events) == 3000
    assert _tile(events) == sorted(offsets[(topic, 0)]) == list(range(3000))


def test_audit_events_also_go_to_a_kafka_topic(tmp_path: Path, broker: EmbeddedBroker,
                                               topic: str) -> None:
    audit_topic = f"audit-{uuid.uuid4().hex[:8]}"
    config = tmp_path / "kiproxy.yaml"
    config.write_text(yaml.safe_dump({"audit": {"topic": audit_topic}}))
    proxy = launch_proxy(broker.bootstrap, config_file=config)
    try:
        _, errors = _produce(proxy.bootstrap, {(topic, 0): 40}, "sink-test")
        assert not errors
    finally:
        assert proxy.stop() == 0  # shutdown sends what is queued
    from confluent_kafka.admin import AdminClient

    metadata = AdminClient({"bootstrap.servers": broker.bootstrap}).list_topics(timeout=10)
    partitions = len(metadata.topics[audit_topic].partitions)  # auto-created by the sink
    got = consume_until(broker.bootstrap, audit_topic, lambda got: sum(
        e["records"] for e in map(json.loads, (m.value() for m in got))
        if e["topic"] == topic) >= 40, partitions=partitions, timeout=10)
    events = [json.loads(m.value()) for m in got]
    mine = [e for e in events if e["topic"] == topic]
    assert sum(e["records"] for e in mine) == 40
    assert all(e["client_id"] == "sink-test" and e["outcome"] == "forwarded" for e in mine)
    assert {m.key() for m in got if json.loads(m.value())["topic"] == topic} == {topic.encode()}
