"""Which offsets a replay reads: offset specs, topic selection and the plan of tasks.

The driver turns ``--from-offsets`` / ``--to-offsets`` into one offset range
``[start, end)`` per partition, then cuts large ranges into tasks. A task owns
the stored batches that *start* in its share of the range (a batch that begins
before the range start belongs to the first task), so every stored batch is
read by exactly one task and rebuilt whole; records outside the partition's
range are clipped off the first and last batch.
"""

from __future__ import annotations

import datetime
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from kiproxy.pipelines.errors import PipelineError
from kiproxy.pipelines.fetch_client import BrokerError, ClusterMetadata, FetchClient

__all__ = [
    "OffsetBound",
    "OffsetRange",
    "ReplayTask",
    "parse_from_offsets",
    "parse_timestamp",
    "parse_to_offsets",
    "plan_ranges",
    "select_topics",
    "split_ranges",
]


@dataclass(frozen=True, slots=True)
class OffsetBound:
    """One end of the replayed range, as given on the command line."""

    kind: str
    """``earliest``, ``latest`` (``value``: records back from the end, 0 = the end itself)
    or ``timestamp`` (``value``: ms since the epoch)."""
    value: int = 0


def parse_timestamp(text: str) -> int:
    """Milliseconds since the epoch from ``1763848800000`` or ISO-8601 (no zone = UTC)."""
    text = text.strip()
    if re.fullmatch(r"-?\d+", text):
        return int(text)
    try:
        moment = datetime.datetime.fromisoformat(text.replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(
            f"{text!r} is not a timestamp: use milliseconds since the epoch or ISO-8601 "
            "such as 2025-11-22T08:00:00Z"
        ) from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return int(moment.timestamp() * 1000)


def parse_from_offsets(text: str) -> OffsetBound:
    """``earliest``, ``latest-N`` (the last N records of each partition) or a TIMESTAMP."""
    text = text.strip()
    if text == "earliest":
        return OffsetBound("earliest")
    match = re.fullmatch(r"latest-(\d+)", text)
    if match:
        return OffsetBound("latest", int(match.group(1)))
    if text == "latest":
        return OffsetBound("latest", 0)
    try:
        return OffsetBound("timestamp", parse_timestamp(text))
    except ValueError as exc:
        raise ValueError(f"--from-offsets: expected earliest, latest-N or a timestamp: {exc}") \
            from None


def parse_to_offsets(text: str) -> OffsetBound:
    """``latest`` (the end when the job is planned: the high watermark, or the last stable
    offset for read_committed) or a TIMESTAMP (exclusive)."""
    text = text.strip()
    if text == "latest":
        return OffsetBound("latest", 0)
    try:
        return OffsetBound("timestamp", parse_timestamp(text))
    except ValueError as exc:
        raise ValueError(f"--to-offsets: expected latest or a timestamp: {exc}") from None


@dataclass(frozen=True, slots=True, kw_only=True)
class OffsetRange:
    """The offsets ``[start, end)`` of one partition that a replay reads."""

    topic: str
    partition: int
    start: int
    end: int

    @property
    def size(self) -> int:
        """Offsets in the range (records, unless compaction or markers left gaps)."""
        return max(self.end - self.start, 0)


@dataclass(frozen=True, slots=True, kw_only=True)
class ReplayTask:
    """One Spark task: the batches of a partition that start in ``[start, end)``."""

    topic: str
    partition: int
    range_start: int
    """Start of the partition's whole range: records before it are clipped."""
    range_end: int
    """End of the partition's whole range: records from it on are clipped."""
    start: int
    end: int

    @property
    def size(self) -> int:
        """Offsets in this task's share."""
        return max(self.end - self.start, 0)


def select_topics(pattern: str, metadata: ClusterMetadata, bootstrap: str) -> list[str]:
    """Topics named by ``pattern``: that exact name, else a regex matched against whole names.

    Internal topics (``__*``) are only selected by their exact name.
    """
    topics = metadata.leaders
    if pattern in topics:
        return [pattern]
    try:
        regex = re.compile(pattern)
    except re.error as exc:
        raise PipelineError(f"--topic {pattern!r}: no such topic on {bootstrap}, and not a "
                            f"regular expression either ({exc})") from None
    chosen = sorted(t for t in topics if regex.fullmatch(t) and not t.startswith("__")
                    and t not in metadata.internal)
    if not chosen:
        visible = sorted(t for t in topics if not t.startswith("__"))
        listing = ", ".join(visible[:20]) + (f" ... ({len(visible)} in all)"
                                             if len(visible) > 20 else "")
        raise PipelineError(
            f"--topic {pattern!r}: no topic of that name (or matching that regular expression) "
            f"on {bootstrap}; topics there: {listing or 'none'}. Check the name and --bootstrap."
        )
    return chosen


def plan_ranges(client: FetchClient, topics: Sequence[str], start: OffsetBound,
                end: OffsetBound) -> list[OffsetRange]:
    """One range per partition of ``topics``, resolved against the cluster now.

    A partition ends where a consumer of the client's isolation level stops: the
    high watermark, or the last stable offset (LSO) for read_committed, so an
    open transaction and everything after it is left for a later run.
    """
    metadata = client.metadata()
    tps = [(t, p) for t in topics for p in sorted(metadata.leaders[t])]
    try:
        earliest = client.earliest_offsets(tps)
        out = []
        for topic, partition in tps:
            low = earliest[(topic, partition)]
            high = client.end_offset(topic, partition, low)
            first = _resolve(client, topic, partition, start, low, high)
            last = high if end.kind == "latest" else \
                client.offset_for_timestamp(topic, partition, end.value, low, high)
            out.append(OffsetRange(topic=topic, partition=partition, start=first,
                                   end=max(first, last)))
        return out
    except BrokerError as exc:
        servers = ", ".join(f"{h}:{p}" for h, p in client.bootstrap)
        raise PipelineError(f"planning offsets on {servers} failed: {exc}") from None


def _resolve(client: FetchClient, topic: str, partition: int, bound: OffsetBound,
             low: int, high: int) -> int:
    if bound.kind == "earliest":
        return low
    if bound.kind == "latest":
        return max(low, high - bound.value)
    return client.offset_for_timestamp(topic, partition, bound.value, low, high)


def split_ranges(ranges: Iterable[OffsetRange], max_offsets_per_task: int | None
                 ) -> list[ReplayTask]:
    """Cut each range into tasks of at most ``max_offsets_per_task`` offsets (None: no cut).

    Empty ranges give no task.
    """
    tasks = []
    for r in ranges:
        if r.size == 0:
            continue
        step = r.size if not max_offsets_per_task else max(1, max_offsets_per_task)
        for start in range(r.start, r.end, step):
            tasks.append(ReplayTask(topic=r.topic, partition=r.partition, range_start=r.start,
                                    range_end=r.end, start=start, end=min(start + step, r.end)))
    return tasks
