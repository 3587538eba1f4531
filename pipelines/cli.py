"""The ``kiproxy replay`` and ``kiproxy report`` subcommands.

``add_parsers`` adds them to ``kiproxy``'s argument parser; ``run`` executes one.
Nothing here imports pyspark: ``kiproxy run`` never pays for it. Errors a user
can fix (bad input, unknown topic, a plugin that does not load, no Java) print
one ``kiproxy <command>: ...`` line and exit 2; a failed Spark job exits 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any

from kiproxy.interceptors.flags import (
    DEFAULT_TIMEOUT_MS,
    INTERCEPTOR,
    INTERCEPTOR_CONFIG,
    INTERCEPTOR_TIMEOUT,
    PLUGINS_DIR,
    add_flag,
)
from kiproxy.pipelines.errors import JavaMissing, PipelineError

__all__ = ["COMMANDS", "add_parsers", "main", "run"]

COMMANDS = ("replay", "report")


def _spark_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--master", metavar="URL",
                   help="Spark master (default local[*]; yarn, spark://HOST:7077, k8s://...). "
                        "Under spark-submit its master is used")
    p.add_argument("--spark-conf", metavar="KEY=VALUE", action="append", default=[],
                   help="extra Spark setting (repeatable), e.g. spark.executor.memory=4g")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar (it is shown only on a terminal anyway)")
    p.add_argument("--verbose", action="store_true",
                   help="show Spark's own start-up messages and warnings")


def _client_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--command-config", metavar="FILE",
                   help="client settings of the cluster, as Kafka's tools take them (a Java "
                        "client.properties: security.protocol, ssl.*, sasl.*); see "
                        "docs/replay-security.md. Keep passwords in this file")
    p.add_argument("--consumer-property", metavar="KEY=VALUE", action="append", default=[],
                   help="one client setting (repeatable; overrides --command-config)")


def _security(args: argparse.Namespace) -> Any:
    from kiproxy.pipelines.client_security import load_client_security

    return load_client_security(args.command_config, args.consumer_property)


def add_parsers(subparsers: Any) -> None:
    """Add ``replay`` and ``report`` to ``kiproxy``'s subcommands."""
    replay = subparsers.add_parser(
        "replay", help="run an interceptor over a topic's history on Spark (dry run or backfill)",
        description="Replay an interceptor over stored records on Spark. Without an output "
                    "option it is a dry run that reports what would be rejected or changed; "
                    "with --output-topic or --output-path it writes the transformed records.")
    replay.add_argument("--bootstrap", metavar="HOST:PORT", required=True,
                        help="bootstrap server(s) of the cluster to read (comma-separated)")
    replay.add_argument("--topic", metavar="PATTERN", required=True,
                        help="a topic name, or a regular expression matched against whole names")
    # The plugin flags of `kiproxy run`, `check` and `replay`, declared once.
    add_flag(replay, INTERCEPTOR, required=True)
    add_flag(replay, PLUGINS_DIR)
    add_flag(replay, INTERCEPTOR_CONFIG)
    add_flag(replay, INTERCEPTOR_TIMEOUT, default=DEFAULT_TIMEOUT_MS)
    replay.add_argument("--from-offsets", metavar="earliest|latest-N|TIMESTAMP",
                        default="earliest",
                        help="where each partition starts: earliest (default), the last N "
                             "records, or the first record at/after a timestamp (ms or ISO-8601)")
    replay.add_argument("--to-offsets", metavar="latest|TIMESTAMP", default="latest",
                        help="where each partition ends (exclusive): the end at start (the "
                             "last stable offset read_committed, else the high watermark; "
                             "default) or the first record at/after a timestamp")
    output = replay.add_mutually_exclusive_group()
    output.add_argument("--output-topic", metavar="NAME",
                        help="backfill: produce the transformed records to this topic "
                             "(created with the source's partition count if missing)")
    output.add_argument("--output-path", metavar="DIR",
                        help="backfill: write the transformed records as Parquet to DIR")
    replay.add_argument("--report", metavar="DIR",
                        help="report directory (default ./kiproxy-replay-report)")
    replay.add_argument("--reader", choices=("auto", "spark-kafka", "fetch", "consumer"),
                        default="auto",
                        help="how executors read: auto (Spark's Kafka source if on the "
                             "classpath, else fetch), fetch (raw Fetch, stored batches), "
                             "consumer (confluent-kafka, fixed-size chunks)")
    replay.add_argument("--isolation-level", choices=("read_committed", "read_uncommitted"),
                        default="read_committed",
                        help="read as a consumer of this isolation.level: read_committed "
                             "(default) leaves out aborted transactions and stops at the last "
                             "stable offset; read_uncommitted reads every stored record")
    replay.add_argument("--max-records-per-task", metavar="N", type=int, default=100_000,
                        help="split a partition's range into tasks of N offsets (dry run and "
                             "Parquet; default 100000)")
    replay.add_argument("--chunk-records", metavar="N", type=int, default=500,
                        help="batch size where stored batch boundaries are not visible "
                             "(default 500)")
    _client_args(replay)
    _spark_args(replay)

    report = subparsers.add_parser(
        "report", help="aggregate the proxy's audit events into traffic reports on Spark",
        description="Aggregate audit events into bytes and records by topic, client id, "
                    "principal and hour, rejections by reason, produce latency percentiles "
                    "and idle topics: Parquet and CSV tables, PNG charts and index.html.")
    report.add_argument("--audit", metavar="PATH_OR_GLOB", action="append", default=[],
                        help="audit log file(s) written with --audit-log (repeatable; quote "
                             "globs such as 'audit.jsonl*')")
    report.add_argument("--audit-topic", metavar="NAME",
                        help="also read the events the proxy sent to this topic (needs "
                             "--bootstrap)")
    report.add_argument("--bootstrap", metavar="HOST:PORT",
                        help="cluster of --audit-topic; also lists its topics to find idle ones")
    report.add_argument("--out", metavar="DIR", required=True, help="output directory")
    report.add_argument("--since", metavar="TIMESTAMP",
                        help="window start (ms or ISO-8601; default: the first event)")
    report.add_argument("--until", metavar="TIMESTAMP",
                        help="window end, exclusive (default: after the last event)")
    report.add_argument("--replay", metavar="[ROUTE=]DIR", action="append", default=[],
                        help="a `kiproxy replay` report directory (dry run of the route's "
                             "rule over history) to set beside the route's live figures on "
                             "the same topics (repeatable; ROUTE: default the route with the "
                             "most events on those topics)")
    _client_args(report)
    _spark_args(report)


def _conf(items: list[str]) -> dict[str, str]:
    out = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise PipelineError(f"--spark-conf {item!r}: expected KEY=VALUE")
        out[key.strip()] = value
    return out


def _interceptor_config(text: str | None) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise PipelineError(f"--interceptor-config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise PipelineError("--interceptor-config must be a JSON object")
    return value


def _positive(name: str, value: int) -> int:
    if value <= 0:
        raise PipelineError(f"{name} must be a positive number, not {value}")
    return value


def _replay(args: argparse.Namespace) -> int:
    from kiproxy.pipelines.apply import InterceptorSpec
    from kiproxy.pipelines.offsets import parse_from_offsets, parse_to_offsets

    try:
        start = parse_from_offsets(args.from_offsets)
        end = parse_to_offsets(args.to_offsets)
    except ValueError as exc:
        raise PipelineError(str(exc)) from None
    if args.plugins_dir is not None and not Path(args.plugins_dir).is_dir():
        raise PipelineError(f"--plugins-dir {args.plugins_dir} is not a directory")
    spec = InterceptorSpec(args.interceptor, _interceptor_config(args.interceptor_config),
                           str(Path(args.plugins_dir).resolve()) if args.plugins_dir else None,
                           None, _positive("--interceptor-timeout-ms",
                                           args.interceptor_timeout_ms))
    security = _security(args)
    from kiproxy.pipelines.replay import ReplayOptions, run_replay

    report_dir = Path(args.report or "kiproxy-replay-report")
    summary = run_replay(ReplayOptions(
        bootstrap=args.bootstrap, topic=args.topic, interceptor=spec,
        from_offsets=start, to_offsets=end, report_dir=report_dir,
        output_topic=args.output_topic, output_path=args.output_path, master=args.master,
        reader=args.reader,
        max_records_per_task=_positive("--max-records-per-task", args.max_records_per_task),
        chunk_records=_positive("--chunk-records", args.chunk_records),
        spark_conf=_conf(args.spark_conf), progress=False if args.no_progress else None,
        verbose=args.verbose,
        from_text=args.from_offsets, to_text=args.to_offsets, security=security,
        isolation_level=args.isolation_level,
    ))
    print(f"kiproxy replay: {summary['records']} records in {summary['batches']} batches; "
          f"{summary['transformed_records']} transformed, {summary['rejected_records']} "
          f"rejected in {summary['rejected_batches']} batches; "
          f"{summary['written_records']} written"
          + (f"; {summary['aborted_records_skipped']} aborted records skipped"
             if summary["aborted_records_skipped"] else "")
          + (f" to {args.output_topic or args.output_path}" if summary["output"] else "")
          + f"; {summary['records_per_s']} records/s")
    print(f"kiproxy replay: report in {report_dir.resolve() / 'index.html'}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from kiproxy.pipelines.offsets import parse_timestamp

    try:
        since = parse_timestamp(args.since) if args.since else None
        until = parse_timestamp(args.until) if args.until else None
    except ValueError as exc:
        raise PipelineError(f"--since/--until: {exc}") from None
    security = _security(args)
    from kiproxy.pipelines.impact import parse_replay_arg
    from kiproxy.pipelines.report import ReportOptions, run_report

    out = Path(args.out)
    summary = run_report(ReportOptions(
        audit=args.audit, out_dir=out, audit_topic=args.audit_topic, bootstrap=args.bootstrap,
        since_ms=since, until_ms=until, master=args.master, spark_conf=_conf(args.spark_conf),
        progress=False if args.no_progress else None, verbose=args.verbose,
        security=security, replays=[parse_replay_arg(a) for a in args.replay],
    ))
    print(f"kiproxy report: {summary['produce_events']} produce events, {summary['records']} "
          f"records, {summary['bytes']} bytes, {summary['rejected_records']} rejected records")
    for sentence in summary["policy"]["replays"]:
        print(f"kiproxy report: {sentence}")
    print(f"kiproxy report: written to {out.resolve() / 'index.html'}")
    return 0


def _spark_failure(exc: BaseException) -> str:
    """The line of a failed Spark job that says what went wrong (not the JVM stack)."""
    text = str(exc)
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith(("kiproxy.pipelines.errors.", "PipelineError",
                            "kiproxy.interceptors.loader.")):
            return line.split(": ", 1)[-1]
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[0][:500] if lines else type(exc).__name__


def run(args: argparse.Namespace) -> int:
    """Run ``args.command`` (``replay`` or ``report``); returns the exit code."""
    from kiproxy.interceptors.loader import PluginLoadError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    command = args.command
    try:
        from kiproxy.pipelines.session import check_java, check_pyspark

        check_pyspark()
        check_java()
        return _replay(args) if command == "replay" else _report(args)
    except JavaMissing as exc:
        print(f"kiproxy {command}: {exc}", file=sys.stderr)
        return 2
    except PluginLoadError as exc:
        print(f"kiproxy {command}: plugin error: {exc}", file=sys.stderr)
        return 2
    except PipelineError as exc:
        print(f"kiproxy {command}: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"kiproxy {command}: {exc}", file=sys.stderr)
        return 1
    except Exception as exc:
        if type(exc).__module__.startswith(("py4j", "pyspark")):
            print(f"kiproxy {command}: the Spark job failed: {_spark_failure(exc)}",
                  file=sys.stderr)
            return 1
        raise


def main(argv: list[str] | None = None) -> int:
    """``python -m kiproxy.pipelines`` or ``spark-submit .../__main__.py``: replay or report."""
    parser = argparse.ArgumentParser(prog="kiproxy-pipelines")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    add_parsers(sub)
    return run(parser.parse_args(argv))
