"""A request's partitions overlap: one re-compresses on a decode thread while the next
is decoded and intercepted.

The interceptor still sees every batch in request order, one at a time; what is
forwarded is byte-identical to encoding each changed batch in turn; a batch whose
records cannot be encoded rejects only its partition; the memory budget is given
back whether the request finishes or is cancelled halfway.
"""

from __future__ import annotations

import asyncio
import datetime
import threading
from collections.abc import Iterator
from typing import Any

import pytest
from kio.schema.errors import ErrorCode
from kio.schema.produce.v9.request import PartitionProduceData, ProduceRequest, TopicProduceData
from kio.schema.produce.v9.response import (
    PartitionProduceResponse,
    ProduceResponse,
    TopicProduceResponse,
)
from kio.schema.types import TopicName
from kio.static.primitive import Records, i16, i32, i32Timedelta, i64
from support.client import Client

import kiproxy.proxy.produce.offload as offload_module
from kiproxy.interceptors import InterceptContext, ProduceRequestInterceptor, RecordBatch
from kiproxy.protocol.compression import DEFAULT_LEVELS, Compression
from kiproxy.protocol.framing import (
    encode_request_header,
    encode_response_header,
    parse_request_header,
)
from kiproxy.protocol.messages import ApiKey, parse_request, parse_response, serialize
from kiproxy.protocol.records import (
    DEFAULT_DECOMPRESSION_LIMITS,
    Record,
    build_batch,
    decode_batches,
    encode_batch,
)
from kiproxy.proxy.produce.disposition import Forward
from kiproxy.proxy.produce.offload import BatchOffload
from kiproxy.proxy.produce.pipeline import ProducePipeline

PARTITIONS = 3


def _records(partition: int) -> list[Record]:
    return [Record(key=b"k%d-%d" % (partition, i), value=b"value %d of %d " % (i, partition) * 40,
                   timestamp=1_700_000_000_000 + i) for i in range(200)]


def _frame(codec: Compression) -> tuple[bytes, list[bytes]]:
    """A Produce v9 request of PARTITIONS partitions, and each partition's records."""
    batches = [build_batch(_records(p), compression=codec, producer_id=7, producer_epoch=0,
                           base_sequence=200 * p) for p in range(PARTITIONS)]
    topic = TopicProduceData(name=TopicName("t"), partition_data=tuple(
        PartitionProduceData(index=i32(p), records=Records(b)) for p, b in enumerate(batches)))
    request = ProduceRequest(transactional_id=None, acks=i16(-1),
                             timeout=i32Timedelta.parse(datetime.timedelta(seconds=30)),
                             topic_data=(topic,))
    return encode_request_header(0, 9, 7, "unit", 2) + serialize(request), batches


def _forwarded(frame: bytes) -> dict[int, bytes]:
    header = parse_request_header(frame)
    assert header.body_offset is not None
    request = parse_request(ApiKey.PRODUCE, 9, frame, header.body_offset)
    return {p.index: bytes(p.records) for t in request.topic_data for p in t.partition_data}


def _broker_answer(partitions: list[int]) -> bytes:
    """A Produce v9 answer (header v1, correlation id 7) accepting ``partitions`` of t."""
    response = ProduceResponse(responses=(TopicProduceResponse(
        name=TopicName("t"), partition_responses=tuple(PartitionProduceResponse(
            index=i32(p), error_code=ErrorCode.none, base_offset=i64(0),
            log_append_time=None, log_start_offset=i64(0), record_errors=(),
            error_message=None) for p in partitions)),),
        throttle_time=i32Timedelta.parse(datetime.timedelta(0)))
    return encode_response_header(7, 1) + serialize(response)


class _Upper(ProduceRequestInterceptor):
    """Upper-cases values; writes down the order it saw partitions in."""

    def __init__(self, on_last: threading.Event | None = None,
                 unencodable: int | None = None) -> None:
        self.seen: list[int] = []
        self.on_last = on_last
        self.unencodable = unencodable

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        self.seen.append(batch.partition)
        if self.on_last is not None and batch.partition == PARTITIONS - 1:
            self.on_last.set()
        if batch.partition == self.unencodable:
            return batch.with_records(r.with_header("\ud800", b"x") for r in batch.records)
        return batch.with_upper_case()


@pytest.fixture
def gated_encodes(monkeypatch: pytest.MonkeyPatch) -> Iterator[threading.Event]:
    """Encodes on a decode thread wait until the event is set (refusing after 10 s)."""
    gate = threading.Event()
    real = offload_module.encode_batch

    def gated(*args: Any, **kwargs: Any) -> bytes:
        on_thread = threading.current_thread() is not threading.main_thread()
        if on_thread and not gate.wait(10):
            raise RuntimeError("re-encoding waited 10 s for the next partition")
        return real(*args, **kwargs)

    monkeypatch.setattr(offload_module, "encode_batch", gated)
    yield gate
    gate.set()


def _pipeline(plugin: ProduceRequestInterceptor) -> ProducePipeline:
    # inline_bytes=1024 and no CPU to spend on re-encoding on the loop: every one of
    # these compressed partitions is decoded and encoded on a thread; enough threads
    # that held re-encodings leave one for the next decode.
    offload = BatchOffload(DEFAULT_DECOMPRESSION_LIMITS, inline_bytes=1024,
                           inline_encode_seconds=0.0, threads=PARTITIONS + 1)
    return ProducePipeline(plugin, name="upper", offload=offload)


def _handled(plugin: ProduceRequestInterceptor, frame: bytes) -> tuple[ProducePipeline, Forward]:
    """The pipeline (its decode threads stopped) and what it forwards for ``frame``."""
    pipeline = _pipeline(plugin)
    try:
        outcome = asyncio.run(pipeline.handle(Client(), parse_request_header(frame), frame,
                                              None))  # type: ignore[arg-type]
    finally:
        pipeline.offload.close()
    assert isinstance(outcome, Forward)
    return pipeline, outcome


@pytest.mark.parametrize("codec", [Compression.LZ4, Compression.ZSTD, Compression.GZIP])
def test_next_partition_is_intercepted_while_the_previous_one_compresses(
        codec: Compression, gated_encodes: threading.Event) -> None:
    frame, batches = _frame(codec)
    plugin = _Upper(on_last=gated_encodes)  # re-encoding may go on once the last is seen
    pipeline, outcome = _handled(plugin, frame)
    assert plugin.seen == list(range(PARTITIONS))
    forwarded = _forwarded(outcome.frame)
    for p, original in enumerate(batches):
        [decoded] = decode_batches(original)
        upper = tuple(r.with_value(r.value.upper()) for r in decoded.records)
        # byte-identical to encoding the changed batch on its own
        assert forwarded[p] == encode_batch(decoded.header, upper, renumber=True,
                                            levels=DEFAULT_LEVELS)
    assert pipeline.offload.budget.used == 0


def test_records_that_cannot_be_encoded_on_a_thread_reject_only_their_partition(
        caplog: pytest.LogCaptureFixture) -> None:
    frame, _ = _frame(Compression.LZ4)
    pipeline, outcome = _handled(_Upper(unencodable=1), frame)
    assert sorted(_forwarded(outcome.frame)) == [0, 2]
    assert outcome.on_response is not None
    # The broker answers for the two partitions it got; the client hears of all three.
    answer = parse_response(ApiKey.PRODUCE, 9, outcome.on_response(_broker_answer([0, 2])), 5)
    errors = {p.index: (p.error_code, p.error_message)
              for t in answer.responses for p in t.partition_responses}
    assert errors[0] == errors[2] == (0, None)
    code, message = errors[1]
    assert code == 87  # INVALID_RECORD
    assert "returned records that cannot be encoded: UnicodeEncodeError" in message
    assert "cannot be encoded" in caplog.text
    assert pipeline.offload.budget.used == 0


def test_a_request_cancelled_while_its_partitions_compress_gives_the_budget_back(
        gated_encodes: threading.Event) -> None:
    frame, _ = _frame(Compression.ZSTD)
    seen_all = threading.Event()
    pipeline = _pipeline(_Upper(on_last=seen_all))

    async def cancel_halfway() -> tuple[int, int]:
        task = asyncio.ensure_future(pipeline.handle(
            Client(), parse_request_header(frame), frame, None))  # type: ignore[arg-type]
        while not seen_all.is_set():
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)  # the pipeline now awaits the first re-encoding
        held = pipeline.offload.budget.used
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gated_encodes.set()
        for _ in range(100):
            if pipeline.offload.budget.used == 0:
                break
            await asyncio.sleep(0.01)
        leftover = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        return held, len(leftover)

    try:
        held, leftover = asyncio.run(cancel_halfway())
    finally:
        pipeline.offload.close()
    assert held > 0  # every partition's lease was held while they compressed
    assert leftover == 0
    assert pipeline.offload.budget.used == 0
