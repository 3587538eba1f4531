"""The pipelines' pure parts: offset specs, task splitting, reader choice, chunking, batch
framing, Java detection, tallies and the interceptor rules - no Spark, no broker."""

from __future__ import annotations

import asyncio
import json
import os
import stat
from pathlib import Path
from typing import Any

import pytest

from kiproxy.interceptors import (
    InterceptContext,
    ProduceRequestInterceptor,
    RecordBatch,
    RejectBatch,
)
from kiproxy.pipelines.apply import InterceptorRunner, InterceptorSpec
from kiproxy.pipelines.errors import JavaMissing, PipelineError
from kiproxy.pipelines.fetch_client import complete_prefix
from kiproxy.pipelines.offsets import (
    OffsetBound,
    OffsetRange,
    parse_from_offsets,
    parse_timestamp,
    parse_to_offsets,
    split_ranges,
)
from kiproxy.pipelines.session import check_java, java_major_version
from kiproxy.pipelines.sources import SourceBatch, choose_reader, chunk_rows, spark_kafka_options
from kiproxy.pipelines.tally import ReplayTally
from kiproxy.protocol.records import Compression, Record, build_batch, decode_batches


def test_offset_specs() -> None:
    assert parse_from_offsets("earliest") == OffsetBound("earliest")
    assert parse_from_offsets("latest-250") == OffsetBound("latest", 250)
    assert parse_from_offsets("1763848800123") == OffsetBound("timestamp", 1763848800123)
    assert parse_from_offsets("2025-11-22T22:00:00Z") == OffsetBound("timestamp", 1763848800000)
    assert parse_to_offsets("latest") == OffsetBound("latest", 0)
    assert parse_timestamp("2025-11-22T22:00:00") == 1763848800000  # no zone: UTC
    with pytest.raises(ValueError, match="--from-offsets"):
        parse_from_offsets("yesterday")
    with pytest.raises(ValueError, match="--to-offsets"):
        parse_to_offsets("earliest")


def test_split_ranges_covers_each_range_once() -> None:
    ranges = [OffsetRange(topic="a", partition=0, start=10, end=35),
              OffsetRange(topic="a", partition=1, start=5, end=5),
              OffsetRange(topic="b", partition=0, start=0, end=7)]
    tasks = split_ranges(ranges, 10)
    assert [(t.topic, t.partition, t.start, t.end) for t in tasks] == [
        ("a", 0, 10, 20), ("a", 0, 20, 30), ("a", 0, 30, 35), ("b", 0, 0, 7)]
    assert all(t.range_start == 10 and t.range_end == 35 for t in tasks[:3])
    assert [(t.start, t.end) for t in split_ranges(ranges, None)] == [(10, 35), (0, 7)]


def test_reader_choice() -> None:
    assert choose_reader("auto", spark_kafka=True) == "spark-kafka"
    assert choose_reader("auto", spark_kafka=False) == "fetch"
    assert choose_reader("consumer", spark_kafka=True) == "consumer"
    assert choose_reader("spark-kafka", spark_kafka=True) == "spark-kafka"
    with pytest.raises(PipelineError, match=r"spark-sql-kafka-0-10_2\.13:4\.3\.0"):
        choose_reader("spark-kafka", spark_kafka=False, spark_version="4.3.0")
    with pytest.raises(PipelineError, match="--reader"):
        choose_reader("kafka-streams", spark_kafka=True)


def test_spark_kafka_options_read_exactly_the_ranges() -> None:
    opts = spark_kafka_options("b:9092", [
        OffsetRange(topic="t", partition=0, start=3, end=9),
        OffsetRange(topic="t", partition=2, start=0, end=4),
        OffsetRange(topic="u", partition=0, start=5, end=5)], 6)
    assert json.loads(opts["assign"]) == {"t": [0, 2]}
    assert json.loads(opts["startingOffsets"]) == {"t": {"0": 3, "2": 0}}
    assert json.loads(opts["endingOffsets"]) == {"t": {"0": 9, "2": 4}}
    assert opts["includeHeaders"] == "true" and opts["minPartitions"] == "6"
    assert opts["kafka.bootstrap.servers"] == "b:9092"


def test_chunk_rows_cut_at_size_and_partition_change() -> None:
    rows = [("t", 0, o, 1000 + o, b"k", b"v%d" % o, [("h", b"x")]) for o in range(5)]
    rows += [("t", 1, o, 2000 + o, None, None, None) for o in range(2)]
    chunks = list(chunk_rows(rows, 2))
    assert [(c.partition, c.offsets) for c in chunks] == [
        (0, (0, 1)), (0, (2, 3)), (0, (4,)), (1, (0, 1))]
    first = chunks[0].records[1]
    assert (first.key, first.value, first.timestamp, first.offset_delta) == (b"k", b"v1", 1001, 1)
    assert [tuple(h) for h in first.headers] == [("h", b"x")]
    assert chunks[3].records[0].value is None and not chunks[0].stored


def test_complete_prefix_drops_a_cut_batch() -> None:
    one = build_batch([Record(value=b"a", timestamp=1)])
    two = build_batch([Record(value=b"b", timestamp=2)], compression=Compression.GZIP)
    assert complete_prefix(one + two) == one + two
    assert complete_prefix(one + two[:-3]) == one
    assert complete_prefix(one[:10]) == b""
    assert len(decode_batches(complete_prefix(one + two[:20]))) == 1


def test_java_version_parsing_and_missing_java(tmp_path: Path) -> None:
    assert java_major_version('openjdk version "17.0.15" 2025-04-15') == 17
    assert java_major_version('java version "1.8.0_392"') == 8
    assert java_major_version('openjdk version "21" 2023-09-19') == 21
    with pytest.raises(JavaMissing, match="openjdk-17-jre-headless"):
        check_java({"PATH": str(tmp_path)})
    with pytest.raises(JavaMissing, match="JAVA_HOME"):
        check_java({"PATH": "", "JAVA_HOME": str(tmp_path)})
    old = tmp_path / "bin" / "java"
    old.parent.mkdir()
    old.write_text('#!/bin/sh\necho \'java version "1.8.0_392"\' >&2\n')
    old.chmod(old.stat().st_mode | stat.S_IEXEC)
    with pytest.raises(JavaMissing, match=r"1\.8\.0_392.*openjdk-17-jre-headless"):
        check_java({"JAVA_HOME": str(tmp_path), "PATH": os.defpath})


def _batch(values: list[bytes | None], first_offset: int = 0) -> SourceBatch:
    return SourceBatch(topic="t", partition=0,
                       offsets=tuple(range(first_offset, first_offset + len(values))),
                       records=tuple(Record(key=b"k", value=v, timestamp=5, offset_delta=i)
                                     for i, v in enumerate(values)), stored=True)


def test_tally_merge_is_keyed_and_deterministic() -> None:
    from kiproxy.pipelines.apply import Outcome

    a, b = ReplayTally(), ReplayTally()
    a.add(_batch([b"x", b"y"], 0), Outcome("rejected", error_code=44, message="no",
                                             record_errors=((1, "bad"),)))
    b.add(_batch([b"z"], 7), Outcome("transformed", records=(), transformed_records=1))
    b.add(_batch([b"w"], 3), Outcome("rejected", error_code=44, message="no"))
    merged = ReplayTally.merged([a, b])
    part = merged.partitions[("t", 0)]
    assert part.counts["records"] == 4 and part.counts["rejected_records"] == 3
    assert part.counts["transformed_records"] == 1
    assert (part.first_offset, part.last_offset) == (0, 7)
    reason = part.reasons[(44, "no")]
    assert (reason.batches, reason.records, reason.samples) == (2, 3, [1, 3])
    # The accumulator keeps one tally per Spark partition: a re-run task replaces its own.
    from kiproxy.pipelines.replay import TallyAccumulator

    acc = TallyAccumulator()
    value = acc.addInPlace(acc.zero({}), {0: a})
    value = acc.addInPlace(value, {0: a})
    assert list(value) == [0]


class _Plugins(ProduceRequestInterceptor):
    def __init__(self) -> None:
        self.mode = "pass"

    def configure(self, config: Any) -> None:
        self.mode = config["mode"]

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> Any:
        assert ctx.client_id == "kiproxy-replay" and ctx.extra["replay"] is True
        if self.mode == "drop-one":
            return batch.with_records(batch.records[1:])
        if self.mode == "raise":
            raise KeyError("boom")
        if self.mode == "reject":
            raise RejectBatch("nope", error="POLICY_VIOLATION", record_errors=[(0, "first")])
        if self.mode == "async-upper":
            async def upper() -> RecordBatch:
                await asyncio.sleep(0)
                return batch.with_records(r.with_value((r.value or b"").upper())
                                          for r in batch.records)
            return upper()
        if self.mode == "async-slow":
            async def slow() -> RecordBatch:
                await asyncio.sleep(5)
                return batch
            return slow()
        if self.mode == "same-values":
            return batch.with_records(list(batch.records))
        return batch


def _runner(mode: str, timeout_ms: int = 5000) -> InterceptorRunner:
    return InterceptorRunner(InterceptorSpec(f"{__name__}:_Plugins", {"mode": mode},
                                             timeout_ms=timeout_ms))


@pytest.mark.parametrize(("mode", "kind", "code", "message"), [
    ("pass", "passed", 0, ""),
    ("same-values", "passed", 0, ""),
    ("drop-one", "rejected", 87,
     "broke the record-count rule: returned 1 records for a batch of 2"),
    ("raise", "rejected", 87, "failed: KeyError: 'boom'"),
    ("reject", "rejected", 44, "nope"),
    ("async-upper", "transformed", 0, ""),
])
def test_interceptor_rules_match_the_proxy(mode: str, kind: str, code: int,
                                           message: str) -> None:
    outcome = _runner(mode).apply(_batch([b"a", b"b"]))
    assert (outcome.kind, outcome.error_code) == (kind, code)
    assert message in outcome.message
    if kind == "transformed":
        assert [r.value for r in outcome.records] == [b"A", b"B"]
        assert outcome.transformed_records == 2


def test_async_interceptor_past_its_deadline_is_a_timeout() -> None:
    outcome = _runner("async-slow", timeout_ms=50).apply(_batch([b"a"]))
    assert (outcome.kind, outcome.error_code) == ("rejected", 7)
    assert "did not finish within 50 ms" in outcome.message
