"""The ``kiproxy replay`` and ``kiproxy report`` subcommands.

``add_parsers`` adds them to ``kiproxy``'s argument parser; ``run`` executes one.
Nothing here imports pyspark: ``kiproxy run`` never pays for it. Errors a user
can fix (bad input, unknown topic, a plugin that does not load, no Java) print
one ``kiproxy <command>: ...`` line and exit 2; a failed Spark job exits 1.
"""

from __future__ import annotations

import argparse
import logging
import re
import sys
from typing import Any, TypeVar

from kiproxy.interceptors.flags import FlagError, add_model_flags, model_from_flags
from kiproxy.pipelines.errors import JavaMissing, PipelineError
from kiproxy.pipelines.settings import ReplaySettings, ReportSettings, SparkJobSettings

__all__ = ["COMMANDS", "add_parsers", "main", "run"]

COMMANDS = ("replay", "report")

_S = TypeVar("_S", ReplaySettings, ReportSettings)


def _security(settings: SparkJobSettings) -> Any:
    from kiproxy.pipelines.client_security import load_client_security

    return load_client_security(settings.command_config, settings.consumer_property)


def add_parsers(subparsers: Any) -> None:
    """Add ``replay`` and ``report`` to ``kiproxy``'s subcommands; their flags are the
    fields of :class:`ReplaySettings` and :class:`ReportSettings`."""
    replay = subparsers.add_parser(
        "replay", help="run an interceptor over a topic's history on Spark (dry run or backfill)",
        description="Replay an interceptor over stored records on Spark. Without an output "
                    "option it is a dry run that reports what would be rejected or changed; "
                    "with --output-topic or --output-path it writes the transformed records.")
    add_model_flags(replay, ReplaySettings, "replay")
    report = subparsers.add_parser(
        "report", help="aggregate the proxy's audit events into traffic reports on Spark",
        description="Aggregate audit events into bytes and records by topic, client id, "
                    "principal and hour, rejections by reason, produce latency percentiles "
                    "and idle topics: Parquet and CSV tables, PNG charts and index.html.")
    add_model_flags(report, ReportSettings, "report")


def _settings(args: argparse.Namespace, model: type[_S]) -> _S:
    try:
        return model_from_flags(args, model)
    except FlagError as exc:
        raise PipelineError(str(exc)) from None


def _replay(args: argparse.Namespace) -> int:
    from kiproxy.pipelines.apply import InterceptorSpec
    from kiproxy.pipelines.offsets import parse_from_offsets, parse_to_offsets

    settings = _settings(args, ReplaySettings)
    try:
        start = parse_from_offsets(settings.from_offsets)
        end = parse_to_offsets(settings.to_offsets)
    except ValueError as exc:
        raise PipelineError(str(exc)) from None
    plugins = settings.plugins_dir
    if plugins is not None and not plugins.is_dir():
        raise PipelineError(f"--plugins-dir {plugins} is not a directory")
    spec = InterceptorSpec(settings.interceptor, settings.interceptor_config,
                           str(plugins.resolve()) if plugins else None,
                           None, settings.interceptor_timeout_ms, settings.fetch_hook,
                           settings.fetch_hook_config)
    security = _security(settings)
    from kiproxy.pipelines.replay import ReplayOptions, run_replay

    summary = run_replay(ReplayOptions(
        bootstrap=settings.bootstrap, topic=settings.topic, interceptor=spec,
        from_offsets=start, to_offsets=end, report_dir=settings.report,
        output_topic=settings.output_topic, output_path=settings.output_path,
        master=settings.master, reader=settings.reader,
        max_records_per_task=settings.max_records_per_task,
        chunk_records=settings.chunk_records, spark_conf=settings.spark_conf,
        progress=settings.progress, verbose=settings.verbose,
        from_text=settings.from_offsets, to_text=settings.to_offsets, security=security,
        isolation_level=settings.isolation_level,
    ))
    print(f"kiproxy replay: {summary['records']} records in {summary['batches']} batches; "
          f"{summary['transformed_records']} transformed, {summary['rejected_records']} "
          f"rejected in {summary['rejected_batches']} batches; "
          f"{summary['written_records']} written"
          + (f" to {settings.output_topic or settings.output_path}"
             if summary["output"] else "")
          + (f"; {summary['aborted_records_skipped']} aborted records skipped"
             if summary["aborted_records_skipped"] else "")
          + f"; {summary['records_per_s']} records/s")
    print(f"kiproxy replay: report in {settings.report.resolve() / 'index.html'}")
    return 0


def _report(args: argparse.Namespace) -> int:
    from kiproxy.pipelines.offsets import parse_timestamp

    settings = _settings(args, ReportSettings)
    try:
        since = parse_timestamp(settings.since) if settings.since else None
        until = parse_timestamp(settings.until) if settings.until else None
    except ValueError as exc:
        raise PipelineError(f"--since/--until: {exc}") from None
    security = _security(settings)
    from kiproxy.pipelines.impact import parse_replay_arg
    from kiproxy.pipelines.report import ReportOptions, run_report

    out = settings.out
    summary = run_report(ReportOptions(
        audit=settings.audit, out_dir=out, audit_topic=settings.audit_topic,
        bootstrap=settings.bootstrap, since_ms=since, until_ms=until, master=settings.master,
        spark_conf=settings.spark_conf, progress=settings.progress, verbose=settings.verbose,
        security=security, replays=[parse_replay_arg(a) for a in settings.replay],
    ))
    print(f"kiproxy report: {summary['produce_events']} produce events, {summary['records']} "
          f"records, {summary['bytes']} bytes, {summary['rejected_records']} rejected records")
    for sentence in summary["policy"]["replays"]:
        print(f"kiproxy report: {sentence}")
    print(f"kiproxy report: written to {out.resolve() / 'index.html'}")
    return 0


def _spark_failure(exc: BaseException) -> str:
    """The line of a failed Spark job that says what went wrong (not the JVM stack): a
    kiproxy error's message, else the first line with, when a Python worker raised, the
    worker's exception (the last line of its traceback) after it."""
    text = str(exc)
    for line in reversed(text.splitlines()):
        line = line.strip()
        if line.startswith(("kiproxy.pipelines.errors.", "PipelineError",
                            "kiproxy.interceptors.loader.")):
            return line.split(": ", 1)[-1]
    lines = [ln for ln in text.splitlines() if ln.strip()]
    if not lines:
        return type(exc).__name__
    first = lines[0].strip()
    if "Traceback (most recent call last)" in text:
        raised = next((ln.strip() for ln in reversed(lines) if _RAISED.match(ln.strip())), None)
        if raised is not None and raised not in first:
            # PySpark's "... Python worker. Please see the stack trace below." then the type
            first = first.split(" Please see the stack trace below")[0].rstrip(".: ")
            first = f"{first}: {raised}"
    return first[:500]


_RAISED = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Exit|Interrupt|Warning)(: .*)?$")
"""The last line of a Python traceback: the exception's type, and its message."""


def run(args: argparse.Namespace) -> int:
    """Run ``args.command`` (``replay`` or ``report``); returns the exit code."""
    from kiproxy.interceptors.loader import PluginLoadError

    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    command = args.command
    try:
        from kiproxy.pipelines.session import check_java, check_pyspark

        check_pyspark(f"kiproxy {command}")
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
