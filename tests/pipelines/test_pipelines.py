"""Replay and report on local Spark (local[2]) against the session's real broker.

One SparkSession serves the package (conftest.py); the CLI runs in-process and reuses it. Bad
input runs the real ``kiproxy`` console script: it fails before Spark starts.
"""

from __future__ import annotations

import csv
import datetime
import json
import subprocess
import sys
import typing
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import consume
from support.processes import runtime_env

from kiproxy.cli import main as kiproxy_main
from kiproxy.pipelines.apply import InterceptorSpec
from kiproxy.pipelines.fetch_client import FetchClient
from kiproxy.pipelines.offsets import OffsetBound
from kiproxy.pipelines.replay import ReplayOptions, run_replay
from kiproxy.pipelines.sources import spark_kafka_available
from kiproxy.protocol.messages import ApiKey, request_type
from kiproxy.protocol.records import Compression, Header, Record, build_batch
from kiproxy_dev.tansu import EmbeddedBroker

pytestmark = pytest.mark.timeout(240)

PLUGINS = Path(__file__).parent / "plugins"
BASE_TS = 1_763_800_000_000


def kiproxy(*args: str) -> int:
    """Run ``kiproxy ARGS`` in this process (reusing the package's SparkSession)."""
    return kiproxy_main([*args, "--no-progress"])


def create_topic(bootstrap: str, partitions: int) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic

    name = f"replay-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, num_partitions=partitions,
                                  replication_factor=1)])[name].result(15)
    return name


def produce_raw(bootstrap: str, topic: str, partition: int, batch: bytes) -> None:
    """Send one record batch exactly as built, as a Produce v9 request (acks=all)."""
    from kio.schema.types import TopicName
    from kio.static.primitive import i16, i32, i32Timedelta

    cls = request_type(ApiKey.PRODUCE, 9)
    topic_cls = typing.get_args(typing.get_type_hints(cls)["topic_data"])[0]
    part_cls = typing.get_args(typing.get_type_hints(topic_cls)["partition_data"])[0]
    request = cls(transactional_id=None, acks=i16(-1),
                  timeout=i32Timedelta.parse(datetime.timedelta(seconds=10)),
                  topic_data=(topic_cls(name=TopicName(topic), partition_data=(
                      part_cls(index=i32(partition), records=batch),)),))
    with FetchClient(bootstrap) as client:
        address = client._leader_address(topic, partition)
        response = client._request(address, ApiKey.PRODUCE, 9, request)
    code = int(response.responses[0].partition_responses[0].error_code)
    assert code == 0, f"produce to {topic}[{partition}] failed with error {code}"


# ---------------------------------------------------------------------------- dry run


@dataclass
class Truth:
    """What a dry run of replay_rules:RejectBad must report, computed from what was sent."""

    records: int = 0
    batches: int = 0
    transformed_records: int = 0
    transformed_batches: int = 0
    rejected_records: int = 0
    rejected_batches: int = 0
    bad_offsets: list[tuple[int, int]] | None = None


CODECS = [Compression.NONE, Compression.GZIP, Compression.SNAPPY, Compression.LZ4,
          Compression.ZSTD]


@pytest.fixture(scope="module")
def mixed_topic(broker: EmbeddedBroker) -> tuple[str, dict[int, Truth]]:
    """Three partitions of stored batches in every codec, with headers; some batches hold
    ``bad`` values (rejected), some ``lower:`` values (transformed)."""
    topic = create_topic(broker.bootstrap, 3)
    truth: dict[int, Truth] = {}
    for partition in range(3):
        t = truth[partition] = Truth(bad_offsets=[])
        offset = 0
        for b in range(10):
            codec = CODECS[(b + partition) % len(CODECS)]
            size = 1 + (b * 7 + partition * 3) % 9
            bad = b % 4 == 1
            values = []
            for i in range(size):
                if bad and i % 3 == 0:
                    values.append(b"bad value %d" % i)
                elif i % 2 == 0:
                    values.append(b"lower:%d-%d" % (b, i))
                else:
                    values.append(None if i == 5 else b"plain %d" % i)
            records = [Record(key=b"k%d" % i if i % 4 else None, value=v,
                              headers=[Header("src", b"test"), Header("n", None),
                                       Header("src", b"dup")][: i % 4],
                              timestamp=BASE_TS + offset + i * 3, offset_delta=i)
                       for i, v in enumerate(values)]
            produce_raw(broker.bootstrap, topic, partition, build_batch(records, compression=codec))
            t.records += size
            t.batches += 1
            if bad:
                t.rejected_batches += 1
                t.rejected_records += size
                assert t.bad_offsets is not None
                t.bad_offsets += [(partition, offset + i) for i, v in enumerate(values)
                                  if v is not None and v.startswith(b"bad")]
            else:
                lowered = sum(1 for v in values if v is not None and v.startswith(b"lower:"))
                t.transformed_records += lowered
                t.transformed_batches += 1 if lowered else 0
            offset += size
    return topic, truth


def test_dry_run_report_equals_the_known_truth(broker: EmbeddedBroker, spark: Any,
                                               mixed_topic: tuple[str, dict[int, Truth]],
                                               tmp_path: Path) -> None:
    topic, truth = mixed_topic
    report = tmp_path / "report"
    # Tasks of 4 offsets cut through stored batches: each batch must still be read once, whole.
    assert kiproxy("replay", "--bootstrap", broker.bootstrap, "--topic", topic,
                   "--interceptor", "replay_rules:RejectBad", "--plugins-dir", str(PLUGINS),
                   "--report", str(report), "--max-records-per-task", "4") == 0
    summary = json.loads((report / "summary.json").read_text())
    total = Truth()
    for t in truth.values():
        for k in ("records", "batches", "transformed_records", "transformed_batches",
                  "rejected_records", "rejected_batches"):
            setattr(total, k, getattr(total, k) + getattr(t, k))
    for k in ("records", "batches", "transformed_records", "transformed_batches",
              "rejected_records", "rejected_batches"):
        assert summary[k] == getattr(total, k), k
        assert summary["topics"][topic][k] == getattr(total, k), k
        for partition, t in truth.items():
            assert summary["topics"][topic]["partitions"][str(partition)][k] == getattr(t, k), \
                (k, partition)
    assert summary["reader"] == "fetch" and summary["stored_batches"] == total.batches
    assert summary["mode"] == "dry-run" and summary["written_records"] == 0

    # One reason, counted exactly, with the lowest offsets of the bad records as samples.
    all_bad = sorted(o for t in truth.values() for o in t.bad_offsets or [])
    [reason] = summary["reasons"]
    assert (reason["error"], reason["error_code"], reason["message"]) == \
        ("POLICY_VIOLATION", 44, f"bad records in {topic}")
    assert (reason["batches"], reason["records"]) == (total.rejected_batches,
                                                      total.rejected_records)
    for partition, t in truth.items():
        [part_reason] = summary["topics"][topic]["partitions"][str(partition)]["reasons"]
        assert [s["offset"] for s in part_reason["samples"]] == \
            [o for _, o in sorted(t.bad_offsets or [])][:5]
    assert len(reason["samples"]) == 5
    assert {(s["partition"], s["offset"]) for s in reason["samples"]} <= set(all_bad)

    # Every rejected record is listed, with the per-record reason where the plugin gave one.
    listed = [json.loads(line) for f in sorted((report / "rejected").glob("*.json"))
              for line in f.read_text().splitlines() if line.strip()]
    assert len(listed) == total.rejected_records
    flagged = {(r["partition"], r["offset"]) for r in listed
               if r["record_error"] == "value starts with bad"}
    assert flagged == set(all_bad)
    page = (report / "index.html").read_text()
    assert "POLICY_VIOLATION" in page and 'src="chart.png"' in page
    assert (report / "chart.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_consumer_reader_chunks_and_plugins_shipped_as_an_archive(
        broker: EmbeddedBroker, spark: Any, mixed_topic: tuple[str, dict[int, Truth]],
        tmp_path: Path) -> None:
    """The fallback reader (fixed-size chunks), with the plugins dir zipped and loaded from
    SparkFiles as on a cluster."""
    topic, truth = mixed_topic
    summary = run_replay(ReplayOptions(
        bootstrap=broker.bootstrap, topic=topic,
        interceptor=InterceptorSpec("replay_rules:RejectBad", {}, str(PLUGINS)),
        from_offsets=OffsetBound("earliest"), to_offsets=OffsetBound("latest"),
        report_dir=tmp_path / "report", reader="consumer", chunk_records=1000,
        ship_plugins_as_archive=True, progress=False))
    assert summary["reader"] == "consumer" and summary["stored_batches"] == 0
    assert summary["records"] == sum(t.records for t in truth.values())
    # One chunk per partition: each holds a bad record, so all of it is rejected.
    assert summary["chunked_batches"] == 3 and summary["rejected_batches"] == 3
    assert summary["rejected_records"] == summary["records"]


def test_spark_kafka_source_is_not_on_this_classpath(spark: Any) -> None:
    assert spark_kafka_available(spark) is False


def test_spark_kafka_reader_is_chosen_when_on_the_classpath_and_chunks_its_rows(
        broker: EmbeddedBroker, spark: Any, mixed_topic: tuple[str, dict[int, Truth]],
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With the Kafka data source on the classpath, ``auto`` reads through it. The jar is
    not available offline, so its DataFrame is stood in for by one with the source's
    schema holding the topic's records; everything after ``load()`` is the real path."""
    import kiproxy.pipelines.replay as replay

    topic, truth = mixed_topic
    epoch = datetime.datetime(1970, 1, 1, tzinfo=datetime.UTC)
    rows, values = [], []
    with FetchClient(broker.bootstrap) as client:
        for partition in truth:
            for batch in client.fetch(topic, partition, 0).batches:
                for r in batch.records:
                    rows.append((r.key, r.value, topic, partition,
                                 batch.header.base_offset + r.offset_delta,
                                 epoch + datetime.timedelta(milliseconds=r.timestamp), 0,
                                 [(h.key, h.value) for h in r.headers]))
                    values.append(r.value)
    assert len(rows) == sum(t.records for t in truth.values())
    calls: list[tuple[Any, ...]] = []

    def fake_source(session: Any, bootstrap: str, ranges: list[Any], minimum: int,
                    security: Any = None, isolation_level: str = "") -> Any:
        calls.append((bootstrap, sorted((r.partition, r.start, r.end) for r in ranges), minimum,
                      isolation_level))
        return session.createDataFrame(
            rows, "key BINARY, value BINARY, topic STRING, partition INT, offset LONG, "
                  "timestamp TIMESTAMP, timestampType INT, "
                  "headers ARRAY<STRUCT<key: STRING, value: BINARY>>")

    monkeypatch.setattr(replay, "spark_kafka_available", lambda session: True)
    monkeypatch.setattr(replay, "kafka_source", fake_source)
    summary = run_replay(ReplayOptions(
        bootstrap=broker.bootstrap, topic=topic,
        interceptor=InterceptorSpec("replay_rules:RejectBad", {}, str(PLUGINS)),
        from_offsets=OffsetBound("earliest"), to_offsets=OffsetBound("latest"),
        report_dir=tmp_path / "report", chunk_records=1, progress=False))
    assert calls == [(broker.bootstrap, [(p, 0, t.records) for p, t in truth.items()], 3,
                      "read_committed")]
    assert summary["aborted_records_skipped"] is None  # Spark's source does not say
    assert (summary["reader"], summary["batching"]) == ("spark-kafka", "chunks of 1 records")
    # One record per chunk: exactly the bad records are rejected, every lower: one changed.
    assert summary["records"] == summary["chunked_batches"] == len(rows)
    assert summary["rejected_records"] == sum(len(t.bad_offsets or []) for t in truth.values())
    assert summary["transformed_records"] == sum(
        1 for v in values if v is not None and v.startswith(b"lower:"))


# ---------------------------------------------------------------------------- backfill


@pytest.fixture(scope="module")
def produced_topic(broker: EmbeddedBroker) -> tuple[str, dict[int, list[dict[str, Any]]]]:
    """Records produced by a real client (confluent-kafka, gzip then zstd): keys, headers
    (duplicates, null values), explicit timestamps; one flush holds only ``drop`` records."""
    from confluent_kafka import Producer

    topic = create_topic(broker.bootstrap, 2)
    sent: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    n = 0
    for codec, groups in (("gzip", ["keep", "drop"]), ("zstd", ["keep", "keep"])):
        producer = Producer({"bootstrap.servers": broker.bootstrap, "compression.type": codec,
                             "linger.ms": 200, "enable.idempotence": True})
        for group in groups:
            for i in range(12):
                partition = i % 2
                value = (b"drop %d" % n if group == "drop" else
                         b"card secret %d" % n if n % 3 == 0 else b"hello %d" % n)
                headers = [("trace", b"%d" % n), ("dup", b"a"), ("dup", None)][: n % 4]
                record = {"key": b"key-%d" % n if n % 5 else None, "value": value,
                          "headers": headers, "timestamp": BASE_TS + 1000 * n, "group": group}
                producer.produce(topic, key=record["key"], value=value, partition=partition,
                                 headers=headers or None, timestamp=record["timestamp"])
                sent[partition].append(record)
                n += 1
            assert producer.flush(30) == 0
    return topic, sent


def _expected(sent: list[dict[str, Any]]) -> list[tuple[Any, ...]]:
    return [(r["key"], r["value"].replace(b"secret", b"******"), r["headers"], r["timestamp"])
            for r in sent if r["group"] == "keep"]


def test_backfill_to_a_topic_writes_exactly_the_transformed_records(
        broker: EmbeddedBroker, spark: Any, produced_topic: tuple[str, Any],
        tmp_path: Path) -> None:
    topic, sent = produced_topic
    out = f"{topic}-masked"
    report = tmp_path / "report"
    assert kiproxy("replay", "--bootstrap", broker.bootstrap, "--topic", topic,
                   "--interceptor", "replay_rules:Mask", "--plugins-dir", str(PLUGINS),
                   "--output-topic", out, "--report", str(report),
                   "--max-records-per-task", "5") == 0
    expected = {p: _expected(records) for p, records in sent.items()}
    got = consume(broker.bootstrap, out, sum(len(v) for v in expected.values()), partitions=2)
    by_partition: dict[int, list[tuple[Any, ...]]] = {0: [], 1: []}
    for msg in got:
        by_partition[msg.partition()].append(
            (msg.key(), msg.value(), msg.headers() or [], msg.timestamp()[1]))
    assert by_partition == expected
    summary = json.loads((report / "summary.json").read_text())
    dropped = sum(1 for records in sent.values() for r in records if r["group"] == "drop")
    assert summary["mode"] == "backfill-topic"
    assert summary["rejected_records"] == dropped
    assert summary["written_records"] == sum(len(v) for v in expected.values())
    assert summary["tasks"] == 2  # one per partition, whatever --max-records-per-task says
    listed = [json.loads(line) for f in (report / "rejected").glob("*.json")
              for line in f.read_text().splitlines() if line.strip()]
    assert sorted((r["partition"], r["timestamp"]) for r in listed) == sorted(
        (p, r["timestamp"]) for p, records in sent.items() for r in records
        if r["group"] == "drop")
    assert {r["message"] for r in listed} == {"drop requested"}


def test_backfill_to_parquet_keeps_offsets_keys_headers_and_timestamps(
        broker: EmbeddedBroker, spark: Any, produced_topic: tuple[str, Any],
        tmp_path: Path) -> None:
    import pyarrow.parquet as pq

    topic, sent = produced_topic
    out = tmp_path / "masked.parquet"
    assert kiproxy("replay", "--bootstrap", broker.bootstrap, "--topic", topic,
                   "--interceptor", "replay_rules:Mask", "--plugins-dir", str(PLUGINS),
                   "--output-path", str(out), "--report", str(tmp_path / "report"),
                   "--max-records-per-task", "7") == 0
    rows = pq.read_table(out).to_pylist()
    got: dict[int, list[tuple[Any, ...]]] = {0: [], 1: []}
    for row in sorted(rows, key=lambda r: (r["partition"], r["offset"])):
        assert row["topic"] == topic
        got[row["partition"]].append((row["key"], row["value"],
                                      [(h["key"], h["value"]) for h in row["headers"]],
                                      row["timestamp"]))
    assert got == {p: _expected(records) for p, records in sent.items()}


def test_timestamp_bounds_select_the_records_in_the_window(
        broker: EmbeddedBroker, spark: Any, produced_topic: tuple[str, Any],
        tmp_path: Path) -> None:
    topic, sent = produced_topic
    since, until = BASE_TS + 10_000, BASE_TS + 30_000
    assert kiproxy("replay", "--bootstrap", broker.bootstrap, "--topic", topic,
                   "--interceptor", "replay_rules:Mask", "--plugins-dir", str(PLUGINS),
                   "--from-offsets", str(since),
                   "--to-offsets", datetime.datetime.fromtimestamp(
                       until / 1000, datetime.UTC).isoformat(),
                   "--report", str(tmp_path / "report")) == 0
    summary = json.loads((tmp_path / "report" / "summary.json").read_text())
    assert summary["records"] == sum(1 for records in sent.values() for r in records
                                     if since <= r["timestamp"] < until)
    latest = tmp_path / "latest"
    assert kiproxy("replay", "--bootstrap", broker.bootstrap, "--topic", topic,
                   "--interceptor", "replay_rules:Mask", "--plugins-dir", str(PLUGINS),
                   "--from-offsets", "latest-3", "--report", str(latest)) == 0
    assert json.loads((latest / "summary.json").read_text())["records"] == 6


# ---------------------------------------------------------------------------- report


def test_report_over_the_audit_log_of_a_real_proxy_run(
        broker: EmbeddedBroker, start_proxy: Any, spark: Any, tmp_path: Path) -> None:
    from confluent_kafka import Producer

    audit = tmp_path / "audit" / "audit.jsonl"
    proxy = start_proxy("--audit-log", str(audit), interceptor="replay_rules:RejectBad",
                        plugins_dir=PLUGINS)
    good, bad = create_topic(broker.bootstrap, 2), create_topic(broker.bootstrap, 1)
    idle = create_topic(broker.bootstrap, 1)
    failures: list[str] = []

    def delivered(err: Any, msg: Any) -> None:
        if err is not None:
            failures.append(msg.topic())

    producer = Producer({"bootstrap.servers": proxy.bootstrap, "client.id": "report-test",
                         "linger.ms": 20, "retries": 0})
    sent_value_bytes = 0
    for round_ in range(4):
        for i in range(10):
            value = b"lower:%d-%d" % (round_, i) if i % 2 else b"order %d-%d" % (round_, i)
            sent_value_bytes += len(value)
            producer.produce(good, value=value, key=b"k%d" % i, partition=i % 2,
                             on_delivery=delivered)
        assert producer.flush(30) == 0
    for i in range(6):
        producer.produce(bad, value=b"bad %d" % i, on_delivery=delivered)
    assert producer.flush(30) == 0
    assert failures == [bad] * 6
    assert proxy.stop() == 0

    out = tmp_path / "report"
    assert kiproxy("report", "--audit", f"{audit}*", "--bootstrap", broker.bootstrap,
                   "--out", str(out)) == 0
    summary = json.loads((out / "summary.json").read_text())
    events = [json.loads(line) for line in audit.read_text().splitlines()]
    produce_events = [e for e in events if e["event"] == "produce"]
    assert summary["records"] == 46 and summary["rejected_records"] == 6
    assert summary["produce_events"] == len(produce_events)
    assert summary["bytes"] == sum(e["bytes"] for e in produce_events) > sent_value_bytes
    assert summary["transformed_records"] == 20
    assert idle in summary["idle_topics"] and good not in summary["idle_topics"]
    lat = summary["latency_ms"]
    assert 0 < lat["p50"] <= lat["p95"] <= lat["p99"]

    def rows(name: str) -> list[dict[str, str]]:
        with open(out / f"{name}.csv", newline="") as f:
            return list(csv.DictReader(f))

    by_topic = {r["topic"]: r for r in rows("by_topic")}
    assert (int(by_topic[good]["records"]), int(by_topic[bad]["records"])) == (40, 6)
    assert int(by_topic[bad]["rejected_records"]) == 6
    [client] = rows("by_client")
    assert (client["client_id"], int(client["records"])) == ("report-test", 46)
    assert sum(int(r["records"]) for r in rows("by_hour")) == 46
    assert sum(int(r["records"]) for r in rows("traffic")) == 46
    [rejection] = rows("rejections")
    assert (rejection["topic"], rejection["error"], int(rejection["records"])) == \
        (bad, "POLICY_VIOLATION", 6)
    assert rejection["message"] == f"bad records in {bad}"
    assert {r["topic"] for r in rows("latency")} == {"*", good, bad}
    assert idle in {r["topic"] for r in rows("idle_topics")}
    for png in ("bytes_by_topic.png", "records_by_hour.png", "rejections.png", "latency.png"):
        assert (out / png).read_bytes()[:4] == b"\x89PNG", png
    page = (out / "index.html").read_text()
    assert all(f'src="{png}"' in page for png in ("bytes_by_topic.png", "latency.png"))
    assert (out / "parquet" / "by_topic").is_dir()


def test_report_reads_the_audit_topic_and_ignores_other_api_events(
        broker: EmbeddedBroker, spark: Any, tmp_path: Path) -> None:
    """Events the proxy's Kafka audit sink sent to a topic; request events of other APIs
    are counted by kind but stay out of the produce tables."""
    from confluent_kafka import Producer

    audit_topic = create_topic(broker.bootstrap, 2)
    producer = Producer({"bootstrap.servers": broker.bootstrap})
    for i in range(12):
        produce = {"event": "produce", "ts": BASE_TS + i * 600_000, "client_id": f"c{i % 3}",
                   "client_address": "127.0.0.1:5000", "principal": "User:alice" if i % 2
                   else None, "api_version": 11, "correlation_id": i, "topic": "orders",
                   "partition": i % 2, "batches": 1, "records": 10 + i, "bytes": 100 * i,
                   "outcome": "rejected" if i == 5 else "forwarded",
                   "error_code": 87 if i == 5 else 0,
                   "error_message": "not JSON" if i == 5 else None,
                   "base_offset": -1 if i == 5 else i * 10, "latency_ms": 1.0 + i}
        other = {"event": "request", "ts": BASE_TS + i, "client_id": "c0",
                 "client_address": "127.0.0.1:5000", "principal": None, "api_key": 3,
                 "api_name": "Metadata", "api_version": 12, "correlation_id": 100 + i,
                 "request_bytes": 30, "response_bytes": 300, "latency_ms": 0.5}
        for event in (produce, other):
            producer.produce(audit_topic, key=b"orders", value=json.dumps(event).encode(),
                             partition=i % 2)
    assert producer.flush(30) == 0
    out = tmp_path / "out"
    assert kiproxy("report", "--audit-topic", audit_topic, "--bootstrap", broker.bootstrap,
                   "--out", str(out)) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["records"] == sum(10 + i for i in range(12))
    assert summary["bytes"] == sum(100 * i for i in range(12))
    assert summary["rejected_records"] == 15
    assert summary["events_by_kind"] == {"produce": 12, "request": 12}
    assert summary["latency_ms"]["p50"] in (6.0, 7.0)
    with open(out / "by_principal.csv", newline="") as f:
        principals = {r["principal"]: int(r["records"]) for r in csv.DictReader(f)}
    assert principals == {"User:alice": sum(10 + i for i in range(1, 12, 2)),
                          "": sum(10 + i for i in range(0, 12, 2))}
    with open(out / "by_hour.csv", newline="") as f:
        assert len(list(csv.DictReader(f))) >= 2  # 12 events 10 minutes apart


def test_progress_bar_follows_the_spark_tasks(spark: Any,
                                              capsys: pytest.CaptureFixture[str]) -> None:
    from kiproxy.pipelines.progress import run_with_progress

    rdd = spark.sparkContext.parallelize(range(6), 3)
    assert run_with_progress(spark, "squares", 3, lambda: rdd.map(lambda x: x * x).sum(),
                             enabled=True) == 55
    assert "squares" in capsys.readouterr().err
    with pytest.raises(ZeroDivisionError):
        run_with_progress(spark, "fails", 1, lambda: 1 // 0, enabled=False)


# ---------------------------------------------------------------------------- bad input


def _cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kiproxy", *args], capture_output=True,
                          text=True, timeout=120, cwd=Path(__file__).parents[2],
                          env=runtime_env(env))


def test_unknown_topic_exits_nonzero_and_lists_the_topics(broker: EmbeddedBroker,
                                                          tmp_path: Path) -> None:
    done = _cli("replay", "--bootstrap", broker.bootstrap, "--topic", "no-such-topic",
                "--interceptor", "replay_rules:RejectBad", "--plugins-dir", str(PLUGINS),
                "--report", str(tmp_path / "r"))
    assert done.returncode == 2
    assert "--topic 'no-such-topic': no topic of that name" in done.stderr
    assert "Check the name and --bootstrap" in done.stderr
    assert "Traceback" not in done.stderr


def test_plugin_that_fails_to_load_exits_nonzero_naming_it(broker: EmbeddedBroker,
                                                           tmp_path: Path) -> None:
    done = _cli("replay", "--bootstrap", broker.bootstrap, "--topic", "whatever",
                "--interceptor", "broken_plugin:Validator", "--plugins-dir", str(PLUGINS),
                "--report", str(tmp_path / "r"))
    assert done.returncode == 2
    assert "plugin error: importing interceptor module 'broken_plugin'" in done.stderr
    assert "jsonschemaa" in done.stderr
    done = _cli("replay", "--bootstrap", broker.bootstrap, "--topic", "whatever",
                "--interceptor", "replay_rules:Missing", "--plugins-dir", str(PLUGINS))
    assert done.returncode == 2 and "has no class 'Missing'" in done.stderr
    assert "RejectBad" in done.stderr


@pytest.mark.parametrize(("content", "message"), [
    (None, "no file matches"),
    (b"\x00\x01PK garbage \xff\xfe\n", "is not a kiproxy audit log"),
    (b'["not", "an", "event"]\n', "is not a kiproxy audit log"),
])
def test_unreadable_audit_input_exits_nonzero(tmp_path: Path, content: bytes | None,
                                              message: str) -> None:
    path = tmp_path / "audit.jsonl"
    if content is not None:
        path.write_bytes(content)
    done = _cli("report", "--audit", str(path), "--out", str(tmp_path / "out"))
    assert done.returncode == 2, done.stderr
    assert message in done.stderr and "--audit-log" in done.stderr
    assert "Traceback" not in done.stderr


def test_missing_java_is_named_with_what_to_install(tmp_path: Path) -> None:
    env = {"PATH": str(Path(sys.executable).parent), "HOME": str(tmp_path)}
    done = _cli("report", "--audit", "x", "--out", str(tmp_path), env=env)
    assert done.returncode == 2
    assert "Java 17" in done.stderr and "openjdk-17-jre-headless" in done.stderr


def test_run_does_not_import_pyspark() -> None:
    code = ("import sys, kiproxy.cli; kiproxy.cli.build_parser(); "
            "print(any(m.startswith('pyspark') for m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=60, check=True, cwd=Path(__file__).parents[2])
    assert done.stdout.strip() == "False"


def test_replay_run_from_a_folder_holding_a_kiproxy_package_uses_the_installed_one(
        broker: EmbeddedBroker, produced_topic: tuple[str, Any], tmp_path: Path) -> None:
    # A source checkout's root holds a kiproxy/ folder without the compiled codec (pip
    # installed the package elsewhere): Spark's Python workers, started in the current
    # directory, must not import it in place of the installed package.
    topic, _ = produced_topic
    shadow = tmp_path / "checkout" / "kiproxy"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('the checkout, not the install')\n")
    done = subprocess.run(
        [str(Path(sys.executable).parent / "kiproxy"), "replay", "--bootstrap",
         broker.bootstrap, "--topic", topic, "--interceptor", "replay_rules:RejectBad",
         "--plugins-dir", str(PLUGINS), "--report", str(tmp_path / "r")],
        capture_output=True, text=True, timeout=300, cwd=shadow.parent, env=runtime_env())
    assert done.returncode == 0, done.stderr[-2000:]
    assert (tmp_path / "r" / "summary.json").is_file()
