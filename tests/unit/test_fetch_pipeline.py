"""The fetch pipeline over hand-built Fetch answers: what it changes and what it keeps.

One partition holds, in log order, a data batch (gzip), a transactional batch, its
COMMIT marker (a control batch), an old-format (magic 1) entry, a zstd batch and the
first bytes of a batch cut at ``max_bytes``. Through ``tp_fetch:Reverse`` every data
batch's values are reversed and re-encoded at the same offsets; the marker, the
old-format entry and the cut tail are the same bytes; the partition's other fields and
the second, unhooked topic are untouched. Refusals answer their partition only: a
batch refused after others ends the answer before it, one refused first is the error
(logged with the hook's traceback); an unknown topic id is answered UNKNOWN_TOPIC_ID;
an answer with no hooked partition is the frame object itself.
"""

from __future__ import annotations

import asyncio
import dataclasses
import datetime
import logging
import struct
import sys
import uuid
import zlib
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from kio.schema.errors import ErrorCode
from kio.static.primitive import i32Timedelta

from kiproxy.interceptors import ClientIdentity
from kiproxy.protocol.fetch_batches import split_fetched_records
from kiproxy.protocol.messages import ApiKey, parse_response, response_type, serialize
from kiproxy.protocol.records import Compression, Record, build_batch, decode_batch
from kiproxy.proxy.config.model import load_config
from kiproxy.proxy.fetch.pipeline import FetchPipeline
from kiproxy.proxy.observe.metrics import Metrics
from kiproxy.proxy.routes.runtime import load_routes
from kiproxy.proxy.routes.table import ClientRoutes, RouteTable

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "protocol"))
from fetch_responses import fetch_responses, field_names, head

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
TOPIC_ID = uuid.UUID("12345678-1234-5678-1234-567812345678")
PLAIN_ID = uuid.UUID("87654321-1234-5678-1234-567812345678")


def _batch(offset: int, values: list[bytes], codec: Compression = Compression.NONE, *,
           control: bool = False, transactional: bool = False) -> bytes:
    records = [Record(key=b"k%d" % i, value=v, timestamp=1000 + i,
                      headers=[("h", b"1"), ("h", b"2")]) for i, v in enumerate(values)]
    return build_batch(records, base_offset=offset, compression=codec, control=control,
                       transactional=transactional, producer_id=9 if transactional else -1,
                       producer_epoch=0 if transactional else -1,
                       base_sequence=offset if transactional else -1)


def _legacy(offset: int, value: bytes) -> bytes:
    body = bytes([1, 0]) + struct.pack(">q", 1000) + struct.pack(">i", -1)
    body += struct.pack(">i", len(value)) + value
    message = struct.pack(">I", zlib.crc32(body)) + body
    return struct.pack(">qi", offset, len(message)) + message


MARKER = _batch(5, [b"\x00\x00\x00\x00"], control=True, transactional=True)
LEGACY = _legacy(6, b"old format")
PIECES = [_batch(0, [b"abc", b"def"], Compression.GZIP),
          _batch(2, [b"tx1", b"tx2", b"tx3"], transactional=True),
          MARKER, LEGACY, _batch(7, [b"zstd!"], Compression.ZSTD)]
TAIL = _batch(8, [b"cut short"])[:30]
RECORDS = b"".join(PIECES) + TAIL


def _answer(version: int, hooked: str, records: bytes = RECORDS) -> bytes:
    types = __import__(response_type(ApiKey.FETCH, version).__module__, fromlist=["x"])

    def part(index: int, data: bytes) -> Any:
        kw: dict[str, Any] = {"log_start_offset": 0, "preferred_read_replica": -1}
        return types.PartitionData(
            partition_index=index, error_code=ErrorCode.none, high_watermark=9,
            last_stable_offset=9, records=data,
            aborted_transactions=(types.AbortedTransaction(producer_id=9, first_offset=2),),
            **{k: v for k, v in kw.items() if k in field_names(types.PartitionData)})

    def topic(name: str, parts: tuple[Any, ...]) -> Any:
        kw: dict[str, Any] = ({"topic_id": TOPIC_ID if name == hooked else PLAIN_ID}
                              if version >= 13 else {"topic": name})
        return types.FetchableTopicResponse(partitions=parts, **kw)

    top: dict[str, Any] = {"error_code": ErrorCode.none, "session_id": 77}
    message = types.FetchResponse(
        throttle_time=i32Timedelta.parse(datetime.timedelta(0)),
        **{k: v for k, v in top.items() if k in field_names(types.FetchResponse)},
        responses=(topic(hooked, (part(0, records), part(1, PIECES[0]))),
                                  topic("plain", (part(0, PIECES[0]),))))
    return head(version) + serialize(message)


class _Client:
    def __init__(self) -> None:
        self.identity = ClientIdentity(client_host="127.0.0.1", client_port=5)
        self.log_context: dict[str, object] = {}
        self._routes: ClientRoutes | None = None

    def routes(self, table: RouteTable) -> ClientRoutes:
        return table.for_client(self.identity)


def _pipeline(tmp_path: Path, plugin: str, names: dict[uuid.UUID, str] | None = None
              ) -> FetchPipeline:
    path = tmp_path / "kiproxy.yaml"
    path.write_text(f'plugins_dir: {PLUGINS}\nroutes:\n  - match: {{topic: "rev-.*|bad-.*"}}\n'
                    f'    interceptors: [{{class: "{plugin}", timeout_ms: 300}}]\n')
    return FetchPipeline(load_routes(load_config(path, {})),
                         topic_names={} if names is None else names)


def _rewrite(pipeline: FetchPipeline, version: int, frame: bytes) -> bytes:
    """The answer as the consumer gets it (pieces, when the pipeline gives them, joined
    here as the socket's writev does)."""
    out = pipeline.rewrite(_Client(), version, frame)  # type: ignore[arg-type]
    if isinstance(out, bytes):
        return out

    async def wait() -> bytes:
        answer = await out  # type: ignore[misc]
        return answer if isinstance(answer, bytes) else b"".join(answer)
    return asyncio.run(wait())


@pytest.mark.parametrize("version", [4, 11, 12, 13, 17, 18])
def test_data_batches_change_and_everything_else_is_the_brokers(tmp_path: Path,
                                                                version: int) -> None:
    pipeline = _pipeline(tmp_path, "tp_fetch:Reverse", {TOPIC_ID: "rev-t", PLAIN_ID: "plain"})
    frame = _answer(version, "rev-t")
    out = _rewrite(pipeline, version, frame)
    body = len(head(version))
    before, after = parse_response(1, version, frame, body), parse_response(1, version, out,
                                                                            body)
    (p0, p1), (plain,) = (t.partitions for t in after.responses)
    # Every field but the hooked partitions' records is the broker's.
    assert getattr(after, "session_id", 77) == 77
    assert plain == before.responses[1].partitions[0]
    for old, new in ((before.responses[0].partitions[0], p0),
                     (before.responses[0].partitions[1], p1)):
        assert (new.error_code, new.high_watermark, new.last_stable_offset,
                new.aborted_transactions) == (old.error_code, old.high_watermark,
                                              old.last_stable_offset, old.aborted_transactions)
    split = split_fetched_records(p0.records)
    kept = [bytes(p0.records[b.start:b.end]) for b in split.batches]
    assert kept[2] == MARKER and kept[3] == LEGACY
    assert bytes(p0.records[split.tail:]) == TAIL
    for original, now in ((PIECES[0], kept[0]), (PIECES[1], kept[1]), (PIECES[4], kept[4])):
        a, b = decode_batch(original), decode_batch(now)
        assert (b.header.base_offset, b.header.last_offset_delta, b.header.attributes,
                b.header.producer_id, b.header.base_sequence) == (
            a.header.base_offset, a.header.last_offset_delta, a.header.attributes,
            a.header.producer_id, a.header.base_sequence)
        assert [(r.value, r.key, r.headers, r.timestamp, r.offset_delta) for r in b.records] \
            == [((r.value or b"")[::-1], r.key, r.headers, r.timestamp, r.offset_delta)
                for r in a.records]


def test_no_hooked_partition_is_the_frame_itself(tmp_path: Path) -> None:
    pipeline = _pipeline(tmp_path, "tp_fetch:Reverse")
    frame = _answer(12, "other")
    assert pipeline.rewrite(_Client(), 12, frame) is frame  # type: ignore[arg-type]


@pytest.mark.parametrize("topic", ["bad-refuse", "bad-raise", "bad-grow", "bad-slow",
                                   "bad-tuples", "bad-surrogate"])
def test_a_refusal_answers_its_partition_only(tmp_path: Path, topic: str) -> None:
    pipeline = _pipeline(tmp_path, "tp_fetch:RefuseOnConsume")
    frame = _answer(12, topic)
    out = parse_response(1, 12, _rewrite(pipeline, 12, frame), len(head(12)))
    (p0, p1), (plain,) = (t.partitions for t in out.responses)
    assert (p0.error_code, p0.records) == (ErrorCode.unknown_server_error, b"")
    assert (p1.error_code, p1.records) == (ErrorCode.unknown_server_error, b"")
    assert (plain.error_code, plain.records) == (ErrorCode.none, PIECES[0])


@pytest.mark.parametrize(("topic", "said"), [
    ("bad-tuples", "TypeError: record 0 is a tuple, not a Record"),
    ("bad-surrogate", "UnicodeEncodeError"),
])
def test_records_a_hook_returns_that_cannot_be_written_refuse_its_partition(
        tmp_path: Path, topic: str, said: str, caplog: pytest.LogCaptureFixture) -> None:
    # Refused as the produce side refuses them (a bad_return), never an exception that
    # would close the consumer's connection.
    pipeline = _pipeline(tmp_path, "tp_fetch:RefuseOnConsume")
    with caplog.at_level(logging.WARNING):
        out = parse_response(1, 12, _rewrite(pipeline, 12, _answer(12, topic)), len(head(12)))
    (p0, _), (plain,) = (t.partitions for t in out.responses)
    assert (p0.error_code, p0.records) == (ErrorCode.unknown_server_error, b"")
    assert plain.records == PIECES[0]
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "returned records that cannot be encoded" in logged and said in logged, logged


def test_max_plugin_output_bytes_bounds_what_a_fetch_side_hook_returns(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "kiproxy.yaml"
    path.write_text(f"plugins_dir: {PLUGINS}\nmax_plugin_output_bytes: 2000\nroutes:\n"
                    '  - match: {topic: "bad-.*"}\n'
                    '    interceptors: [{class: "tp_fetch:RefuseOnConsume"}]\n')
    pipeline = FetchPipeline(load_routes(load_config(path, {})), topic_names={})
    with caplog.at_level(logging.WARNING):
        out = parse_response(1, 12, _rewrite(pipeline, 12, _answer(12, "bad-inflate")),
                             len(head(12)))
    (p0, _), (plain,) = (t.partitions for t in out.responses)
    assert (p0.error_code, p0.records) == (ErrorCode.unknown_server_error, b"")
    assert plain.records == PIECES[0]
    logged = " ".join(r.getMessage() for r in caplog.records)
    assert "the limit is max_plugin_output_bytes (2000)" in logged, logged


def test_an_unknown_topic_id_is_answered_unknown_topic_id(tmp_path: Path) -> None:
    pipeline = _pipeline(tmp_path, "tp_fetch:Reverse", {})
    out = parse_response(1, 13, _rewrite(pipeline, 13, _answer(13, "rev-t")), len(head(13)))
    codes = [p.error_code for t in out.responses for p in t.partitions]
    assert codes == [ErrorCode.unknown_topic_id] * 3


def test_an_undecodable_batch_refuses_its_partition(tmp_path: Path) -> None:
    pipeline = _pipeline(tmp_path, "tp_fetch:Reverse", {TOPIC_ID: "rev-t", PLAIN_ID: "plain"})
    broken = bytearray(PIECES[0])
    broken[-1] ^= 0xFF  # the CRC no longer holds
    out = parse_response(1, 13, _rewrite(pipeline, 13, _answer(13, "rev-t", bytes(broken))),
                         len(head(13)))
    (p0, p1), _ = (t.partitions for t in out.responses)
    assert p0.error_code == ErrorCode.unknown_server_error and p0.records == b""
    assert p1.error_code == ErrorCode.none


def _with_stored_key(batch: bytes, placeholder: bytes, key: bytes) -> bytes:
    """``batch`` with the header key ``placeholder`` written as ``key`` (same length),
    its CRC-32C recomputed: a batch as a client that writes raw header keys stores it."""
    import crc32c

    assert len(placeholder) == len(key) and batch.count(placeholder) == 1
    data = bytearray(batch.replace(placeholder, key))
    data[17:21] = struct.pack(">I", crc32c.crc32c(bytes(data[21:])))
    return bytes(data)


def test_a_header_key_that_is_not_utf8_is_handed_to_the_hook_and_kept(tmp_path: Path
                                                                       ) -> None:
    """Brokers store header keys whatever their bytes. A batch holding one is handed to
    the partition's hooks (the key as lone surrogates) and its bytes are written back
    as they were: such a batch once refused its partition at every fetch, so that the
    consumer could not read past it."""
    records = [Record(key=b"k", value=b"abc", timestamp=1000,
                      headers=[("ZZ", b"1"), ("h", b"2")])]
    stored = _with_stored_key(build_batch(records, base_offset=0), b"ZZ", b"\xff\xfe")
    pipeline = _pipeline(tmp_path, "tp_fetch:Reverse", {TOPIC_ID: "rev-t", PLAIN_ID: "plain"})
    out = parse_response(1, 13, _rewrite(pipeline, 13, _answer(13, "rev-t", stored)),
                         len(head(13)))
    (p0, _), _ = (t.partitions for t in out.responses)
    assert p0.error_code == ErrorCode.none
    (record,) = decode_batch(bytes(p0.records)).records
    assert record.value == b"cba"
    assert [(h.key.encode("utf-8", "surrogateescape"), h.value) for h in record.headers] \
        == [(b"\xff\xfe", b"1"), (b"h", b"2")]
    assert b"\xff\xfe" in bytes(p0.records)


class _Every:
    """Names every topic id ``rev-<id>`` so that every topic of a drawn answer is hooked."""

    def get(self, topic_id: uuid.UUID, default: Any = None) -> str:
        return f"rev-{topic_id}"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(case=fetch_responses())
def test_any_answer_keeps_every_field_but_the_records_of_partitions_it_refuses_or_changes(
        tmp_path_factory: pytest.TempPathFactory, case: tuple[int, Any]) -> None:
    """Random answers (random bytes, real batches, cut tails, control batches, every
    codec): every non-record field is the broker's, a partition is either answered with
    an error and no records or keeps its error code, and every batch that reads back
    holds the reversed values at the same offsets."""
    version, response = case
    if version < 13:  # every name hooked
        response = dataclasses.replace(response, responses=tuple(
            dataclasses.replace(t, topic=f"rev-{t.topic}") for t in response.responses))
    pipeline = _pipeline(tmp_path_factory.mktemp("p"), "tp_fetch:Reverse")
    pipeline.topic_names = _Every()  # type: ignore[assignment]
    frame = head(version) + serialize(response)
    out = parse_response(1, version, _rewrite(pipeline, version, frame), len(head(version)))
    assert dataclasses.replace(out, responses=()) == dataclasses.replace(response, responses=())
    for old_topic, new_topic in zip(response.responses, out.responses, strict=True):
        for old, new in zip(old_topic.partitions, new_topic.partitions, strict=True):
            refused = new.error_code != old.error_code
            assert dataclasses.replace(new, records=None, error_code=ErrorCode.none) == \
                dataclasses.replace(old, records=None, error_code=ErrorCode.none)
            if refused:
                assert new.error_code == ErrorCode.unknown_server_error
                assert new.records == b""
            elif old.records and new.records != old.records:
                before = split_fetched_records(old.records)
                after = split_fetched_records(new.records)
                assert [(b.magic, b.is_control) for b in after.batches] == \
                    [(b.magic, b.is_control) for b in before.batches]
                assert new.records[after.tail:] == old.records[before.tail:]


def _share_fetch(version: int, *topic_ids: uuid.UUID) -> bytes:
    from kiproxy.protocol.framing import encode_request_header
    from kiproxy.protocol.messages import request_type

    cls = request_type(ApiKey.SHARE_FETCH, version)
    types = __import__(cls.__module__, fromlist=["x"])
    kw: dict[str, Any] = {"max_records": 500, "batch_size": 500}
    request = cls(
        group_id="g", member_id="m", share_session_epoch=0,
        max_wait=i32Timedelta.parse(datetime.timedelta(milliseconds=500)), min_bytes=1,
        max_bytes=1 << 20, forgotten_topics_data=(),
        topics=tuple(types.FetchTopic(topic_id=t, partitions=(types.FetchPartition(
            partition_index=0, acknowledgement_batches=()),)) for t in topic_ids),
        **{k: v for k, v in kw.items() if k in field_names(cls)})
    return encode_request_header(ApiKey.SHARE_FETCH, version, 9, "share", 2) + serialize(
        request)


@pytest.mark.parametrize("version", [1, 2])
def test_a_share_fetch_on_a_hooked_topic_is_refused_and_the_others_pass(
        tmp_path: Path, version: int) -> None:
    from kiproxy.protocol.framing import parse_request_header
    from kiproxy.proxy.fetch.share import share_fetch_refusal

    pipeline = _pipeline(tmp_path, "tp_fetch:Reverse", {TOPIC_ID: "rev-t", PLAIN_ID: "plain"})
    plain = _share_fetch(version, PLAIN_ID)
    assert share_fetch_refusal(pipeline, _Client(), parse_request_header(plain),  # type: ignore[arg-type]
                               plain) is None
    for ids, named in (((PLAIN_ID, TOPIC_ID), "'rev-t'"), ((uuid.uuid4(),), "topic id")):
        frame = _share_fetch(version, *ids)
        answer = share_fetch_refusal(pipeline, _Client(), parse_request_header(frame),  # type: ignore[arg-type]
                                     frame)
        assert answer is not None
        parsed = parse_response(ApiKey.SHARE_FETCH, version, answer, 5)
        assert parsed.error_code == ErrorCode.invalid_request and parsed.responses == ()
        assert named in parsed.error_message and "consumer group" in parsed.error_message


POISON = _batch(7, [b"fine", b"poison"])  # tp_fetch:PlainOnConsume raises on it
LATER = _batch(9, [b"later"])


def _poisoned(tmp_path: Path) -> FetchPipeline:
    """Reverse then PlainOnConsume on ``rev-`` topics: on consume, PlainOnConsume first."""
    path = tmp_path / "kiproxy.yaml"
    path.write_text(f'plugins_dir: {PLUGINS}\nroutes:\n  - match: {{topic: "rev-.*"}}\n'
                    '    interceptors: [{class: "tp_fetch:Reverse"}, '
                    '{class: "tp_fetch:PlainOnConsume"}]\n')
    return FetchPipeline(load_routes(load_config(path, {})),
                         topic_names={TOPIC_ID: "rev-t", PLAIN_ID: "plain"},
                         metrics=Metrics())


def _refused(pipeline: FetchPipeline) -> float:
    assert pipeline.metrics is not None
    return pipeline.metrics.fetch_batches.labels("rev-t", "refused")._value.get()  # type: ignore[no-any-return]


def _fetch_warnings(caplog: pytest.LogCaptureFixture) -> list[logging.LogRecord]:
    """What the fetch pipeline logged at WARNING or above (loading the routes logs at INFO,
    which the capture keeps when an earlier test set ``kiproxy``'s level so)."""
    return [r for r in caplog.records
            if r.name == "kiproxy.fetch" and r.levelno >= logging.WARNING]


def test_a_refused_batch_ends_its_partitions_answer_and_the_next_fetch_is_refused_there(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """The batches before the one a hook fails on are sent, changed as the hooks changed
    them, and nothing from it on; every other field is the broker's. The consumer then
    fetches from that batch: the answer starts with it, and is the error."""
    pipeline = _poisoned(tmp_path)
    before = b"".join(PIECES[:4])  # gzip 0-1, transactional 2-4, its marker, magic 1 at 6
    frame = _answer(12, "rev-t", before + POISON + LATER + TAIL)
    with caplog.at_level("WARNING", "kiproxy.fetch"):
        out = parse_response(1, 12, _rewrite(pipeline, 12, frame), len(head(12)))
    assert _fetch_warnings(caplog) == [] and _refused(pipeline) == 0  # nothing refused yet
    old = parse_response(1, 12, frame, len(head(12))).responses[0].partitions[0]
    p0 = out.responses[0].partitions[0]
    assert dataclasses.replace(p0, records=None) == dataclasses.replace(old, records=None)
    split = split_fetched_records(p0.records)
    assert not split.partial and [b.header.base_offset if b.header else 6
                                  for b in split.batches] == [0, 2, 5, 6]
    kept = [bytes(p0.records[b.start:b.end]) for b in split.batches]
    assert kept[2:] == [MARKER, LEGACY]
    for original, now in zip(PIECES[:2], kept[:2], strict=True):  # reversed, as ever
        assert [r.value for r in decode_batch(now).records] == [
            (r.value or b"")[::-1] for r in decode_batch(original).records]

    # the next fetch starts at the batch: the partition is answered with the error
    with caplog.at_level("WARNING", "kiproxy.fetch"):
        out = parse_response(1, 12, _rewrite(pipeline, 12, _answer(12, "rev-t",
                                                                   POISON + LATER)),
                             len(head(12)))
    p0 = out.responses[0].partitions[0]
    assert (p0.error_code, p0.records) == (ErrorCode.unknown_server_error, b"")
    (line,) = _fetch_warnings(caplog)
    assert "rev-t[0] answered with an error: batch at offset 7: " in line.getMessage()
    assert "raised KeyError: 'boom'" in line.getMessage()
    assert line.exc_info is not None and line.exc_info[0] is KeyError  # its traceback
    assert _refused(pipeline) == 1


def test_a_batch_refused_after_control_batches_only_ends_the_answer_after_them(
        tmp_path: Path) -> None:
    """A transaction marker before the refused batch is sent alone: consumers step over
    it to the refused batch."""
    pipeline = _poisoned(tmp_path)
    out = parse_response(1, 12, _rewrite(pipeline, 12, _answer(12, "rev-t", MARKER + POISON)),
                         len(head(12)))
    p0 = out.responses[0].partitions[0]
    assert (p0.error_code, p0.records) == (ErrorCode.none, MARKER)
