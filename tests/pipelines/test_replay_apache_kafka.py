"""Replay over Apache Kafka: transactional data read as read_committed, and a compacted topic.

The session's 1-node KRaft cluster (tests/conftest.py's ``apache_kafka``) and the package's local
SparkSession; records are produced with confluent-kafka straight to the broker.
What a replay must count is what a real ``read_committed`` confluent-kafka
consumer sees: committed transactions and non-transactional records, up to the
last stable offset - never aborted records, never transaction markers. Unlike
Tansu, Apache Kafka reports aborted transactions in Fetch, so the dropping itself
is tested here.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kiproxy.cli import main as kiproxy_main
from kiproxy.pipelines.fetch_client import FetchClient
from kiproxy_dev.kafka_cluster import KafkaCluster

pytestmark = [pytest.mark.timeout(300)]

PLUGINS = Path(__file__).parent / "plugins"
Seen = list[tuple[int, int, bytes | None, bytes | None]]
"""(partition, offset, key, value) of every record a consumer returned."""


@pytest.fixture(scope="module")
def kafka(apache_kafka: KafkaCluster) -> KafkaCluster:
    """The session's 1-node cluster (its log cleaner looks for work every 200 ms)."""
    return apache_kafka


def create_topic(bootstrap: str, partitions: int, **config: str) -> str:
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    name = f"ak-{uuid.uuid4().hex[:10]}"
    admin = AdminClient({"bootstrap.servers": bootstrap})
    admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1,
                                  config=config)])[name].result(30)
    return name


def consume_all(bootstrap: str, topic: str, partitions: int, isolation: str) -> Seen:
    """Every record a confluent-kafka consumer of ``isolation`` returns, up to its end."""
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": "truth",
                         "enable.auto.commit": False, "enable.partition.eof": True,
                         "isolation.level": isolation})
    consumer.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
    seen: Seen = []
    at_end: set[int] = set()
    deadline = time.monotonic() + 60
    try:
        while len(at_end) < partitions:
            assert time.monotonic() < deadline, f"{topic}: no end after 60 s"
            msg: Any = consumer.poll(1.0)
            if msg is None:
                continue
            if msg.error() is not None:
                assert msg.error().code() == KafkaError._PARTITION_EOF, msg.error()
                at_end.add(msg.partition())
                continue
            seen.append((msg.partition(), msg.offset(), msg.key(), msg.value()))
    finally:
        consumer.close()
    return sorted(seen)


def kiproxy(*args: str) -> int:
    """``kiproxy ARGS`` in this process (reusing the package's SparkSession)."""
    return kiproxy_main([*args, "--no-progress"])


def replay(bootstrap: str, topic: str, report: Path, *extra: str) -> dict[str, Any]:
    assert kiproxy("replay", "--bootstrap", bootstrap, "--topic", topic,
                   "--interceptor", "replay_rules:RejectBad", "--plugins-dir", str(PLUGINS),
                   "--report", str(report), *extra) == 0
    summary: dict[str, Any] = json.loads((report / "summary.json").read_text())
    return summary


def lowered(seen: Seen) -> int:
    return sum(1 for *_, v in seen if v is not None and v.startswith(b"lower:"))


# ---------------------------------------------------------------------------- transactions


@dataclass(frozen=True)
class TransactionalTopic:
    topic: str
    aborted: int
    """Records written in transactions that were aborted."""


def write_transactional_topic(bootstrap: str) -> tuple[TransactionalTopic, Any]:
    """Two partitions of plain records, committed and aborted transactions of two producers
    interleaved, and one transaction left open at the end (so LSO < high watermark); the
    topic and the producer whose transaction is still open."""
    from confluent_kafka import Producer

    topic = create_topic(bootstrap, 2)
    plain = Producer({"bootstrap.servers": bootstrap, "linger.ms": 5})
    # The open transaction must outlive the module (the broker aborts it after this long).
    a, b, still_open = (Producer({"bootstrap.servers": bootstrap, "linger.ms": 5,
                                  "transactional.id": f"{topic}-{n}",
                                  "transaction.timeout.ms": 600_000})
                        for n in ("a", "b", "open"))
    for producer in (a, b, still_open):
        producer.init_transactions(30)

    def send(producer: Any, count: int, value: bytes) -> None:
        for i in range(count):
            producer.produce(topic, value=b"%s-%d" % (value, i), partition=i % 2)
        assert producer.flush(30) == 0

    send(plain, 8, b"lower:plain")
    a.begin_transaction()
    b.begin_transaction()
    for _ in range(3):  # batches of both transactions alternate in each partition
        send(a, 6, b"lower:committed-a")
        send(b, 4, b"aborted-b")
        send(plain, 2, b"plain")
    a.commit_transaction(30)
    b.abort_transaction(30)
    a.begin_transaction()
    send(a, 10, b"aborted-a")
    a.abort_transaction(30)
    b.begin_transaction()  # the producer that aborted commits now
    send(b, 6, b"lower:committed-b")
    b.commit_transaction(30)
    send(plain, 4, b"lower:plain-late")
    still_open.begin_transaction()  # open at replay time: it and what follows are not read
    send(still_open, 4, b"lower:open")
    send(plain, 2, b"plain-after-open")
    for producer in (plain, a, b):
        producer.close()
    return TransactionalTopic(topic, 3 * 4 + 10), still_open


@pytest.fixture(scope="module")
def transactional(kafka: KafkaCluster) -> Iterator[TransactionalTopic]:
    written, still_open = write_transactional_topic(kafka.bootstrap)
    yield written
    still_open.abort_transaction(30)
    still_open.close()


def test_dry_run_counts_what_a_read_committed_consumer_sees(
        kafka: KafkaCluster, transactional: TransactionalTopic, spark: Any,
        tmp_path: Path) -> None:
    topic = transactional.topic
    committed = consume_all(kafka.bootstrap, topic, 2, "read_committed")
    assert not [v for *_, v in committed if v and v.startswith((b"aborted", b"lower:open"))]
    with FetchClient(kafka.bootstrap, isolation_level="read_committed") as client:
        fetched = [client.fetch(topic, p, 0) for p in range(2)]
    lso = [f.last_stable_offset for f in fetched]
    assert all(f.aborted_transactions for f in fetched)  # the broker reports them
    assert all(f.last_stable_offset < f.high_watermark for f in fetched)  # one still open
    markers = sum(1 for f, end in zip(fetched, lso, strict=True) for b in f.batches
                  if b.header.is_control and b.header.base_offset < end)

    # Tasks of 5 offsets cut through transactions, markers and aborted batches.
    summary = replay(kafka.bootstrap, topic, tmp_path / "dry", "--max-records-per-task", "5")
    assert (summary["reader"], summary["isolation_level"]) == ("fetch", "read_committed")
    assert summary["records"] == len(committed)
    assert summary["aborted_records_skipped"] == transactional.aborted
    assert summary["control_batches_skipped"] == markers > 0
    assert summary["transformed_records"] == lowered(committed)
    assert summary["rejected_records"] == 0
    for p in range(2):
        part = summary["topics"][topic]["partitions"][str(p)]
        assert part["end_offset"] == lso[p]  # the last stable offset, not the high watermark
        assert part["records"] == len([r for r in committed if r[0] == p])
    page = (tmp_path / "dry" / "index.html").read_text()
    assert "aborted records skipped" in page
    assert f'<td class="n">{transactional.aborted}</td>' in page


def test_backfill_writes_exactly_the_committed_records(
        kafka: KafkaCluster, transactional: TransactionalTopic, spark: Any,
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    committed = consume_all(kafka.bootstrap, transactional.topic, 2, "read_committed")
    out = tmp_path / "out.parquet"
    summary = replay(kafka.bootstrap, transactional.topic, tmp_path / "fill",
                     "--output-path", str(out), "--max-records-per-task", "7")
    assert summary["written_records"] == len(committed)
    assert f"{len(committed)} written to {out}; {transactional.aborted} aborted records " \
        "skipped; " in capsys.readouterr().out
    rows = spark.read.parquet(out.as_uri()).select("partition", "offset", "key", "value") \
        .collect()
    written = sorted((r.partition, r.offset, r.key, r.value) for r in rows)
    assert written == [(p, o, k, v.upper() if v.startswith(b"lower:") else v)
                       for p, o, k, v in committed]


def test_consumer_reader_and_read_uncommitted(
        kafka: KafkaCluster, transactional: TransactionalTopic, spark: Any,
        tmp_path: Path) -> None:
    """The consumer reader reads committed records too but cannot say what it skipped;
    read_uncommitted replays every stored record up to the high watermark."""
    topic = transactional.topic
    committed = consume_all(kafka.bootstrap, topic, 2, "read_committed")
    everything = consume_all(kafka.bootstrap, topic, 2, "read_uncommitted")
    chunked = replay(kafka.bootstrap, topic, tmp_path / "consumer", "--reader", "consumer")
    assert (chunked["records"], chunked["transformed_records"]) == \
        (len(committed), lowered(committed))
    assert chunked["aborted_records_skipped"] is None
    assert chunked["control_batches_skipped"] is None
    assert "not counted by this reader" in (tmp_path / "consumer" / "index.html").read_text()

    raw = replay(kafka.bootstrap, topic, tmp_path / "uncommitted",
                 "--isolation-level", "read_uncommitted")
    assert raw["isolation_level"] == "read_uncommitted"
    assert (raw["records"], raw["transformed_records"]) == \
        (len(everything), lowered(everything))
    assert raw["aborted_records_skipped"] == 0 and raw["control_batches_skipped"] > 0
    assert len(everything) == len(committed) + transactional.aborted + 4 + 2


# ---------------------------------------------------------------------------- compaction


def test_compacted_topic_offset_gaps(kafka: KafkaCluster, spark: Any, tmp_path: Path,
                                     request: pytest.FixtureRequest) -> None:
    """Keys written over and over; once the cleaner has run, the remaining records sit at
    scattered offsets (verified by reading them). Replay reads exactly those, with tasks
    that start inside the gaps."""
    from confluent_kafka import Producer

    topic = create_topic(kafka.bootstrap, 1, **{
        "cleanup.policy": "compact", "segment.ms": "100", "min.cleanable.dirty.ratio": "0.01",
        "min.compaction.lag.ms": "0", "delete.retention.ms": "100"})
    producer = Producer({"bootstrap.servers": kafka.bootstrap, "linger.ms": 5})
    request.addfinalizer(producer.close)
    for round_ in range(6):  # the last round overwrites the even keys only
        for k in range(0, 10, 2 if round_ == 5 else 1):
            producer.produce(topic, key=b"k%d" % k, value=b"lower:%d-%d" % (k, round_),
                             partition=0)
        assert producer.flush(30) == 0
        time.sleep(0.15)  # the next append rolls the segment
    deadline = time.monotonic() + 90
    while True:  # until the cleaner has left one record per key
        seen = consume_all(kafka.bootstrap, topic, 1, "read_committed")
        keyed = [(o, k, v) for _, o, k, v in seen if k != b"roll"]
        if len(keyed) == 10:
            break
        assert time.monotonic() < deadline, f"{topic}: not compacted after 90 s"
        producer.produce(topic, key=b"roll", value=b"plain", partition=0)
        producer.flush(30)
        time.sleep(1)
    # Odd keys survive from round 4 (offsets 41, 43, ...), even keys from round 5 (50-54).
    assert [o for o, _, _ in keyed] == [41, 43, 45, 47, 49, 50, 51, 52, 53, 54]
    assert {v for _, _, v in keyed} == {b"lower:%d-%d" % (k, 5 if k % 2 == 0 else 4)
                                        for k in range(10)}
    offsets = [o for _, o, _, _ in seen]

    summary = replay(kafka.bootstrap, topic, tmp_path / "dry", "--max-records-per-task", "4")
    assert summary["records"] == len(seen)
    assert summary["transformed_records"] == lowered(seen)
    part = summary["topics"][topic]["partitions"]["0"]
    assert (part["first_offset_read"], part["last_offset_read"]) == (offsets[0], offsets[-1])
    assert summary["aborted_records_skipped"] == 0
