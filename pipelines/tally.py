"""Counting what a replay saw: per topic-partition tallies that executors fill and the
driver merges into the report's ``summary.json``.

Counts, per partition: ``batches`` and ``records`` seen; ``transformed_batches``
(batches the interceptor changed) and ``transformed_records`` (records that differ
in any field, offset delta included); ``rejected_batches`` and
``rejected_records`` (every record of a rejected batch); ``passed_records``
(records of batches that were not rejected, changed or not);
``aborted_records_skipped`` (records of aborted transactions a read_committed
reader dropped) and ``control_batches_skipped`` (transaction markers), which only
the ``fetch`` reader can count (None in the summary for the others). Rejection reasons
are keyed by error code and message, with batch and record counts and up to
:data:`MAX_SAMPLES` record coordinates each (the lowest offsets, so merging is
deterministic). ``first_timestamp`` and ``last_timestamp`` (ms, per partition and
overall) bound the record timestamps read: the history a dry run covered.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kiproxy.interceptors.verdict import Outcome
from kiproxy.pipelines.apply import error_name
from kiproxy.pipelines.offsets import OffsetRange
from kiproxy.pipelines.read_committed import BatchFate
from kiproxy.pipelines.sources import SourceBatch

__all__ = ["COUNTERS", "MAX_SAMPLES", "SKIP_COUNTERS", "PartitionTally", "ReasonTally",
           "ReplayTally", "build_summary"]

MAX_SAMPLES = 5
COUNTERS = ("batches", "records", "passed_records", "transformed_batches",
            "transformed_records", "rejected_batches", "rejected_records", "stored_batches",
            "chunked_batches", "written_records", "aborted_records_skipped",
            "control_batches_skipped")
SKIP_COUNTERS = ("aborted_records_skipped", "control_batches_skipped")
"""Counters only the ``fetch`` reader can fill: None in a summary of the other readers."""


@dataclass(slots=True)
class ReasonTally:
    """One rejection reason (error code and message) on one partition."""

    batches: int = 0
    records: int = 0
    samples: list[int] = field(default_factory=list)
    """Offsets of sample rejected records (at most MAX_SAMPLES, lowest first)."""

    def merge(self, other: ReasonTally) -> None:
        """Add ``other`` into this tally."""
        self.batches += other.batches
        self.records += other.records
        self.samples = sorted(set(self.samples) | set(other.samples))[:MAX_SAMPLES]


@dataclass(slots=True)
class PartitionTally:
    """Counters and rejection reasons of one topic-partition."""

    counts: dict[str, int] = field(default_factory=lambda: dict.fromkeys(COUNTERS, 0))
    first_offset: int | None = None
    last_offset: int | None = None
    first_timestamp: int | None = None
    """Earliest record timestamp seen (ms), the history's start."""
    last_timestamp: int | None = None
    reasons: dict[tuple[int, str], ReasonTally] = field(default_factory=dict)

    def _timestamps(self, first: int | None, last: int | None) -> None:
        if first is not None:
            self.first_timestamp = first if self.first_timestamp is None \
                else min(self.first_timestamp, first)
        if last is not None:
            self.last_timestamp = last if self.last_timestamp is None \
                else max(self.last_timestamp, last)

    def merge(self, other: PartitionTally) -> None:
        """Add ``other`` into this tally."""
        for k, v in other.counts.items():
            self.counts[k] = self.counts.get(k, 0) + v
        if other.first_offset is not None:
            self.first_offset = other.first_offset if self.first_offset is None \
                else min(self.first_offset, other.first_offset)
        if other.last_offset is not None:
            self.last_offset = other.last_offset if self.last_offset is None \
                else max(self.last_offset, other.last_offset)
        self._timestamps(other.first_timestamp, other.last_timestamp)
        for key, reason in other.reasons.items():
            mine = self.reasons.get(key)
            if mine is None:
                self.reasons[key] = ReasonTally(reason.batches, reason.records,
                                                list(reason.samples))
            else:
                mine.merge(reason)


@dataclass(slots=True)
class ReplayTally:
    """Tallies of every topic-partition one task (or the whole job) saw."""

    partitions: dict[tuple[str, int], PartitionTally] = field(default_factory=dict)

    def add(self, batch: SourceBatch, outcome: Outcome, written: int = 0) -> None:
        """Count one batch and its verdict (``written``: records sent to the output)."""
        tp = self.partitions.setdefault((batch.topic, batch.partition), PartitionTally())
        c = tp.counts
        n = len(batch.records)
        c["batches"] += 1
        c["records"] += n
        c["stored_batches" if batch.stored else "chunked_batches"] += 1
        c["written_records"] += written
        first, last = batch.offsets[0], batch.offsets[-1]
        tp.first_offset = first if tp.first_offset is None else min(tp.first_offset, first)
        tp.last_offset = last if tp.last_offset is None else max(tp.last_offset, last)
        if batch.records:
            stamps = [r.timestamp for r in batch.records]
            tp._timestamps(min(stamps), max(stamps))
        if outcome.kind == "rejected":
            c["rejected_batches"] += 1
            c["rejected_records"] += n
            reason = tp.reasons.setdefault((outcome.code, outcome.message or ""), ReasonTally())
            reason.batches += 1
            reason.records += n
            samples = [batch.offsets[i] for i, _ in outcome.record_errors if 0 <= i < n] \
                or [first]
            reason.samples = sorted(set(reason.samples) | set(samples))[:MAX_SAMPLES]
            return
        c["passed_records"] += n
        if outcome.kind == "transformed":
            c["transformed_batches"] += 1
            c["transformed_records"] += sum(
                a != b for a, b in zip(batch.records, outcome.records, strict=True))

    def skip(self, topic: str, partition: int, fate: BatchFate, records: int) -> None:
        """Count a batch the reader skipped: ``records`` records of an aborted transaction
        (``BatchFate.ABORTED``) or one transaction marker (``BatchFate.CONTROL``)."""
        c = self.partitions.setdefault((topic, partition), PartitionTally()).counts
        if fate is BatchFate.ABORTED:
            c["aborted_records_skipped"] += records
        elif fate is BatchFate.CONTROL:
            c["control_batches_skipped"] += 1

    def merge(self, other: ReplayTally) -> ReplayTally:
        """Add ``other`` into this tally and return self."""
        for key, part in other.partitions.items():
            mine = self.partitions.get(key)
            if mine is None:
                mine = self.partitions[key] = PartitionTally()
            mine.merge(part)
        return self

    @classmethod
    def merged(cls, tallies: Iterable[ReplayTally]) -> ReplayTally:
        """One tally of all ``tallies``."""
        out = cls()
        for t in tallies:
            out.merge(t)
        return out


def _reason_rows(topic: str, partition: int, reasons: Mapping[tuple[int, str], ReasonTally]
                 ) -> list[dict[str, Any]]:
    return [
        {"error": error_name(code), "error_code": code, "message": message,
         "batches": r.batches, "records": r.records,
         "samples": [{"topic": topic, "partition": partition, "offset": o} for o in r.samples]}
        for (code, message), r in sorted(reasons.items(), key=lambda kv: -kv[1].records)
    ]


def _merge_reasons(rows: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    merged: dict[tuple[int, str], dict[str, Any]] = {}
    for row in rows:
        key = (row["error_code"], row["message"])
        m = merged.get(key)
        if m is None:
            merged[key] = {**row, "samples": list(row["samples"])}
            continue
        m["batches"] += row["batches"]
        m["records"] += row["records"]
        m["samples"] = sorted(m["samples"] + row["samples"],
                              key=lambda s: (s["topic"], s["partition"], s["offset"])
                              )[:MAX_SAMPLES]
    return sorted(merged.values(), key=lambda r: (-r["records"], r["error_code"], r["message"]))


def build_summary(tally: ReplayTally, ranges: Iterable[OffsetRange],
                  skips_counted: bool = True) -> dict[str, Any]:
    """The counting part of ``summary.json``: totals at the top level, then per topic
    and per partition (every planned partition appears, read or empty).

    ``skips_counted`` False (a reader that cannot count them): the
    :data:`SKIP_COUNTERS` are None at every level.
    """
    topics: dict[str, dict[str, Any]] = {}
    for r in sorted(ranges, key=lambda r: (r.topic, r.partition)):
        part = tally.partitions.get((r.topic, r.partition), PartitionTally())
        topic = topics.setdefault(r.topic, {**dict.fromkeys(COUNTERS, 0), "partitions": {},
                                            "reasons": []})
        for k in COUNTERS:
            topic[k] += part.counts.get(k, 0)
        reasons = _reason_rows(r.topic, r.partition, part.reasons)
        topic["reasons"].extend(reasons)
        topic["partitions"][str(r.partition)] = {
            "start_offset": r.start, "end_offset": r.end,
            "first_offset_read": part.first_offset, "last_offset_read": part.last_offset,
            "first_timestamp": part.first_timestamp, "last_timestamp": part.last_timestamp,
            **{k: part.counts.get(k, 0) for k in COUNTERS}, "reasons": reasons,
        }
    totals = {k: sum(t[k] for t in topics.values()) for k in COUNTERS}
    firsts = [p.first_timestamp for p in tally.partitions.values()
              if p.first_timestamp is not None]
    lasts = [p.last_timestamp for p in tally.partitions.values() if p.last_timestamp is not None]
    all_reasons = _merge_reasons(r for t in topics.values() for r in t["reasons"])
    for t in topics.values():
        t["reasons"] = _merge_reasons(t["reasons"])
    if not skips_counted:
        for level in (totals, *topics.values(),
                      *(p for t in topics.values() for p in t["partitions"].values())):
            level.update(dict.fromkeys(SKIP_COUNTERS))
    return {**totals, "first_timestamp": min(firsts, default=None),
            "last_timestamp": max(lasts, default=None), "reasons": all_reasons,
            "topics": topics}
