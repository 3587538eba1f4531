"""``PaperTrail`` (``paper_trail``) - a routing trail across mirrored clusters.

Every record gets one more header ``kiproxy-trail`` (by default) whose value
is a compact JSON entry naming the proxy host, the cluster, the topic and the
time the proxy received the record::

    {"host":"kiproxy-east-1","cluster":"east","topic":"orders","ts":1763848800123}

Earlier entries are kept where they are: a record that MirrorMaker copied from
cluster ``east`` (with its headers) into ``west`` through another kiproxy
reads, in header order, the ``east`` entry and then the ``west`` one - the
record's end-to-end route. Other headers keep their order and duplicates.

Failure modes (both reject the batch, POLICY_VIOLATION by default, with
``record_errors`` naming each record): a record whose trail already names this
cluster and topic is in a mirroring loop (``reject_loops``); a record whose
trail already holds ``max_hops`` entries is routed too often. Entries that are
not JSON (written by something else) are kept and counted but never matched.

Config::

    interceptor:
      class: kiproxy.interceptors.builtin.paper_trail:PaperTrail
      config:
        cluster: east              # required: the name of the cluster behind this proxy
        header: kiproxy-trail      # header the entries are written to
        host: null                 # default: the proxy's host name
        max_hops: 16               # 0: no limit
        reject_loops: true
        error: POLICY_VIOLATION
"""

from __future__ import annotations

import json
import time
from typing import Any

from pydantic import Field

from kiproxy.interceptors import (
    Header,
    InterceptContext,
    PluginSettings,
    ProduceRequestInterceptor,
    Record,
    RecordBatch,
    RejectBatch,
)
from kiproxy.interceptors.settings import ErrorName

_MAX_REPORTED = 50


def trail_entries(record: Record, header: str = "kiproxy-trail") -> list[dict[str, Any]]:
    """The record's routing trail, oldest first (entries that are not JSON objects skipped)."""
    entries = []
    for value in record.header_values(header):
        try:
            entry = json.loads(value) if value is not None else None
        except (ValueError, UnicodeDecodeError):
            continue
        if isinstance(entry, dict):
            entries.append(entry)
    return entries


class PaperTrailSettings(PluginSettings):
    """Settings of ``paper_trail``."""

    cluster: str = Field(min_length=1)
    """Required: the name of the cluster behind this proxy."""
    header: str = "kiproxy-trail"
    """The header the trail entries are written to."""
    host: str | None = None
    """The host named in the entries; default: the proxy's host name."""
    max_hops: int = Field(default=16, ge=0, strict=True)
    """Entries a record's trail may already hold before it is rejected; 0: no limit."""
    reject_loops: bool = True
    """Reject a record whose trail already names this cluster and topic."""
    error: ErrorName = "POLICY_VIOLATION"
    """The error code of a rejection."""


class PaperTrail(ProduceRequestInterceptor[PaperTrailSettings]):
    """Appends a routing-trail entry (host, cluster, topic, time) to every record."""

    def __init__(self) -> None:
        self.cluster = ""
        self.header = "kiproxy-trail"
        self.host: str | None = None
        self.max_hops = 16
        self.reject_loops = True
        self.error = "POLICY_VIOLATION"

    def configure(self, config: PaperTrailSettings) -> None:
        """Take the validated settings."""
        self.cluster = config.cluster
        self.header = config.header
        self.host = config.host
        self.max_hops = config.max_hops
        self.reject_loops = config.reject_loops
        self.error = config.error

    def _entry(self, topic: str, ctx: InterceptContext) -> bytes:
        entry = {
            "host": self.host if self.host is not None else ctx.proxy_host,
            "cluster": self.cluster,
            "topic": topic,
            "ts": ctx.received_at_ms or int(time.time() * 1000),
        }
        return json.dumps(entry, separators=(",", ":"), ensure_ascii=False).encode()

    def _problem(self, record: Record, topic: str) -> str | None:
        hops = record.header_values(self.header)
        if self.max_hops and len(hops) >= self.max_hops:
            return (f"its routing trail already has {len(hops)} entries (max_hops "
                    f"{self.max_hops}); is it mirrored in a loop?")
        if self.reject_loops:
            entries = trail_entries(record, self.header)
            for entry in entries:
                if entry.get("cluster") == self.cluster and entry.get("topic") == topic:
                    route = " -> ".join(f"{e.get('cluster')}/{e.get('topic')}" for e in entries)
                    return (f"routing loop: it already passed cluster {self.cluster!r} topic "
                            f"{topic!r} (trail: {route})")
        return None

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Return the batch with one trail entry appended to every record."""
        added = Header(self.header, self._entry(batch.topic, ctx))
        problems: list[tuple[int, str]] = []
        out = []
        for i, record in enumerate(batch.records):
            if self.header in (h.key for h in record.headers):
                problem = self._problem(record, batch.topic)
                if problem is not None:
                    problems.append((i, problem))
                    if len(problems) >= _MAX_REPORTED:
                        break
                    continue
            out.append(record.with_headers((*record.headers, added)))
        if problems:
            first_index, first = problems[0]
            raise RejectBatch(
                f"PaperTrail ({self.cluster}): {len(problems)} record(s) of "
                f"{batch.topic}[{batch.partition}] rejected; first, record {first_index}: {first}",
                self.error, problems,
            )
        return batch.with_records(out)
