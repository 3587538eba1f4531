"""``kiproxy replay``: run an interceptor over a topic's history on Spark.

Dry run (no output option): what would the interceptor have rejected or changed?
Backfill: write the records it lets through, transformed, to ``--output-topic``
or as Parquet to ``--output-path``. Either way the report directory gets
``summary.json``, ``index.html`` (with ``chart.png``) and ``rejected/``, a JSON
Lines listing of every rejected record's coordinates (topic, partition, offset,
timestamp, error) - rejected records are listed, never silently dropped.

The driver plans one offset range per partition (:mod:`pipelines.offsets`) and
cuts large ranges into tasks; executors read their share
(:mod:`pipelines.sources`), apply the interceptor (:mod:`pipelines.apply`) and
count what happened (:mod:`pipelines.tally`). Task tallies come back through an
accumulator keyed by Spark partition, so a retried task replaces its tally
instead of counting twice.

The cluster is read (and a backfill topic written) with the run's
:class:`ClientSecurity` (TLS, mTLS, SASL; :mod:`pipelines.client_security`).
The driver connects and authenticates first, so a wrong password or an
untrusted certificate fails before any Spark job starts; executors get the
settings through a Spark broadcast, never through Spark conf.

Replay reads as a consumer of ``--isolation-level`` would: ``read_committed``
(the default) reads up to the last stable offset and leaves out the records of
aborted transactions; ``read_uncommitted`` reads every stored record up to the
high watermark. Transaction markers are never replayed. The ``fetch`` reader
counts what it skipped (``aborted_records_skipped``,
``control_batches_skipped``); the other readers cannot, and say None.

Backfill to a topic keeps keys, headers and timestamps (CreateTime), writes
source partition N to output partition N, and reads each partition in one task
so that the output keeps the source order per partition. Delivery is
at-least-once: a task Spark retries produces its records again.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import time
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pyspark.accumulators import AccumulatorParam

from kiproxy.pipelines.apply import InterceptorRunner, InterceptorSpec, error_name, runner_for
from kiproxy.pipelines.client_security import PLAINTEXT, ClientSecurity
from kiproxy.pipelines.errors import PipelineError
from kiproxy.pipelines.fetch_client import ISOLATION_LEVELS, BrokerError, FetchClient
from kiproxy.pipelines.offsets import (
    OffsetBound,
    OffsetRange,
    plan_ranges,
    select_topics,
    split_ranges,
)
from kiproxy.pipelines.progress import run_with_progress
from kiproxy.pipelines.replay_report import write_replay_report
from kiproxy.pipelines.session import ship_plugins, spark_session
from kiproxy.pipelines.sources import (
    SourceBatch,
    choose_reader,
    chunk_rows,
    confluent_config,
    consumer_chunks,
    spark_kafka_available,
    spark_kafka_options,
    stored_batches,
)
from kiproxy.pipelines.tally import ReplayTally, build_summary
from kiproxy.protocol.records import header_key_text

log = logging.getLogger("kiproxy.replay")

__all__ = ["ReplayOptions", "TallyAccumulator", "kafka_source", "run_replay"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayOptions:
    """Everything ``kiproxy replay`` was asked to do."""

    bootstrap: str
    topic: str
    interceptor: InterceptorSpec
    from_offsets: OffsetBound
    to_offsets: OffsetBound
    report_dir: Path
    output_topic: str | None = None
    output_path: str | None = None
    master: str | None = None
    reader: str = "auto"
    max_records_per_task: int = 100_000
    chunk_records: int = 500
    spark_conf: Mapping[str, str] = field(default_factory=dict)
    progress: bool | None = None
    verbose: bool = False
    """Show Spark's own start-up messages and warnings in the terminal."""
    ship_plugins_as_archive: bool | None = None
    """None: zip the plugins dir only for a non-local master (True forces it, for tests)."""
    from_text: str = "earliest"
    to_text: str = "latest"
    security: ClientSecurity = PLAINTEXT
    """How to connect to the cluster (TLS, SASL); its secrets never reach the report."""
    isolation_level: str = "read_committed"
    """``read_committed``: records of committed transactions and non-transactional ones,
    up to the last stable offset; ``read_uncommitted``: every stored record."""

    @property
    def mode(self) -> str:
        """``dry-run``, ``backfill-topic`` or ``backfill-parquet``."""
        if self.output_topic is not None:
            return "backfill-topic"
        if self.output_path is not None:
            return "backfill-parquet"
        return "dry-run"


class TallyAccumulator(AccumulatorParam[dict[int, ReplayTally]]):
    """Task tallies keyed by Spark partition index: a re-run task replaces its own entry."""

    def zero(self, value: dict[int, ReplayTally]) -> dict[int, ReplayTally]:
        return {}

    def addInPlace(self, value1: dict[int, ReplayTally],
                   value2: dict[int, ReplayTally]) -> dict[int, ReplayTally]:
        value1.update(value2)
        return value1


@dataclass(frozen=True, slots=True)
class _ExecutorJob:
    """What every executor task needs (pickled into the tasks)."""

    reader: str
    bootstrap: str
    interceptor: InterceptorSpec
    output_topic: str | None
    emit_records: bool
    chunk_records: int
    isolation_level: str
    security: Any
    """A Spark broadcast of the :class:`ClientSecurity` (secrets stay out of task closures)."""


def _output_row(batch: SourceBatch, offset: int, record: Any) -> tuple[Any, ...]:
    return ("record", batch.topic, batch.partition, offset, record.timestamp, record.key,
            record.value, [(header_key_text(h.key), h.value) for h in record.headers], None,
            None, None, None)


def _rejected_rows(batch: SourceBatch, error_code: int, message: str,
                   record_errors: Iterable[tuple[int, str | None]]) -> Iterator[tuple[Any, ...]]:
    per_record = dict(record_errors)
    name = error_name(error_code)
    for i, (offset, record) in enumerate(zip(batch.offsets, batch.records, strict=True)):
        yield ("rejected", batch.topic, batch.partition, offset, record.timestamp, None, None,
               None, error_code, name, message, per_record.get(i))


class _Producer:
    """The backfill's confluent-kafka producer inside one task."""

    def __init__(self, bootstrap: str, topic: str, security: ClientSecurity) -> None:
        from confluent_kafka import Producer

        self.topic = topic
        self.errors: list[str] = []
        self.producer = Producer(producer_config(bootstrap, security))

    def _delivered(self, err: Any, msg: Any) -> None:
        if err is not None and len(self.errors) < 10:
            self.errors.append(f"{msg.topic()}[{msg.partition()}]: {err}")

    def send(self, partition: int, record: Any) -> None:
        headers = [(h.key, h.value) for h in record.headers]
        for key, _ in headers:
            if (text := header_key_text(key)) != key:  # confluent-kafka would crash on it
                if len(self.errors) < 10:
                    self.errors.append(
                        f"{self.topic}[{partition}]: header key '{text}' is not UTF-8, and "
                        "confluent-kafka writes header keys as text: that record was not "
                        "copied")
                return
        while True:
            try:
                self.producer.produce(self.topic, value=record.value, key=record.key,
                                      partition=partition, timestamp=record.timestamp,
                                      headers=headers or None, on_delivery=self._delivered)
                break
            except BufferError:
                self.producer.poll(0.1)
        self.producer.poll(0)

    def close(self) -> None:
        remaining = self.producer.flush(120)
        if remaining:
            self.errors.append(f"{remaining} records still undelivered after 120 s")
        if self.errors:
            raise PipelineError(f"writing to --output-topic {self.topic} failed: "
                                + "; ".join(self.errors))


def producer_config(bootstrap: str, security: ClientSecurity) -> dict[str, Any]:
    """The backfill producer's confluent-kafka configuration."""
    return confluent_config(bootstrap, security, **{
        "enable.idempotence": True, "linger.ms": 20, "client.id": "kiproxy-replay-backfill"})


def _process(job: _ExecutorJob, accumulator: Any, index: int,
             items: Iterator[Any]) -> Iterator[tuple[Any, ...]]:
    """One Spark partition: read, intercept, write or emit, and tally."""
    runner = runner_for(job.interceptor)
    tally = ReplayTally()
    security: ClientSecurity = job.security.value
    producer = _Producer(job.bootstrap, job.output_topic, security) if job.output_topic \
        else None
    client = FetchClient(job.bootstrap, security=security,
                         isolation_level=job.isolation_level) if job.reader == "fetch" else None

    def batches() -> Iterator[SourceBatch]:
        if job.reader == "spark-kafka":
            yield from chunk_rows(items, job.chunk_records)
            return
        for task in items:
            if client is not None:
                yield from stored_batches(client, task, on_skip=functools.partial(
                    tally.skip, task.topic, task.partition))
            else:
                yield from consumer_chunks(job.bootstrap, task, job.chunk_records,
                                           security=security,
                                           isolation_level=job.isolation_level)

    try:
        for batch in batches():
            outcome = runner.apply(batch, topic=job.output_topic)
            if outcome.kind == "rejected":
                tally.add(batch, outcome)
                yield from _rejected_rows(batch, outcome.code, outcome.message or "",
                                          outcome.record_errors)
                continue
            written = 0
            if producer is not None:
                for record in outcome.records:
                    producer.send(batch.partition, record)
                written = len(outcome.records)
            elif job.emit_records:
                for offset, record in zip(batch.offsets, outcome.records, strict=True):
                    yield _output_row(batch, offset, record)
                written = len(outcome.records)
            tally.add(batch, outcome, written)
        if producer is not None:
            producer.close()
    finally:
        if client is not None:
            client.close()
    accumulator.add({index: tally})


def _row_schema() -> Any:
    from pyspark.sql.types import (
        ArrayType,
        BinaryType,
        IntegerType,
        LongType,
        StringType,
        StructField,
        StructType,
    )

    header = StructType([StructField("key", StringType(), False),
                         StructField("value", BinaryType(), True)])
    return StructType([
        StructField("kind", StringType(), False),
        StructField("topic", StringType(), False),
        StructField("partition", IntegerType(), False),
        StructField("offset", LongType(), False),
        StructField("timestamp", LongType(), False),
        StructField("key", BinaryType(), True),
        StructField("value", BinaryType(), True),
        StructField("headers", ArrayType(header, False), True),
        StructField("error_code", IntegerType(), True),
        StructField("error", StringType(), True),
        StructField("message", StringType(), True),
        StructField("record_error", StringType(), True),
    ])


RECORD_COLUMNS = ("topic", "partition", "offset", "timestamp", "key", "value", "headers")
REJECTED_COLUMNS = ("topic", "partition", "offset", "timestamp", "error_code", "error",
                    "message", "record_error")


def kafka_source(spark: Any, bootstrap: str, ranges: list[OffsetRange],
                 min_partitions: int, security: ClientSecurity = PLAINTEXT,
                 isolation_level: str = "read_committed") -> Any:
    """The planned ranges through Spark's Kafka data source, as its DataFrame (columns
    topic, partition, offset, timestamp, key, value, headers, ...)."""
    return spark.read.format("kafka").options(**spark_kafka_options(
        bootstrap, ranges, min_partitions, security, isolation_level)).load()


def _spark_uri(path: Path | str, local: bool) -> str:
    if local and "://" not in str(path):
        return Path(path).resolve().as_uri()
    return str(path)


# ---------------------------------------------------------------------------- driver


def _check_plugin(spec: InterceptorSpec) -> None:
    """Load and close the interceptor and the ``--fetch-hook`` on the driver, so a broken
    plugin or configuration fails before Spark."""
    runner = InterceptorRunner(spec)
    try:
        runner.close()
    except Exception as exc:
        log.warning("interceptor %s: close() failed: %s", spec.spec, exc)


def _plan(opts: ReplayOptions) -> tuple[list[str], list[OffsetRange]]:
    try:
        client = FetchClient(opts.bootstrap, security=opts.security,
                             isolation_level=opts.isolation_level)
    except ValueError as exc:
        raise PipelineError(f"--bootstrap {opts.bootstrap!r}: {exc}") from None
    with client:
        try:
            metadata = client.metadata()
        except BrokerError as exc:
            hint = " Check the address and that the broker is up." \
                if str(exc).startswith("cannot connect") else ""
            raise PipelineError(f"cannot read metadata from --bootstrap {opts.bootstrap}: "
                                f"{exc}{hint}") from None
        topics = select_topics(opts.topic, metadata, opts.bootstrap)
        ranges = plan_ranges(client, topics, opts.from_offsets, opts.to_offsets)
        if opts.output_topic is not None:
            _check_librdkafka(opts)
            _prepare_output_topic(opts, topics, ranges, metadata.leaders.get(opts.output_topic))
        elif opts.reader == "consumer":
            _check_librdkafka(opts)
    return topics, ranges


def _check_librdkafka(opts: ReplayOptions) -> None:
    """confluent-kafka accepts the settings (it loads the certificates and key up front)."""
    from confluent_kafka import KafkaException, Producer

    try:
        Producer(producer_config(opts.bootstrap, opts.security))
    except KafkaException as exc:
        raise PipelineError(f"confluent-kafka refuses the client settings: "
                            f"{exc.args[0].str() if exc.args else exc}") from None


def _prepare_output_topic(opts: ReplayOptions, topics: list[str], ranges: list[OffsetRange],
                          existing: Mapping[int, int] | None) -> None:
    out = opts.output_topic
    assert out is not None
    if out in topics:
        raise PipelineError(f"--output-topic {out} is one of the replayed topics; write the "
                            "backfill to another topic")
    needed = max((r.partition for r in ranges), default=0) + 1
    if existing is not None:
        if len(existing) < needed:
            raise PipelineError(
                f"--output-topic {out} has {len(existing)} partitions; the source needs "
                f"{needed} (partition N is written to partition N). Add partitions or pick "
                "another topic.")
        return
    from confluent_kafka.admin import (  # type: ignore[attr-defined]  # re-exported from cimpl
        AdminClient,
        NewTopic,
    )

    admin = AdminClient(confluent_config(opts.bootstrap, opts.security))
    futures = admin.create_topics([NewTopic(out, num_partitions=needed,
                                            replication_factor=-1)])
    try:
        futures[out].result(30)
    except Exception as exc:
        raise PipelineError(f"creating --output-topic {out} with {needed} partitions failed: "
                            f"{exc}. Create it yourself and run again.") from None


def run_replay(opts: ReplayOptions) -> dict[str, Any]:
    """Plan, run and report one replay; returns the summary written to ``summary.json``."""
    if opts.output_path is not None and "://" not in opts.output_path \
            and Path(opts.output_path).exists():
        raise PipelineError(f"--output-path {opts.output_path} already exists; give a new "
                            "directory (the backfill never overwrites)")
    if opts.isolation_level not in ISOLATION_LEVELS:
        raise PipelineError(f"--isolation-level {opts.isolation_level!r}: use "
                            f"{' or '.join(ISOLATION_LEVELS)}")
    _check_plugin(opts.interceptor)
    planned_at = time.time()
    topics, ranges = _plan(opts)
    planned_records = sum(r.size for r in ranges)
    log.info("replay of %s: %d partitions, %d offsets", ", ".join(topics), len(ranges),
             planned_records)

    with spark_session("kiproxy replay", opts.master, opts.spark_conf,
                       quiet=not opts.verbose) as spark:
        sc = spark.sparkContext
        local = sc.master.startswith("local")
        reader = choose_reader(opts.reader, spark_kafka_available(spark), spark.version,
                               opts.security)
        plugins_dir, archive = ship_plugins(spark, opts.interceptor.plugins_dir,
                                            archive=opts.ship_plugins_as_archive)
        # the executors' copy: the plugins where they are, everything else as given
        spec = dataclasses.replace(opts.interceptor, config=dict(opts.interceptor.config),
                                   fetch_hook_config=dict(opts.interceptor.fetch_hook_config),
                                   plugins_dir=plugins_dir, plugins_archive=archive)
        job = _ExecutorJob(reader, opts.bootstrap, spec, opts.output_topic,
                           opts.mode == "backfill-parquet", opts.chunk_records,
                           opts.isolation_level, sc.broadcast(opts.security))
        # Backfill to a topic keeps per-partition order: one task per partition.
        per_task = None if opts.mode == "backfill-topic" else opts.max_records_per_task
        tasks = split_ranges(ranges, per_task)
        accumulator = sc.accumulator({}, TallyAccumulator())
        process = functools.partial(_process, job, accumulator)
        if reader == "spark-kafka":
            source = kafka_source(spark, opts.bootstrap, ranges, len(tasks), opts.security,
                                  opts.isolation_level)
            rows = source.selectExpr("topic", "partition", "offset",
                                     "unix_millis(timestamp) AS ts", "key", "value",
                                     "headers").rdd
            out_rdd = rows.mapPartitionsWithIndex(process)
            n_partitions = rows.getNumPartitions()
        else:
            task_rdd = sc.parallelize(tasks, max(len(tasks), 1))
            out_rdd = task_rdd.mapPartitionsWithIndex(process)
            n_partitions = max(len(tasks), 1)
        frame = spark.createDataFrame(out_rdd, _row_schema())
        report_dir = opts.report_dir
        report_dir.mkdir(parents=True, exist_ok=True)
        rejected_uri = _spark_uri(report_dir / "rejected", local)

        def run_jobs() -> None:
            if opts.mode == "backfill-parquet":
                from pyspark import StorageLevel

                cached = frame.persist(StorageLevel.MEMORY_AND_DISK)
                try:
                    cached.where("kind = 'record'").select(*RECORD_COLUMNS).write \
                        .mode("errorifexists").parquet(_spark_uri(str(opts.output_path), local))
                    cached.where("kind = 'rejected'").select(*REJECTED_COLUMNS).write \
                        .mode("overwrite").option("ignoreNullFields", "false").json(rejected_uri)
                finally:
                    cached.unpersist()
            else:
                frame.where("kind = 'rejected'").select(*REJECTED_COLUMNS).write \
                    .mode("overwrite").option("ignoreNullFields", "false").json(rejected_uri)

        started = time.monotonic()
        run_with_progress(spark, f"replay {opts.topic}", n_partitions, run_jobs,
                          enabled=opts.progress)
        duration = time.monotonic() - started
        tally = ReplayTally.merged(accumulator.value.values())
        summary = {
            "kind": "kiproxy-replay",
            "mode": opts.mode,
            "interceptor": opts.interceptor.spec,
            "interceptor_config": dict(opts.interceptor.config),
            "bootstrap": opts.bootstrap,
            "security": opts.security.describe(),
            "topic_pattern": opts.topic,
            "topic_list": topics,
            "from_offsets": opts.from_text,
            "to_offsets": opts.to_text,
            "reader": reader,
            "isolation_level": opts.isolation_level,
            "batching": "stored batches" if reader == "fetch"
            else f"chunks of {opts.chunk_records} records",
            "tasks": n_partitions,
            "spark_master": sc.master,
            "spark_version": spark.version,
            "planned_at": _iso(planned_at),
            "duration_s": round(duration, 3),
            # Only stored batches show what was skipped (librdkafka and Spark do not say).
            **build_summary(tally, ranges, skips_counted=reader == "fetch"),
            "output": ({"topic": opts.output_topic} if opts.output_topic else
                       {"path": opts.output_path} if opts.output_path else None),
            "rejected_listing": "rejected/ (JSON Lines part files)",
        }
    summary["records_per_s"] = round(summary["records"] / duration, 1) if duration > 0 else None
    write_replay_report(summary, opts.report_dir)
    return summary


def _iso(epoch_s: float) -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(epoch_s))
