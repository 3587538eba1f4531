"""The pipelines' pure parts: offset specs, task splitting, reader choice, chunking, batch
framing, Java detection, tallies and the interceptor rules - no Spark, no broker."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import os
import stat
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from kiproxy.interceptors import (
    InterceptContext,
    ProduceRequestInterceptor,
    RecordBatch,
    RejectBatch,
)
from kiproxy.interceptors.loader import PluginLoadError
from kiproxy.pipelines.apply import InterceptorRunner, InterceptorSpec
from kiproxy.pipelines.errors import JavaMissing, PipelineError
from kiproxy.pipelines.fetch_client import FetchClient, FetchedPartition, complete_prefix
from kiproxy.pipelines.offsets import (
    OffsetBound,
    OffsetRange,
    parse_from_offsets,
    parse_timestamp,
    parse_to_offsets,
    split_ranges,
)
from kiproxy.pipelines.read_committed import (
    AbortedTransaction,
    BatchFate,
    ControlRecordType,
    control_type,
    read_committed,
)
from kiproxy.pipelines.session import check_java, java_major_version
from kiproxy.pipelines.sources import SourceBatch, choose_reader, chunk_rows, spark_kafka_options
from kiproxy.pipelines.tally import ReplayTally, build_summary
from kiproxy.protocol.records import Compression, Record, build_batch, decode_batch, decode_batches


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
    assert opts["kafka.isolation.level"] == "read_committed"  # as the replay's default


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


def _txn(base: int, pid: int, n: int = 2, *, transactional: bool = True) -> bytes:
    return build_batch([Record(value=b"v%d" % (base + i), timestamp=1) for i in range(n)],
                       base_offset=base, producer_id=pid, producer_epoch=0,
                       base_sequence=0, transactional=transactional)


def _marker(offset: int, pid: int, kind: ControlRecordType) -> bytes:
    key = struct.pack(">hh", 0, int(kind))
    return build_batch([Record(key=key, value=b"\x00\x00\x00\x00\x00\x00", timestamp=1)],
                       base_offset=offset, producer_id=pid, producer_epoch=0,
                       transactional=True, control=True)


def test_read_committed_drops_aborted_transactions_as_kafkas_consumer_does() -> None:
    """Producer 1 aborts twice (the second abort begins after its first marker), producer 2
    commits in between, plain records interleave: only producer 1's data is dropped."""
    abort, commit = ControlRecordType.ABORT, ControlRecordType.COMMIT
    stored = decode_batches(b"".join([
        _txn(0, 1), _txn(2, 2), _marker(4, 1, abort), _txn(5, 7, transactional=False),
        _txn(7, 1), _marker(9, 2, commit), _marker(10, 1, abort), _txn(11, 1),
        _marker(13, 1, commit), _txn(14, -1, 1, transactional=False)]))
    aborted = [AbortedTransaction(7, 1), AbortedTransaction(0, 1)]  # any order
    fates = [(b.header.base_offset, fate) for b, fate in read_committed(stored, aborted)]
    R, A, C = BatchFate.RECORDS, BatchFate.ABORTED, BatchFate.CONTROL
    assert fates == [(0, A), (2, R), (4, C), (5, R), (7, A), (9, C), (10, C), (11, R),
                     (13, C), (14, R)]
    assert [control_type(b) for b in stored if b.header.is_control] == [abort, commit, abort,
                                                                        commit]
    # Without the broker's list (read_uncommitted, or Tansu) nothing is aborted.
    assert A not in {fate for _, fate in read_committed(stored, ())}


def test_summary_says_none_where_the_reader_cannot_count_skipped_records() -> None:
    tally = ReplayTally()
    tally.skip("t", 0, BatchFate.ABORTED, 5)
    tally.skip("t", 0, BatchFate.CONTROL, 1)
    ranges = [OffsetRange(topic="t", partition=0, start=0, end=9)]
    counted = build_summary(tally, ranges)
    assert (counted["aborted_records_skipped"], counted["control_batches_skipped"]) == (5, 1)
    assert counted["topics"]["t"]["partitions"]["0"]["aborted_records_skipped"] == 5
    unknown = build_summary(ReplayTally(), ranges, skips_counted=False)
    assert unknown["aborted_records_skipped"] is None
    assert unknown["topics"]["t"]["partitions"]["0"]["control_batches_skipped"] is None


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
    from kiproxy.interceptors.testing import make_batch
    from kiproxy.interceptors.verdict import Outcome, Rejected, Transformed

    a, b = ReplayTally(), ReplayTally()
    a.add(_batch([b"x", b"y"], 0), Outcome.of(Rejected(code=44, message="no",
                                                         record_errors=((1, "bad"),))))
    b.add(_batch([b"z"], 7), Outcome.of(Transformed(make_batch(b"Z"))))
    b.add(_batch([b"w"], 3), Outcome.of(Rejected(code=44, message="no")))
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
        if self.mode == "async-stubborn":  # swallows its cancellation at the deadline
            async def stubborn() -> RecordBatch:
                with contextlib.suppress(BaseException):
                    await asyncio.Event().wait()
                for _ in range(5):
                    await asyncio.sleep(0)
                return batch
            return stubborn()
        if self.mode == "same-values":
            return batch.with_records(list(batch.records))
        return batch


def _runner(mode: str, timeout_ms: int = 5000) -> InterceptorRunner:
    return InterceptorRunner(InterceptorSpec(f"{__name__}:_Plugins", {"mode": mode},
                                             timeout_ms=timeout_ms))


@pytest.mark.parametrize(("mode", "kind", "code", "message"), [
    ("pass", "unchanged", 0, ""),
    ("same-values", "unchanged", 0, ""),
    ("drop-one", "rejected", 87,
     "broke the record-count rule: returned 1 records for a batch of 2"),
    ("raise", "rejected", 87, "failed: KeyError: 'boom'"),
    ("reject", "rejected", 44, "nope"),
    ("async-upper", "transformed", 0, ""),
])
def test_interceptor_rules_match_the_proxy(mode: str, kind: str, code: int,
                                           message: str) -> None:
    outcome = _runner(mode).apply(_batch([b"a", b"b"]))
    assert (outcome.kind, outcome.code) == (kind, code)
    assert message in (outcome.message or "")
    if kind == "transformed":
        assert [r.value for r in outcome.records] == [b"A", b"B"]


@pytest.mark.parametrize("mode", ["async-slow", "async-stubborn"])
def test_async_interceptor_past_its_deadline_is_a_timeout(mode: str) -> None:
    outcome = _runner(mode, timeout_ms=50).apply(_batch([b"a"]))
    assert (outcome.kind, outcome.code) == ("rejected", 7)
    assert "did not finish within 50 ms" in (outcome.message or "")


def test_an_unknown_isolation_level_is_refused_before_anything_runs(tmp_path: Path) -> None:
    from kiproxy.pipelines.replay import ReplayOptions, run_replay

    with pytest.raises(PipelineError, match=r"--isolation-level 'read_all': use "
                                            r"read_committed or read_uncommitted"):
        run_replay(ReplayOptions(
            bootstrap="127.0.0.1:1", topic="t", interceptor=InterceptorSpec("no:Such", {}),
            from_offsets=OffsetBound("earliest"), to_offsets=OffsetBound("latest"),
            report_dir=tmp_path, isolation_level="read_all"))


def test_a_fetch_hook_reads_the_stored_records_before_the_interceptor_runs() -> None:
    """``--fetch-hook``: what the interceptor sees is what a consumer through the proxy
    reads (here the stored values reversed back); a hook that refuses rejects the batch
    with its own error."""
    plugins = str(Path(__file__).resolve().parents[1] / "plugins")
    runner = InterceptorRunner(InterceptorSpec(
        f"{__name__}:_Plugins", {"mode": "async-upper"}, plugins,
        fetch_hook="tp_fetch:Reverse"))
    outcome = runner.apply(_batch([b"cba", b"fed"]))
    assert outcome.kind == "transformed"
    assert [r.value for r in outcome.records] == [b"ABC", b"DEF"]
    refusing = InterceptorRunner(InterceptorSpec(
        f"{__name__}:_Plugins", {"mode": "pass"}, plugins, fetch_hook="tp_fetch:RefuseOnConsume"))
    refused = refusing.apply(dataclasses.replace(_batch([b"a"]), topic="refuse-me"))
    assert (refused.kind, refused.code) == ("rejected", -1)
    assert "no reading refuse-me" in (refused.message or "")
    with pytest.raises(PluginLoadError, match="no fetch-side hook"):
        InterceptorRunner(InterceptorSpec(f"{__name__}:_Plugins", {"mode": "pass"}, plugins,
                                          fetch_hook="my_policy:MyPolicy"))


def _client_answering(answers: list[FetchedPartition | None], monkeypatch: pytest.MonkeyPatch
                      ) -> tuple[FetchClient, list[float]]:
    """A FetchClient whose Fetch answers are ``answers``, in turn, and the pauses it made."""
    client = FetchClient("127.0.0.1:9")
    pauses: list[float] = []
    monkeypatch.setattr(client, "_leader_address", lambda topic, partition: ("127.0.0.1", 9))
    monkeypatch.setattr(client, "_fetch_once", lambda *args: answers.pop(0))
    monkeypatch.setattr("kiproxy.pipelines.fetch_client.time.sleep", pauses.append)
    return client, pauses


def test_an_empty_fetch_below_the_partitions_end_is_asked_again(
        monkeypatch: pytest.MonkeyPatch) -> None:
    batch = decode_batch(build_batch([Record(key=None, value=b"v", timestamp=1)],
                                     base_offset=14))
    empty = FetchedPartition(high_watermark=24, log_start_offset=0)
    client, pauses = _client_answering(
        [None, empty, empty, FetchedPartition(24, 0, [batch])], monkeypatch)
    assert client.fetch("t", 0, 14).batches == [batch]
    assert pauses == [0.01, 0.1]  # after each empty answer, as long as its wait
    # at the end of the partition, an empty answer is the answer
    client, pauses = _client_answering([FetchedPartition(24, 0)], monkeypatch)
    assert client.fetch("t", 0, 24).batches == [] and pauses == []
    # a broker that keeps answering empty: the last answer, for the caller to name
    client, pauses = _client_answering([empty] * 5, monkeypatch)
    assert client.fetch("t", 0, 14) is empty and len(pauses) == 4


def test_a_backfill_names_a_header_key_that_is_not_utf8_and_copies_the_rest(
        broker: Any) -> None:
    """A stored header key that is not UTF-8 is read as lone surrogates, which the
    backfill's confluent-kafka producer cannot write (given them in a ``str`` it crashes
    the process; as bytes it writes their ``repr``): that record is not copied and the
    backfill fails naming it, the others copied."""
    from kiproxy.interceptors.testing import make_record
    from kiproxy.pipelines.client_security import PLAINTEXT
    from kiproxy.pipelines.replay import _Producer

    key = b"\xff\xfeid".decode("utf-8", "surrogateescape")
    topic = "backfill-stored-key"
    producer = _Producer(broker.bootstrap, topic, PLAINTEXT)
    producer.send(0, make_record(b"v1", headers=[(key, b"1"), ("h", b"2")]))
    producer.send(0, make_record(b"v2", headers=[("caf\u00e9", b"3")]))
    with pytest.raises(PipelineError, match=r"header key '\\xff\\xfeid' is not UTF-8"):
        producer.close()
    fetched = FetchClient(broker.bootstrap).fetch(topic, 0, 0)
    (stored,) = [r for b in fetched.batches for r in b.records]
    assert (stored.value, stored.headers[0].key) == (b"v2", "caf\u00e9")


def test_an_output_row_writes_a_header_key_that_is_not_utf8_escaped() -> None:
    """Spark hands text to the JVM, which wrote a lone surrogate as U+FFFD without a
    word: a row (Parquet, a report) holds the key with its bytes as ``\\xNN`` escapes."""
    from types import SimpleNamespace

    from kiproxy.interceptors.testing import make_record
    from kiproxy.pipelines.replay import _output_row

    key = b"\xff\xfeid".decode("utf-8", "surrogateescape")
    row = _output_row(SimpleNamespace(topic="t", partition=0), 7,  # type: ignore[arg-type]
                      make_record(b"v", headers=[(key, b"1"), ("caf\u00e9", b"2")]))
    assert row[7] == [("\\xff\\xfeid", b"1"), ("caf\u00e9", b"2")]


def test_the_consumer_reader_names_a_header_key_it_cannot_read(broker: Any) -> None:
    """confluent-kafka cannot read a header key that is not UTF-8 (brokers store what a
    client sent): it raised a bare SystemError out of the Spark task. The reader says
    where, and which reader reads every key; that one reads it."""
    import time

    from support.raw_client import RawClient

    from kiproxy.pipelines.offsets import ReplayTask
    from kiproxy.pipelines.sources import consumer_chunks
    from kiproxy.protocol.records import Header

    topic = "consumer-reader-stored-key"
    key = b"\xff\xfeid".decode("utf-8", "surrogateescape")
    batch = build_batch([Record(key=b"k", value=b"v", timestamp=int(time.time() * 1000),
                                headers=(Header(key, b"1"),))])
    from confluent_kafka.admin import AdminClient, NewTopic  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": broker.bootstrap})
    admin.create_topics([NewTopic(topic, 1, 1)])[topic].result(30)
    with RawClient(broker.bootstrap) as client:
        client.send(RawClient.produce(9, [(topic, batch)], acks=1, correlation_id=1))
        _, answer = client.read_produce(9)
    assert [p.error_code for t in answer.responses for p in t.partition_responses] == [0]
    task = ReplayTask(topic=topic, partition=0, range_start=0, range_end=1, start=0, end=1)
    with pytest.raises(PipelineError, match=rf"{topic}\[0\] at offset 0: confluent-kafka "
                       r"cannot read the record's headers .* --reader fetch reads every key"):
        list(consumer_chunks(broker.bootstrap, task, 10, poll_timeout=10))
    fetched = FetchClient(broker.bootstrap).fetch(topic, 0, 0)
    (stored,) = [r for b in fetched.batches for r in b.records]
    assert stored.headers == (Header(key, b"1"),)


def test_a_python_workers_failure_names_its_exception() -> None:
    from kiproxy.pipelines.cli import _spark_failure

    worker = Exception(
        "An exception was thrown from the Python worker. Please see the stack trace below.\n"
        "Traceback (most recent call last):\n"
        '  File "/x/pyspark/worker.py", line 1, in main\n'
        "    import kiproxy.protocol._codec\n"
        "ModuleNotFoundError: No module named 'kiproxy.protocol._codec'\n"
        "\n\tat org.apache.spark.api.python.BasePythonRunner.handle(PythonRunner.scala:572)\n")
    assert _spark_failure(worker) == (
        "An exception was thrown from the Python worker: "
        "ModuleNotFoundError: No module named 'kiproxy.protocol._codec'")
    assert _spark_failure(Exception("Job aborted\n\tat org.x")) == "Job aborted"


def test_no_module_of_the_package_a_script_runs_from_hides_a_standard_one() -> None:
    # spark-submit runs kiproxy/pipelines/__main__.py as a script: its folder comes first
    # on sys.path, where pipelines/html.py once hid the standard library's html (and with
    # it matplotlib, which the command then said was not installed).
    import kiproxy.pipelines

    folder = Path(kiproxy.pipelines.__file__).parent
    assert sorted(p.name for p in folder.glob("*.py")
                  if p.stem in sys.stdlib_module_names) == []


def test_the_command_runs_as_the_script_spark_submit_is_given(tmp_path: Path) -> None:
    import kiproxy.pipelines.__main__ as script

    done = subprocess.run([sys.executable, script.__file__, "report", "--audit",
                           str(tmp_path / "none.jsonl"), "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=120, cwd=tmp_path)
    assert done.returncode == 2, done.stderr
    assert "no file matches" in done.stderr, done.stderr  # it got as far as the input
