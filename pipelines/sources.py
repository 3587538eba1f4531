"""Where replayed batches come from, and which reader a run uses.

Three readers turn offset ranges into :class:`SourceBatch` values inside the
executors:

- ``spark-kafka``: Spark's own Kafka data source (``spark-sql-kafka-0-10``),
  chosen automatically when its classes are on the classpath. It hands out
  records, not stored batches, so records are grouped into fixed-size chunks.
- ``fetch``: raw Fetch requests through :mod:`pipelines.fetch_client`; the
  broker returns whole stored batches, which are rebuilt as they were stored
  (records, codec, producer id/epoch, base sequence, transactional bit).
- ``consumer``: a confluent-kafka consumer, fixed-size chunks; for brokers the
  raw Fetch cannot read.

``auto`` picks ``spark-kafka`` when available and the cluster's settings can
be given to it without a secret (:meth:`ClientSecurity.spark_kafka_options`),
else ``fetch``. Every reader connects with the run's :class:`ClientSecurity`.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kiproxy.pipelines.client_security import PLAINTEXT, ClientSecurity
from kiproxy.pipelines.errors import PipelineError
from kiproxy.pipelines.fetch_client import FetchClient, record_timestamps
from kiproxy.pipelines.offsets import OffsetRange, ReplayTask
from kiproxy.pipelines.read_committed import BatchFate, read_committed
from kiproxy.protocol.records import Header, Record

__all__ = [
    "READERS",
    "SPARK_KAFKA_PROVIDER",
    "SourceBatch",
    "choose_reader",
    "chunk_rows",
    "confluent_config",
    "consumer_chunks",
    "spark_kafka_available",
    "spark_kafka_options",
    "stored_batches",
]

READERS = ("auto", "spark-kafka", "fetch", "consumer")
SPARK_KAFKA_PROVIDER = "org.apache.spark.sql.kafka010.KafkaSourceProvider"


@dataclass(frozen=True, slots=True, kw_only=True)
class SourceBatch:
    """A batch read back from a partition, with each record's source offset."""

    topic: str
    partition: int
    offsets: tuple[int, ...]
    """The offset of each record in the source partition."""
    records: tuple[Record, ...]
    """Records with their stored keys, values, headers and timestamps."""
    stored: bool
    """True: one stored batch (maybe clipped at the range's edges); False: a fixed-size chunk."""
    producer_id: int = -1
    producer_epoch: int = -1
    base_sequence: int = -1
    transactional: bool = False
    compression: str = "none"


# ---------------------------------------------------------------------------- choosing


def spark_kafka_available(spark: Any) -> bool:
    """Whether Spark's Kafka data source classes are on the driver's classpath."""
    try:
        jvm = spark.sparkContext._jvm
        loader = jvm.java.lang.Thread.currentThread().getContextClassLoader()
        jvm.java.lang.Class.forName(SPARK_KAFKA_PROVIDER, False, loader)
        return True
    except Exception:
        return False


def choose_reader(requested: str, spark_kafka: bool, spark_version: str = "4.0.0",
                  security: ClientSecurity = PLAINTEXT) -> str:
    """The reader to use for ``--reader requested`` when the Kafka data source is or is not
    on the classpath, for a cluster reached with ``security``."""
    if requested not in READERS:
        raise PipelineError(f"--reader {requested!r}: use one of {', '.join(READERS)}")
    if requested == "auto":
        secret = security.sasl or security.certificate_pem is not None
        return "spark-kafka" if spark_kafka and not secret else "fetch"
    if requested == "spark-kafka":
        security.spark_kafka_options()  # refuses settings that would put a secret in the plan
    if requested == "spark-kafka" and not spark_kafka:
        scala = "2.13"
        raise PipelineError(
            "--reader spark-kafka: Spark's Kafka data source is not on the classpath; add it "
            f"with --spark-conf spark.jars.packages=org.apache.spark:spark-sql-kafka-0-10_"
            f"{scala}:{spark_version} (or spark-submit --packages ...), or use --reader fetch"
        )
    return requested


# ---------------------------------------------------------------------------- fetch reader


def stored_batches(client: FetchClient, task: ReplayTask, *, max_bytes: int = 8 << 20,
                   on_skip: Callable[[BatchFate, int], None] | None = None
                   ) -> Iterator[SourceBatch]:
    """The stored batches a task owns, rebuilt whole (clipped to the partition's range).

    Control batches (transaction markers) are skipped: they hold no records. A
    ``read_committed`` client also skips the batches of aborted transactions, as
    Kafka's consumer does (:func:`pipelines.read_committed.read_committed`).
    ``on_skip(fate, records)`` hears of every batch skipped so, with the number of
    its records inside the range (a control batch counts as one).
    """
    position = task.start
    while position < task.end:
        fetched = client.fetch(task.topic, task.partition, position, max_bytes=max_bytes)
        if not fetched.batches:
            end = fetched.end_offset(client.read_committed)
            if position >= end:
                return
            bound = "last stable offset" if client.read_committed else "high watermark"
            raise PipelineError(f"{task.topic}[{task.partition}]: the broker returned no batch "
                                f"at offset {position} below its {bound} {end}")
        fates = read_committed(fetched.batches, fetched.aborted_transactions) \
            if client.read_committed else \
            ((b, BatchFate.CONTROL if b.header.is_control else BatchFate.RECORDS)
             for b in fetched.batches)
        for decoded, fate in fates:
            h = decoded.header
            base, last = h.base_offset, h.base_offset + h.last_offset_delta
            if last < position:
                continue
            anchor = max(base, task.range_start)
            if anchor >= task.end:
                return
            position = last + 1
            if anchor < task.start or not decoded.records:
                continue  # the previous task's batch, or no records left by compaction
            offsets, records = [], []
            log_append = h.timestamp_type == 1
            for record, ts in zip(decoded.records, record_timestamps(decoded), strict=True):
                offset = base + record.offset_delta
                if task.range_start <= offset < task.range_end:
                    offsets.append(offset)
                    records.append(record.with_timestamp(ts) if log_append else record)
            if fate is not BatchFate.RECORDS:
                if on_skip is not None and records:
                    on_skip(fate, 1 if fate is BatchFate.CONTROL else len(records))
                continue
            if records:
                yield SourceBatch(
                    topic=task.topic, partition=task.partition, offsets=tuple(offsets),
                    records=tuple(records), stored=True, producer_id=h.producer_id,
                    producer_epoch=h.producer_epoch, base_sequence=h.base_sequence,
                    transactional=h.is_transactional, compression=h.compression.name.lower(),
                )


# ---------------------------------------------------------------------------- chunked readers


def _chunks(topic: str, partition: int, items: Iterable[tuple[int, Record]],
            size: int) -> Iterator[SourceBatch]:
    offsets: list[int] = []
    records: list[Record] = []
    for offset, record in items:
        offsets.append(offset)
        records.append(record.with_offset_delta(len(records)))
        if len(records) >= size:
            yield SourceBatch(topic=topic, partition=partition, offsets=tuple(offsets),
                              records=tuple(records), stored=False)
            offsets, records = [], []
    if records:
        yield SourceBatch(topic=topic, partition=partition, offsets=tuple(offsets),
                          records=tuple(records), stored=False)


def confluent_config(bootstrap: str, security: ClientSecurity,
                     **settings: Any) -> dict[str, Any]:
    """confluent-kafka configuration for ``bootstrap`` reached with ``security``."""
    return {"bootstrap.servers": bootstrap, **security.librdkafka(), **settings}


def consumer_chunks(bootstrap: str, task: ReplayTask, chunk_records: int,
                    poll_timeout: float = 30.0, security: ClientSecurity = PLAINTEXT,
                    isolation_level: str = "read_committed") -> Iterator[SourceBatch]:
    """Records of ``[task.start, task.end)`` through a confluent-kafka consumer, in chunks.

    librdkafka skips control batches and, read_committed, aborted transactions
    without saying how many records it dropped: the offsets it skips are markers,
    aborted records and compacted-away records alike, so no count comes from here.
    """
    from confluent_kafka import Consumer, KafkaError, TopicPartition

    consumer = Consumer(confluent_config(
        bootstrap, security, **{
            "group.id": "kiproxy-replay", "enable.auto.commit": False,
            "enable.partition.eof": True, "auto.offset.reset": "earliest",
            "isolation.level": isolation_level}))

    def records() -> Iterator[tuple[int, Record]]:
        consumer.assign([TopicPartition(task.topic, task.partition, task.start)])
        while True:
            msg: Any = consumer.poll(poll_timeout)
            if msg is None:
                raise PipelineError(f"{task.topic}[{task.partition}]: no record within "
                                    f"{poll_timeout:.0f} s while reading up to offset {task.end}")
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    return
                raise PipelineError(f"{task.topic}[{task.partition}]: {err.str()}")
            offset = msg.offset()
            if offset >= task.end:
                return
            _, ts = msg.timestamp()
            try:
                read = msg.headers()
            except (SystemError, UnicodeDecodeError) as exc:  # how it fails on such a key
                raise PipelineError(
                    f"{task.topic}[{task.partition}] at offset {offset}: confluent-kafka "
                    f"cannot read the record's headers ({exc.__cause__ or exc}), as for a "
                    "header key that is not UTF-8; --reader fetch reads every key") from None
            headers = [Header(k, v) for k, v in (read or [])]
            yield offset, Record(key=msg.key(), value=msg.value(), headers=headers,
                                 timestamp=ts)
            if offset + 1 >= task.end:
                return

    try:
        yield from _chunks(task.topic, task.partition, records(), chunk_records)
    finally:
        consumer.close()


def chunk_rows(rows: Iterable[Sequence[Any]], chunk_records: int) -> Iterator[SourceBatch]:
    """Fixed-size chunks from Kafka data source rows
    ``(topic, partition, offset, timestamp_ms, key, value, headers)``, cut where the
    topic-partition changes (a Spark partition of that source reads offsets in order)."""
    current: tuple[str, int] | None = None
    pending: list[tuple[int, Record]] = []
    for topic, partition, offset, ts, key, value, headers in rows:
        tp = (str(topic), int(partition))
        if tp != current:
            if current is not None:
                yield from _chunks(current[0], current[1], pending, chunk_records)
            current, pending = tp, []
        hdrs = [Header(str(h[0]), None if h[1] is None else bytes(h[1])) for h in headers or ()]
        pending.append((int(offset), Record(
            key=None if key is None else bytes(key), value=None if value is None else bytes(value),
            headers=hdrs, timestamp=int(ts))))
        if len(pending) >= chunk_records:
            yield from _chunks(tp[0], tp[1], pending, chunk_records)
            pending = []
    if current is not None and pending:
        yield from _chunks(current[0], current[1], pending, chunk_records)


def spark_kafka_options(bootstrap: str, ranges: Sequence[OffsetRange],
                        min_partitions: int, security: ClientSecurity = PLAINTEXT,
                        isolation_level: str = "read_committed") -> dict[str, str]:
    """Options of ``spark.read.format("kafka")`` that read exactly ``ranges``."""
    assign: dict[str, list[int]] = {}
    starting: dict[str, dict[str, int]] = {}
    ending: dict[str, dict[str, int]] = {}
    for r in ranges:
        if r.size == 0:
            continue
        assign.setdefault(r.topic, []).append(r.partition)
        starting.setdefault(r.topic, {})[str(r.partition)] = r.start
        ending.setdefault(r.topic, {})[str(r.partition)] = r.end
    return {
        "kafka.bootstrap.servers": bootstrap,
        "assign": json.dumps(assign, sort_keys=True),
        "startingOffsets": json.dumps(starting, sort_keys=True),
        "endingOffsets": json.dumps(ending, sort_keys=True),
        "includeHeaders": "true",
        "failOnDataLoss": "false",
        "minPartitions": str(max(1, min_partitions)),
        "kafka.isolation.level": isolation_level,
        **security.spark_kafka_options(),
    }
