"""How long a Fetch answer waits on the proxy: its hooks have a time, and an answer with
nothing to read because of a refusal is held as a client's backoff.

Past the longest ``timeout_ms`` of the links, no further batch of the answer is
handed to the hooks.

Hooks that are each on time can still add up, batch after batch, past what a consumer
waits for one answer (its request timeout), and it would fetch the same offset again
for ever. So a partition stops at the first batch that would start past that time: its
answer ends there (as a broker's answer cut at ``max_bytes``: every field but the
records as the broker sent them), those batches are counted ``deferred``, one WARNING
says so, and the consumer fetches from there next. Every partition hands its first
batch, so each fetch moves on. The pipeline's clock is the test's: each hook call
takes 0.6 of a link's ``timeout_ms`` of it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import re
import sys
import time
from pathlib import Path

import pytest
from kio.schema.errors import ErrorCode
from kio.static.primitive import i32Timedelta

from kiproxy.protocol.fetch_batches import split_fetched_records
from kiproxy.protocol.messages import ApiKey, parse_response, response_type, serialize
from kiproxy.protocol.records import decode_batch
from kiproxy.proxy.config.model import load_config
from kiproxy.proxy.fetch import pipeline as fetch_pipeline
from kiproxy.proxy.fetch.pipeline import FetchPipeline
from kiproxy.proxy.observe.metrics import Metrics
from kiproxy.proxy.routes.runtime import load_routes

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "protocol"))
from fetch_responses import head
from test_fetch_pipeline import MARKER, PLAIN_ID, TOPIC_ID, _answer, _batch, _rewrite

SLOW = '''
from kiproxy.interceptors import FetchResponseInterceptor
from kiproxy.proxy.fetch import pipeline


class Slow(FetchResponseInterceptor):
    """Upper-cases values; each call takes 0.6 s of the pipeline's (test) clock."""

    def on_consume(self, batch, ctx):
        pipeline.time.spent += 0.6
        return batch.with_records(r.with_value((r.value or b"").upper())
                                  for r in batch.records)
'''


class _Clock:
    """``time`` for the pipeline: the real monotonic clock plus what hooks spent."""

    def __init__(self) -> None:
        self.spent = 0.0

    def monotonic(self) -> float:
        return time.monotonic() + self.spent


@pytest.fixture
def pipeline(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> FetchPipeline:
    monkeypatch.setattr(fetch_pipeline, "time", _Clock())
    (tmp_path / "slow_hook.py").write_text(SLOW)
    path = tmp_path / "kiproxy.yaml"
    path.write_text(f'plugins_dir: {tmp_path}\nroutes:\n  - match: {{topic: "s-.*"}}\n'
                    '    interceptors: [{class: "slow_hook:Slow", timeout_ms: 1000}]\n')
    return FetchPipeline(load_routes(load_config(path, {})),
                         topic_names={TOPIC_ID: "s-t", PLAIN_ID: "plain"}, metrics=Metrics())


def _count(pipeline: FetchPipeline, outcome: str) -> float:
    assert pipeline.metrics is not None
    return pipeline.metrics.fetch_batches.labels("s-t", outcome)._value.get()  # type: ignore[no-any-return]


BATCHES = [_batch(0, [b"a0", b"a1"]), _batch(2, [b"b2"]), MARKER,
           _batch(6, [b"c6"]), _batch(7, [b"d7"])]


def test_an_answer_ends_where_its_hooks_time_ran_out(
        pipeline: FetchPipeline, caplog: pytest.LogCaptureFixture) -> None:
    records = b"".join(BATCHES[:2]) + b"".join(BATCHES[3:])
    frame = _answer(12, "s-t", records)
    with caplog.at_level("WARNING", "kiproxy.fetch"):
        out = parse_response(1, 12, _rewrite(pipeline, 12, frame), len(head(12)))
    old = parse_response(1, 12, frame, len(head(12))).responses[0].partitions[0]
    p0, p1 = out.responses[0].partitions
    assert p0.error_code == ErrorCode.none
    assert dataclasses.replace(p0, records=None) == dataclasses.replace(old, records=None)
    split = split_fetched_records(p0.records)
    # 0.6 s after the first batch, 1.2 s after the second: the third is not started
    assert [b.header.base_offset for b in split.batches if b.header] == [0, 2]
    assert not split.partial
    assert [[r.value for r in decode_batch(p0.records[b.start:b.end]).records]
            for b in split.batches] == [[b"A0", b"A1"], [b"B2"]]
    assert _count(pipeline, "transformed") == 3  # two here, the other partition's one
    assert _count(pipeline, "deferred") == 2
    # the other partition of the answer hands its first batch all the same
    (only,) = split_fetched_records(p1.records).batches
    assert only.header is not None and only.header.record_count == 2
    lines = [r.getMessage() for r in caplog.records
             if r.name == "kiproxy.fetch" and r.levelno == logging.WARNING]
    assert len(lines) == 1 and "s-t[0] answered up to offset 6" in lines[0]
    assert "2 batches from there wait for the consumer's next fetch" in lines[0]
    # the time the answer's hooks took, measured, and the budget it passed
    took = re.search(r"\(all its partitions\) had run for (\d+) ms, past (\d+) ms", lines[0])
    assert took is not None and int(took[1]) >= int(took[2]), lines[0]

    # the next fetch starts there and goes on
    out = parse_response(1, 12, _rewrite(pipeline, 12, _answer(12, "s-t", b"".join(
        BATCHES[3:]))), len(head(12)))
    split = split_fetched_records(out.responses[0].partitions[0].records)
    assert [b.header.base_offset for b in split.batches if b.header] == [6, 7]


def test_a_transaction_marker_where_the_time_runs_out_is_sent_with_what_came_before(
        pipeline: FetchPipeline) -> None:
    """Control batches are not handed to hooks: the cut falls at the next data batch."""
    out = parse_response(1, 12, _rewrite(pipeline, 12, _answer(12, "s-t", b"".join(BATCHES))),
                         len(head(12)))
    split = split_fetched_records(out.responses[0].partitions[0].records)
    assert [b.header.base_offset for b in split.batches if b.header] == [0, 2, 5]


def _alone(version: int, records: bytes) -> bytes:
    """A Fetch answer of one partition of ``s-t`` holding ``records``."""
    types = __import__(response_type(ApiKey.FETCH, version).__module__, fromlist=["x"])
    part = types.PartitionData(partition_index=0, error_code=ErrorCode.none,
                               high_watermark=9, last_stable_offset=9, log_start_offset=0,
                               aborted_transactions=(), preferred_read_replica=-1,
                               records=records)
    message = types.FetchResponse(
        throttle_time=i32Timedelta.parse(datetime.timedelta(0)), error_code=ErrorCode.none,
        session_id=0, responses=(types.FetchableTopicResponse(topic="s-t",
                                                              partitions=(part,)),))
    return head(version) + serialize(message)


class _Sleeps:
    """``asyncio`` for the pipeline, its sleeps recorded (and not slept)."""

    def __init__(self) -> None:
        self.slept: list[float] = []
        self.gather = asyncio.gather

    async def sleep(self, seconds: float) -> None:
        self.slept.append(seconds)


REFUSING = '''
from kiproxy.interceptors import FetchResponseInterceptor, RefuseFetch


class Refuse(FetchResponseInterceptor):
    def on_consume(self, batch, ctx):
        if any(r.value == b"no" for r in batch.records):
            raise RefuseFetch("not this one")
        return batch
'''


def test_an_answer_with_nothing_to_read_for_a_refusal_is_held_as_a_backoff(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """aiokafka fetches again at once on UNKNOWN_SERVER_ERROR (about 1,200 refused
    fetches a second from one consumer): an answer that delivers no record because a
    partition was refused is held as a client's retry backoff is; one that delivers
    records anywhere is not."""
    sleeps = _Sleeps()
    monkeypatch.setattr(fetch_pipeline, "asyncio", sleeps)
    (tmp_path / "refusing.py").write_text(REFUSING)
    path = tmp_path / "kiproxy.yaml"
    path.write_text(f'plugins_dir: {tmp_path}\nroutes:\n  - match: {{topic: "s-.*"}}\n'
                    '    interceptors: [{class: "refusing:Refuse"}]\n')
    refusing = FetchPipeline(load_routes(load_config(path, {})), topic_names={})

    out = parse_response(1, 12, _rewrite(refusing, 12, _alone(12, _batch(0, [b"no"]))),
                         len(head(12)))
    assert out.responses[0].partitions[0].error_code == ErrorCode.unknown_server_error
    assert sleeps.slept == [fetch_pipeline.REFUSED_ANSWER_HOLD_S] == [0.1]

    # records before the refused batch are delivered: not held
    _rewrite(refusing, 12, _alone(12, _batch(0, [b"yes"]) + _batch(1, [b"no"])))
    # the refused partition's neighbours have records: not held
    _rewrite(refusing, 12, _answer(12, "s-t", _batch(0, [b"no"])))
    assert sleeps.slept == [0.1]


SLOW_WHOLE = '''
from kiproxy.interceptors import FetchResponseInterceptor
from kiproxy.proxy.fetch import pipeline


class SlowWhole(FetchResponseInterceptor):
    """A partition's blocks at once: 1.2 s of the test clock, every block answered None
    (records wanted); then each batch as records upper-cased, 0.6 s each."""

    def on_consume_blocks(self, blocks, ctx):
        pipeline.time.spent += 1.2
        return [None] * len(blocks)

    def on_consume(self, batch, ctx):
        pipeline.time.spent += 0.6
        return batch.with_records(r.with_value((r.value or b"").upper())
                                  for r in batch.records)
'''


def test_the_first_batch_is_handed_on_after_a_whole_partition_call_ran_out_the_time(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The one on_consume_blocks call used the answer's time and left every batch to
    on_consume: the first is handed all the same (each fetch moves on), the rest wait."""
    monkeypatch.setattr(fetch_pipeline, "time", _Clock())
    (tmp_path / "slow_whole.py").write_text(SLOW_WHOLE)
    path = tmp_path / "kiproxy.yaml"
    path.write_text(f'plugins_dir: {tmp_path}\nroutes:\n  - match: {{topic: "s-.*"}}\n'
                    '    interceptors: [{class: "slow_whole:SlowWhole", timeout_ms: 1000}]\n')
    slow = FetchPipeline(load_routes(load_config(path, {})), topic_names={})
    records = b"".join(BATCHES[:2]) + b"".join(BATCHES[3:])
    out = parse_response(1, 12, _rewrite(slow, 12, _alone(12, records)), len(head(12)))
    p0 = out.responses[0].partitions[0]
    assert p0.error_code == ErrorCode.none
    split = split_fetched_records(p0.records)
    assert [[r.value for r in decode_batch(p0.records[b.start:b.end]).records]
            for b in split.batches] == [[b"A0", b"A1"]]
