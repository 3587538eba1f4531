"""``kiproxy report``: traffic and cost reports from the proxy's audit events.

Input is the audit log the proxy writes with ``--audit-log PATH`` (JSON Lines,
rotated files match ``PATH*``; ``.gz`` files are read too), and/or the topic the
proxy's Kafka audit sink writes to (``--audit-topic NAME --bootstrap HOST:PORT``),
read with the cluster's :class:`ClientSecurity` (``--command-config``,
``--consumer-property``; the driver connects first, executors get the settings
through a Spark broadcast).
Only ``"event": "produce"`` events feed the produce tables; request events of
other APIs are counted and otherwise ignored.

Tables (each as Parquet under ``parquet/NAME/`` and as ``NAME.csv``):

- ``traffic``: events, batches, records, bytes, transformed and rejected records
  by hour (UTC), topic, client id and principal;
- ``by_topic``, ``by_client``, ``by_principal``, ``by_hour``: the same, rolled up;
- ``rejections``: events and records by topic, error and message;
- ``latency``: produce latency (ms, proxy receipt to answer) p50/p95/p99, mean and
  max, overall (topic ``*``) and per topic; percentiles are Spark's
  ``percentile_approx`` with accuracy 10000 (exact for fewer values);
- ``idle_topics``: topics known from the audit input (any time) or, with
  ``--bootstrap``, from the cluster, that had no produce event in the window.

The policy section (:mod:`pipelines.policy_report`): what the routes refused and,
in observe mode, would have refused, per route and link, principal and client id,
topic and hour, the top reasons with examples, and a chart per route; with
``--replay [ROUTE=]DIR`` a replay dry run beside the live figures
(:mod:`pipelines.impact`).

Charts (PNG) and ``index.html`` show them; ``summary.json`` has the totals.
"""

from __future__ import annotations

import csv
import glob
import gzip
import json
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kiproxy.interceptors.api import ERROR_CODES
from kiproxy.pipelines.charts import bar_chart, line_chart
from kiproxy.pipelines.client_security import PLAINTEXT, ClientSecurity
from kiproxy.pipelines.errors import PipelineError
from kiproxy.pipelines.fetch_client import BrokerError, FetchClient
from kiproxy.pipelines.html_pages import page, table
from kiproxy.pipelines.impact import ReplaySpec, read_replay
from kiproxy.pipelines.offsets import OffsetBound, plan_ranges, split_ranges
from kiproxy.pipelines.policy_report import (
    POLICY_TABLES,
    ROLLUP_TABLES,
    aggregate_policy,
    policy_sections,
)
from kiproxy.pipelines.progress import run_with_progress
from kiproxy.pipelines.session import spark_session
from kiproxy.pipelines.sources import stored_batches

__all__ = ["ReportOptions", "audit_files", "run_report"]

TABLES = ("traffic", "by_topic", "by_client", "by_principal", "by_hour", "rejections",
          "latency", "idle_topics")


@dataclass(frozen=True, slots=True, kw_only=True)
class ReportOptions:
    """Everything ``kiproxy report`` was asked to do."""

    audit: Sequence[str]
    out_dir: Path
    audit_topic: str | None = None
    bootstrap: str | None = None
    since_ms: int | None = None
    until_ms: int | None = None
    master: str | None = None
    spark_conf: Mapping[str, str] = field(default_factory=dict)
    progress: bool | None = None
    verbose: bool = False
    """Show Spark's own start-up messages and warnings in the terminal."""
    security: ClientSecurity = PLAINTEXT
    """How to connect to the ``--bootstrap`` cluster (TLS, SASL)."""
    replays: Sequence[ReplaySpec] = ()
    """``--replay [ROUTE=]DIR``: replay dry runs to set beside the live figures."""


def _first_line(path: Path) -> str | None:
    opener: Any = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt", encoding="utf-8", errors="replace") as f:
        for _ in range(1000):
            line = f.readline()
            if not line:
                return None
            if line.strip():
                return str(line.strip())
    return None


def audit_files(patterns: Sequence[str]) -> list[str]:
    """The files named by ``--audit`` paths, directories and globs, checked to be readable
    JSON Lines; remote URIs (``hdfs://``, ``s3a://``) are passed to Spark unchecked."""
    out: list[str] = []
    for pattern in patterns:
        if "://" in pattern and not pattern.startswith("file://"):
            out.append(pattern)
            continue
        local = pattern.removeprefix("file://")
        p = Path(local)
        matches = sorted(str(f) for f in p.iterdir() if f.is_file()) if p.is_dir() \
            else sorted(glob.glob(local))
        if not matches:
            raise PipelineError(
                f"--audit {pattern}: no file matches. Give the proxy's audit log (its "
                "--audit-log PATH), a directory, or a glob such as 'audit.jsonl*'.")
        for name in matches:
            path = Path(name)
            if path.is_dir():
                continue
            try:
                line = _first_line(path)
            except OSError as exc:
                raise PipelineError(f"--audit: cannot read {path}: {exc.strerror or exc}. "
                                    "Check the path and its permissions.") from None
            except (EOFError, gzip.BadGzipFile) as exc:
                raise PipelineError(f"--audit: {path} is not a readable gzip file: {exc}") \
                    from None
            if line is None:
                continue  # an empty (e.g. just rotated) file is fine
            try:
                event = json.loads(line)
            except ValueError:
                event = None
            if not isinstance(event, dict) or "event" not in event:
                raise PipelineError(
                    f"--audit: {path} is not a kiproxy audit log: its first line is not a JSON "
                    f"object with an \"event\" field ({line[:80]!r}). Point --audit at the "
                    "files the proxy writes with --audit-log.")
            out.append(str(path.resolve()))
    return out


def _schema() -> Any:
    from pyspark.sql.types import (
        BooleanType,
        DoubleType,
        IntegerType,
        LongType,
        StringType,
        StructField,
        StructType,
    )

    fields = [("event", StringType()), ("ts", LongType()), ("client_id", StringType()),
              ("client_address", StringType()), ("principal", StringType()),
              ("api_version", IntegerType()), ("correlation_id", IntegerType()),
              ("topic", StringType()), ("partition", IntegerType()), ("batches", LongType()),
              ("records", LongType()), ("bytes", LongType()), ("outcome", StringType()),
              ("error_code", IntegerType()), ("error_message", StringType()),
              ("base_offset", LongType()), ("latency_ms", DoubleType()),
              ("api_key", IntegerType()), ("api_name", StringType()),
              ("request_bytes", LongType()), ("response_bytes", LongType()),
              ("route", StringType()), ("link", StringType()),
              ("observed_outcome", StringType()), ("observed_error_code", IntegerType()),
              ("observed_error_message", StringType()), ("observed_link", StringType()),
              ("observe_mode", BooleanType()),
              ("_corrupt_record", StringType())]
    return StructType([StructField(n, t, True) for n, t in fields])


def _topic_values(bootstrap: str, topic: str,
                  security: ClientSecurity) -> tuple[list[Any], list[str]]:
    """Read tasks for the audit topic, and every topic name on the cluster."""
    try:
        with FetchClient(bootstrap, client_id="kiproxy-report", security=security) as client:
            md = client.metadata()
            names = sorted(t for t in md.leaders if not t.startswith("__")
                           and t not in md.internal)
            if topic not in md.leaders:
                raise PipelineError(f"--audit-topic {topic}: no such topic on {bootstrap}; "
                                    "it is the proxy's audit.topic setting")
            ranges = plan_ranges(client, [topic], OffsetBound("earliest"),
                                 OffsetBound("latest"))
    except BrokerError as exc:
        raise PipelineError(f"cannot read from --bootstrap {bootstrap}: {exc}") from None
    return split_ranges(ranges, 200_000), names


def _read_values(bootstrap: str, security: Any, tasks: Iterator[Any]) -> Iterator[str]:
    """The audit topic's values, read by an executor (``security``: a Spark broadcast)."""
    with FetchClient(bootstrap, client_id="kiproxy-report",
                     security=security.value) as client:
        for task in tasks:
            for batch in stored_batches(client, task):
                for record in batch.records:
                    if record.value is not None:
                        yield record.value.decode("utf-8", errors="replace")


def _cluster_topics(bootstrap: str, security: ClientSecurity) -> list[str]:
    try:
        with FetchClient(bootstrap, client_id="kiproxy-report", security=security) as client:
            md = client.metadata()
    except (BrokerError, ValueError) as exc:
        raise PipelineError(f"cannot read metadata from --bootstrap {bootstrap}: {exc}") \
            from None
    return sorted(t for t in md.leaders if not t.startswith("__") and t not in md.internal)


def _uri(path: str | Path, local: bool) -> str:
    if local and "://" not in str(path):
        return Path(path).resolve().as_uri()
    return str(path)


def run_report(opts: ReportOptions) -> dict[str, Any]:
    """Aggregate the audit events and write the tables, charts and page; returns the summary."""
    if not opts.audit and not opts.audit_topic:
        raise PipelineError("give --audit PATH_OR_GLOB and/or --audit-topic NAME --bootstrap "
                            "HOST:PORT")
    if opts.audit_topic and not opts.bootstrap:
        raise PipelineError("--audit-topic needs --bootstrap HOST:PORT of the cluster holding it")
    files = audit_files(opts.audit) if opts.audit else []
    for spec in opts.replays:
        read_replay(spec)  # a wrong directory fails before Spark starts
    topic_tasks: list[Any] = []
    cluster_topics: list[str] = []
    if opts.audit_topic:
        assert opts.bootstrap is not None
        topic_tasks, cluster_topics = _topic_values(opts.bootstrap, opts.audit_topic,
                                                    opts.security)
    elif opts.bootstrap:
        cluster_topics = _cluster_topics(opts.bootstrap, opts.security)
    if not files and not topic_tasks and not opts.audit_topic:
        raise PipelineError(f"--audit {' '.join(opts.audit)}: every file is empty; no events "
                            "to report")

    out = opts.out_dir
    out.mkdir(parents=True, exist_ok=True)
    with spark_session("kiproxy report", opts.master, opts.spark_conf,
                       quiet=not opts.verbose) as spark:
        from pyspark.sql import functions as F

        local = spark.sparkContext.master.startswith("local")
        frames = []
        if files:
            frames.append(spark.read.schema(_schema())
                          .option("mode", "PERMISSIVE")
                          .option("columnNameOfCorruptRecord", "_corrupt_record")
                          .json([_uri(f, local) for f in files]))
        if topic_tasks:
            bootstrap = opts.bootstrap
            assert bootstrap is not None
            secured = spark.sparkContext.broadcast(opts.security)
            values = spark.sparkContext.parallelize(topic_tasks, len(topic_tasks)) \
                .mapPartitions(lambda it: _read_values(bootstrap, secured, it))
            frames.append(spark.read.schema(_schema()).option("mode", "PERMISSIVE")
                          .option("columnNameOfCorruptRecord", "_corrupt_record").json(values))
        if not frames:
            raise PipelineError(f"--audit-topic {opts.audit_topic} is empty; no events to report")
        events = frames[0]
        for extra in frames[1:]:
            events = events.unionByName(extra)
        events = events.cache()
        result: dict[str, Any] = {}

        def compute() -> None:
            result.update(_aggregate(spark, F, events, opts, cluster_topics, out, local))

        run_with_progress(spark, "report", 1, compute, enabled=opts.progress, unit="job")
        events.unpersist()
    summary = {**result["summary"], "inputs": files + ([f"topic {opts.audit_topic}"]
                                                       if opts.audit_topic else [])}
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
    _write_page(out, summary, result["rows"])
    return summary


def _order(name: str, F: Any) -> list[Any]:
    """The row order of table ``name``."""
    return {
        "traffic": ["hour", "topic", "client_id", "principal"],
        "by_topic": [F.desc("bytes"), "topic"],
        "by_client": [F.desc("bytes"), "client_id"],
        "by_principal": [F.desc("bytes"), "principal"],
        "by_hour": ["hour"],
        "rejections": [F.desc("records"), "topic", "error_code", "message"],
        "latency": [F.when(F.col("topic") == "*", 0).otherwise(1), "topic"],
        "idle_topics": ["topic"],
    }[name]


def _aggregate(spark: Any, F: Any, events: Any, opts: ReportOptions,
               cluster_topics: list[str], out: Path, local: bool) -> dict[str, Any]:
    corrupt = events.where(F.col("_corrupt_record").isNotNull()).count()
    valid = events.where(F.col("_corrupt_record").isNull() & F.col("event").isNotNull())
    counts = {r["event"]: r["count"] for r in valid.groupBy("event").count().collect()}
    if not counts:
        raise PipelineError(
            f"no audit events found in the input ({corrupt} lines do not parse as JSON). "
            "Point --audit at the files the proxy writes with --audit-log.")
    produce_all = valid.where(F.col("event") == "produce")
    known = {r["topic"]: r["last_ts"] for r in produce_all.groupBy("topic")
             .agg(F.max("ts").alias("last_ts")).collect() if r["topic"] is not None}
    produce = produce_all
    if opts.since_ms is not None:
        produce = produce.where(F.col("ts") >= opts.since_ms)
    if opts.until_ms is not None:
        produce = produce.where(F.col("ts") < opts.until_ms)
    rejected = F.when(F.col("outcome") == "rejected", F.col("records")).otherwise(0)
    transformed = F.when(F.col("outcome") == "transformed", F.col("records")).otherwise(0)
    base = produce.select(
        F.date_format(F.date_trunc("hour", F.timestamp_millis("ts")),
                      "yyyy-MM-dd'T'HH:00'Z'").alias("hour"),
        "topic", F.coalesce("client_id", F.lit("")).alias("client_id"),
        F.coalesce("principal", F.lit("")).alias("principal"),
        F.coalesce("batches", F.lit(0)).alias("batches"),
        F.coalesce("records", F.lit(0)).alias("records"),
        F.coalesce("bytes", F.lit(0)).alias("bytes"),
        rejected.alias("rejected_records"), transformed.alias("transformed_records"),
        "outcome", "error_code", "error_message", "latency_ms", "ts").cache()
    metrics = [F.count(F.lit(1)).alias("events"), F.sum("batches").alias("batches"),
               F.sum("records").alias("records"), F.sum("bytes").alias("bytes"),
               F.sum("transformed_records").alias("transformed_records"),
               F.sum("rejected_records").alias("rejected_records")]
    tables: dict[str, Any] = {
        "traffic": base.groupBy("hour", "topic", "client_id", "principal").agg(*metrics),
        "by_topic": base.groupBy("topic").agg(*metrics),
        "by_client": base.groupBy("client_id").agg(*metrics),
        "by_principal": base.groupBy("principal").agg(*metrics),
        "by_hour": base.groupBy("hour").agg(*metrics),
    }
    names = spark.createDataFrame([(c, n) for n, c in ERROR_CODES.items()],
                                  "error_code INT, error STRING")
    tables["rejections"] = (
        base.where(F.col("outcome") == "rejected")
        .groupBy("topic", "error_code", F.coalesce("error_message", F.lit("")).alias("message"))
        .agg(F.count(F.lit(1)).alias("events"), F.sum("records").alias("records"))
        .join(F.broadcast(names), "error_code", "left")
        .select("topic", "error_code",
                F.coalesce("error", F.concat(F.lit("ERROR_"), F.col("error_code").cast("string")))
                .alias("error"), "message", "events", "records"))
    pct = F.percentile_approx("latency_ms", F.array(F.lit(0.5), F.lit(0.95), F.lit(0.99)), 10000)
    latency_aggs = [F.count("latency_ms").alias("events"), pct.alias("p"),
                    F.avg("latency_ms").alias("mean_ms"), F.max("latency_ms").alias("max_ms")]
    overall = base.agg(*latency_aggs).select(F.lit("*").alias("topic"), "*")
    per_topic = base.groupBy("topic").agg(*latency_aggs)
    tables["latency"] = overall.unionByName(per_topic).where(F.col("events") > 0).select(
        "topic", "events", F.col("p")[0].alias("p50_ms"), F.col("p")[1].alias("p95_ms"),
        F.col("p")[2].alias("p99_ms"), "mean_ms", "max_ms")

    rows: dict[str, tuple[list[str], list[tuple[Any, ...]]]] = {}
    idle_rows: list[tuple[Any, ...]] = []
    active: set[str] = set()

    def write(name: str, frame: Any, order: Sequence[Any]) -> tuple[list[str], list[Any]]:
        # Aggregates are small: one sorted partition each, written and then collected
        # from the cache (a global orderBy would add a sampling job per table).
        df = frame.coalesce(1).sortWithinPartitions(*order).cache()
        df.write.mode("overwrite").parquet(_uri(out / "parquet" / name, local))
        columns = list(df.columns)
        collected = [tuple(r) for r in df.collect()]
        df.unpersist()
        with open(out / f"{name}.csv", "w", newline="", encoding="utf-8") as f:
            writer = csv.writer(f)
            writer.writerow(columns)
            writer.writerows(collected)
        return columns, collected

    for name in TABLES:
        if name == "idle_topics":
            active = {r[0] for r in rows["by_topic"][1]}
            idle_rows = sorted(
                (t, known.get(t), "audit log" if t in known else "cluster")
                for t in set(known) | set(cluster_topics) if t not in active)
            tables[name] = spark.createDataFrame(
                idle_rows, "topic STRING, last_produce_ts LONG, known_from STRING")
        rows[name] = write(name, tables[name], _order(name, F))
    policy, policy_rows = aggregate_policy(spark, F, produce, write, opts.replays, out)
    rows.update(policy_rows)

    totals = produce.agg(F.count(F.lit(1)).alias("events"),
                         F.sum("records").alias("records"), F.sum("bytes").alias("bytes"),
                         F.sum(rejected).alias("rejected_records"),
                         F.sum(transformed).alias("transformed_records"),
                         F.min("ts").alias("first_ts"), F.max("ts").alias("last_ts")).collect()[0]
    overall_latency = next((r for r in rows["latency"][1] if r[0] == "*"), None)
    summary = {
        "kind": "kiproxy-report",
        "produce_events": int(totals["events"] or 0),
        "records": int(totals["records"] or 0),
        "bytes": int(totals["bytes"] or 0),
        "rejected_records": int(totals["rejected_records"] or 0),
        "transformed_records": int(totals["transformed_records"] or 0),
        "topics": len(active),
        "idle_topics": [r[0] for r in idle_rows],
        "latency_ms": None if overall_latency is None else
        {"p50": overall_latency[2], "p95": overall_latency[3], "p99": overall_latency[4]},
        "window": {"since": _iso_ms(opts.since_ms or totals["first_ts"]),
                   "until": _iso_ms(opts.until_ms or totals["last_ts"])},
        "events_by_kind": counts,
        "unparsable_lines": int(corrupt),
        "tables": {**{n: {"csv": f"{n}.csv", "parquet": f"parquet/{n}/"}
                      for n in (*TABLES, *POLICY_TABLES)},
                   **{n: {"csv": f"{n}.csv", "parquet": "parquet/policy_rollups/"}
                      for n in ROLLUP_TABLES}},
        "policy": policy,
    }
    base.unpersist()
    return {"summary": summary, "rows": rows}


def _iso_ms(ms: int | None) -> str | None:
    if ms is None:
        return None
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(ms / 1000)) + f".{ms % 1000:03d}Z"


def _fmt(value: Any) -> Any:
    return round(value, 2) if isinstance(value, float) else value


def _write_page(out: Path, summary: Mapping[str, Any],
                rows: Mapping[str, tuple[list[str], list[tuple[Any, ...]]]]) -> None:
    charts: list[tuple[str, str]] = []

    def col(name: str, column: str) -> list[Any]:
        columns, data = rows[name]
        i = columns.index(column)
        return [r[i] for r in data]

    if rows["by_topic"][1]:
        topics = [str(t) for t in col("by_topic", "topic")][:30]
        bar_chart(out / "bytes_by_topic.png", "Bytes produced by topic", topics,
                  {"bytes": col("by_topic", "bytes")[:30]}, ylabel="bytes",
                  horizontal=len(topics) > 8)
        charts.append(("Bytes by topic", "bytes_by_topic.png"))
    if rows["by_hour"][1]:
        hours = [str(h) for h in col("by_hour", "hour")]
        line_chart(out / "records_by_hour.png", "Records per hour (UTC)", hours,
                   {"records": col("by_hour", "records"),
                    "rejected": col("by_hour", "rejected_records")}, ylabel="records")
        charts.append(("Records per hour", "records_by_hour.png"))
    if rows["rejections"][1]:
        labels = [f"{t}: {e} {m[:40]}" for t, e, m in zip(
            col("rejections", "topic"), col("rejections", "error"), col("rejections", "message"),
            strict=True)][:20]
        bar_chart(out / "rejections.png", "Rejected records by topic and reason", labels,
                  {"records": col("rejections", "records")[:20]}, ylabel="records",
                  horizontal=True)
        charts.append(("Rejections", "rejections.png"))
    if rows["latency"][1]:
        topics = ["all topics" if t == "*" else str(t) for t in col("latency", "topic")][:20]
        bar_chart(out / "latency.png", "Produce latency (ms)", topics,
                  {"p50": col("latency", "p50_ms")[:20], "p95": col("latency", "p95_ms")[:20],
                   "p99": col("latency", "p99_ms")[:20]}, ylabel="ms", stacked=False)
        charts.append(("Latency", "latency.png"))

    totals = table(["total", "value"], [
        ("window", f"{summary['window']['since']} to {summary['window']['until']}"),
        ("produce events", summary["produce_events"]), ("records", summary["records"]),
        ("bytes", summary["bytes"]), ("transformed records", summary["transformed_records"]),
        ("rejected records", summary["rejected_records"]),
        ("latency p50 / p95 / p99 (ms)", " / ".join(
            f"{summary['latency_ms'][k]:.2f}" for k in ("p50", "p95", "p99"))
         if summary["latency_ms"] else "no events"),
        ("unparsable lines", summary["unparsable_lines"]),
        ("inputs", ", ".join(summary["inputs"])),
    ])
    sections = [("Totals", totals)]
    sections += [(title, f'<img src="{png}" alt="{title}">') for title, png in charts]
    sections += policy_sections(out, rows)
    titles = {"by_topic": "Traffic by topic", "by_client": "Traffic by client id",
              "by_principal": "Traffic by principal", "by_hour": "Traffic by hour (UTC)",
              "rejections": "Rejections by topic and reason", "latency": "Produce latency",
              "idle_topics": "Topics with no traffic in the window",
              "traffic": "Traffic by hour, topic, client id and principal"}
    for name in ("by_topic", "by_client", "by_principal", "by_hour", "rejections", "latency",
                 "idle_topics", "traffic"):
        columns, data = rows[name]
        links = (f'<p class="note">Data: <a href="{name}.csv">{name}.csv</a>, '
                 f'<a href="parquet/{name}/">parquet/{name}/</a></p>')
        sections.append((titles[name], table(columns, ([_fmt(v) for v in r] for r in data),
                                             limit=100) + links))
    (out / "index.html").write_text(page("kiproxy traffic report", sections))
