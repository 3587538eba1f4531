"""What ``kiproxy replay`` and ``kiproxy report`` are asked to do, declared once.

Contract. Each setting of the two Spark jobs is one field of a frozen model here,
with a :class:`~kiproxy.interceptors.flags.Flag` marker: the command-line option,
its help (the field's docstring, first sentence, and its default), its choices and
whether it is required or repeatable are derived from the field
(:func:`~kiproxy.interceptors.flags.add_model_flags`), and the parsed flags become
the model through :func:`~kiproxy.interceptors.flags.model_from_flags`, so a value
the model refuses is reported with the flag's name. :class:`SparkJobSettings` holds
what both jobs share (Spark master and settings, terminal output, the client
security of the cluster); :class:`ReplaySettings` and :class:`ReportSettings` add
each job's own. This module imports neither pyspark nor the proxy.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from kiproxy.interceptors.flags import (
    DEFAULT_TIMEOUT_MS,
    INTERCEPTOR,
    INTERCEPTOR_CONFIG,
    INTERCEPTOR_TIMEOUT,
    PLUGINS_DIR,
    Flag,
    FlagError,
    json_object,
)

__all__ = ["ReplaySettings", "ReportSettings", "SparkJobSettings"]


def _key_values(flag: str) -> Any:
    """A ``parse`` for repeated ``KEY=VALUE`` words into a dict; errors name ``flag``."""
    def parse(items: list[str]) -> dict[str, str]:
        out = {}
        for item in items:
            key, sep, value = item.partition("=")
            if not sep or not key.strip():
                raise FlagError(f"{flag} {item!r}: expected KEY=VALUE")
            out[key.strip()] = value
        return out
    return parse


# The help sections of the flags both jobs share.
_SPARK = "Spark"
_CLIENT = "client security of the cluster"


class SparkJobSettings(BaseModel):
    """The settings ``kiproxy replay`` and ``kiproxy report`` share."""

    # The docstring under a field is its description: the flag's help.
    model_config = ConfigDict(extra="forbid", frozen=True, use_attribute_docstrings=True)

    command_config: Annotated[Path | None, Flag(metavar="FILE", group=_CLIENT)] = None
    """Client settings of the cluster, as Kafka's tools take them (a Java
    client.properties: security.protocol, ssl.*, sasl.*; see docs/replay-security.md;
    keep passwords in this file)."""
    consumer_property: Annotated[list[str], Flag(
        metavar="KEY=VALUE", repeat=True, group=_CLIENT)] = Field(default_factory=list)
    """One client setting (repeatable; overrides --command-config)."""
    master: Annotated[str | None, Flag(metavar="URL", group=_SPARK)] = None
    """Spark master (local[*] when not given, or spark-submit's own; yarn,
    spark://HOST:7077, k8s://...)."""
    spark_conf: Annotated[dict[str, str], Flag(
        metavar="KEY=VALUE", repeat=True, parse=_key_values("--spark-conf"), group=_SPARK)] = Field(
        default_factory=dict)
    """Extra Spark setting (repeatable), e.g. spark.executor.memory=4g."""
    progress: Annotated[bool | None, Flag("--no-progress", set_to=False, group=_SPARK)] = None
    """No progress bar (it is shown only on a terminal anyway)."""
    verbose: Annotated[bool, Flag(set_to=True, group=_SPARK)] = False
    """Show Spark's own start-up messages and warnings."""


class ReplaySettings(SparkJobSettings):
    """``kiproxy replay``: an interceptor over a topic's stored records."""

    bootstrap: Annotated[str, Flag(metavar="HOST:PORT")]
    """Bootstrap server(s) of the cluster to read (comma-separated)."""
    topic: Annotated[str, Flag(metavar="PATTERN")]
    """A topic name, or a regular expression matched against whole names."""
    # The plugin flags of `kiproxy run`, `check` and `replay`, declared once.
    interceptor: Annotated[str, INTERCEPTOR]
    plugins_dir: Annotated[Path | None, PLUGINS_DIR] = None
    interceptor_config: Annotated[dict[str, Any], INTERCEPTOR_CONFIG] = Field(
        default_factory=dict)
    interceptor_timeout_ms: Annotated[int, INTERCEPTOR_TIMEOUT] = Field(
        default=DEFAULT_TIMEOUT_MS, gt=0)
    fetch_hook: Annotated[str | None, Flag(metavar="MODULE:CLASS")] = None
    """Read the stored records as a consumer through the proxy would, through this
    fetch-side hook's ``on_consume`` (``record_encryption`` decrypts), before the
    interceptor runs: a backfill of an encrypted topic into another with other keys. A
    batch the hook refuses is reported as rejected with the hook's error."""
    fetch_hook_config: Annotated[dict[str, Any], Flag(
        metavar="JSON/FILE", parse=json_object("--fetch-hook-config"))] = Field(
        default_factory=dict)
    """The fetch-side hook's configure() argument: a JSON object inline, or the path of a
    JSON or YAML file holding it."""
    from_offsets: Annotated[str, Flag(metavar="earliest|latest-N|TIMESTAMP")] = "earliest"
    """Where each partition starts: earliest, the last N records, or the first record
    at/after a timestamp (ms or ISO-8601)."""
    to_offsets: Annotated[str, Flag(metavar="latest|TIMESTAMP")] = "latest"
    """Where each partition ends (exclusive): latest, the end at start (the last stable
    offset read_committed, else the high watermark), or the first record at/after a
    timestamp."""
    output_topic: Annotated[str | None, Flag(metavar="NAME", exclusive="output")] = None
    """Backfill: produce the transformed records to this topic (created with the
    source's partition count if missing)."""
    output_path: Annotated[str | None, Flag(metavar="DIR", exclusive="output")] = None
    """Backfill: write the transformed records as Parquet to DIR."""
    report: Annotated[Path, Flag(metavar="DIR")] = Path("kiproxy-replay-report")
    """Report directory."""
    reader: Annotated[Literal["auto", "spark-kafka", "fetch", "consumer"], Flag()] = "auto"
    """How executors read: auto (Spark's Kafka source if on the classpath, else fetch),
    fetch (raw Fetch, stored batches), consumer (confluent-kafka, fixed-size chunks)."""
    isolation_level: Annotated[Literal["read_committed", "read_uncommitted"],
                               Flag()] = "read_committed"
    """Read as a consumer of this isolation.level: read_committed leaves out aborted
    transactions and stops at the last stable offset; read_uncommitted reads every stored
    record."""
    max_records_per_task: Annotated[int, Flag(metavar="N")] = Field(default=100_000, gt=0)
    """Split a partition's range into tasks of N offsets (dry run and Parquet)."""
    chunk_records: Annotated[int, Flag(metavar="N")] = Field(default=500, gt=0)
    """Batch size where stored batch boundaries are not visible."""


class ReportSettings(SparkJobSettings):
    """``kiproxy report``: the proxy's audit events as traffic reports."""

    audit: Annotated[list[str], Flag(metavar="PATH_OR_GLOB", repeat=True)] = Field(
        default_factory=list)
    """Audit log file(s) written with --audit-log (repeatable; quote globs such as
    'audit.jsonl*')."""
    audit_topic: Annotated[str | None, Flag(metavar="NAME")] = None
    """Also read the events the proxy sent to this topic (needs --bootstrap)."""
    bootstrap: Annotated[str | None, Flag(metavar="HOST:PORT")] = None
    """Cluster of --audit-topic; also lists its topics to find idle ones."""
    out: Annotated[Path, Flag(metavar="DIR")]
    """Output directory."""
    since: Annotated[str | None, Flag(metavar="TIMESTAMP")] = None
    """Window start (ms or ISO-8601; the first event when not given)."""
    until: Annotated[str | None, Flag(metavar="TIMESTAMP")] = None
    """Window end, exclusive (after the last event when not given)."""
    replay: Annotated[list[str], Flag(metavar="[ROUTE=]DIR", repeat=True)] = Field(
        default_factory=list)
    """A `kiproxy replay` report directory (dry run of the route's rule over history) to set
    beside the route's live figures on the same topics (repeatable; ROUTE: the route with
    the most events on those topics when not given)."""
