"""The public plugin API's values: immutability, ``with_*`` helpers, defaults, error codes."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import pytest

import kiproxy.interceptors as interceptors
from kiproxy.interceptors import (
    ERROR_CODES,
    AcknowledgedBatch,
    Header,
    InterceptContext,
    ProduceRequestInterceptor,
    Record,
    RecordBatch,
    RejectBatch,
    error_code,
)


def _record(**kwargs: Any) -> Record:
    base: dict[str, Any] = {"key": b"k", "value": b"v",
                            "headers": (Header("a", b"1"), Header("b", None), Header("a", b"2")),
                            "timestamp": 1_700_000_000_123, "offset_delta": 3}
    base.update(kwargs)
    return Record(**base)


def _batch(records: tuple[Record, ...] = (), **kwargs: Any) -> RecordBatch:
    base: dict[str, Any] = {"topic": "orders", "partition": 2, "records": records,
                            "producer_id": 4242, "producer_epoch": 7, "base_sequence": 100,
                            "transactional": True, "compression": "zstd"}
    base.update(kwargs)
    return RecordBatch(**base)


def _ctx(**kwargs: Any) -> InterceptContext:
    base: dict[str, Any] = {"client_id": "app-1", "client_address": "10.0.0.1:5000",
                            "principal": None, "api_version": 9, "acks": -1,
                            "transactional_id": None, "deadline": time.monotonic() + 5}
    base.update(kwargs)
    return InterceptContext(**base)


# ---------------------------------------------------------------------------- exports


def test_package_exports_the_whole_api() -> None:
    for name in ("ProduceRequestInterceptor", "RecordBatch", "Record", "Header",
                 "InterceptContext", "RejectBatch", "AcknowledgedBatch", "ERROR_CODES",
                 "error_code"):
        assert name in interceptors.__all__
        assert getattr(interceptors, name) is not None


# ---------------------------------------------------------------------------- Header


def test_header_holds_a_str_key_and_nullable_bytes_value() -> None:
    h = Header("trace", b"abc")
    assert (h.key, h.value) == ("trace", b"abc")
    assert tuple(h) == ("trace", b"abc")
    assert Header("n", None).value is None
    assert Header("e", b"").value == b""
    assert Header("x", b"1") == Header("x", b"1")
    assert Header("x", b"1") != Header("x", b"2")
    assert Header("x", None) != Header("x", b"")
    assert hash(Header("x", b"1")) == hash(Header("x", b"1"))


def test_header_is_immutable() -> None:
    h = Header("k", b"v")
    with pytest.raises(AttributeError):
        h.key = "other"  # type: ignore[misc]
    with pytest.raises(AttributeError):
        h.value = b"other"  # type: ignore[misc]


def test_header_rejects_wrong_types() -> None:
    with pytest.raises(TypeError):
        Header(1, b"v")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Header("k", "not bytes")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------- Record


def test_record_defaults() -> None:
    r = Record()
    assert (r.key, r.value, r.headers, r.timestamp, r.offset_delta) == (None, None, (), 0, 0)


def test_record_fields_and_header_order() -> None:
    r = _record()
    assert (r.key, r.value, r.timestamp, r.offset_delta) == (b"k", b"v", 1_700_000_000_123, 3)
    assert isinstance(r.headers, tuple)
    assert [(h.key, h.value) for h in r.headers] == [("a", b"1"), ("b", None), ("a", b"2")]
    assert r.header_values("a") == [b"1", b"2"]
    assert r.header_values("b") == [None]
    assert r.header_values("missing") == []


def test_record_accepts_header_tuples_and_bytes_like_values() -> None:
    r = Record(key=bytearray(b"k"), value=memoryview(b"v"), headers=[("h", b"1"), ("h", None)])
    assert r.key == b"k" and type(r.key) is bytes
    assert r.value == b"v" and type(r.value) is bytes
    assert r.headers == (Header("h", b"1"), Header("h", None))


def test_record_is_immutable() -> None:
    r = _record()
    for attr in ("key", "value", "headers", "timestamp", "offset_delta"):
        with pytest.raises(AttributeError):
            setattr(r, attr, None)


def test_record_rejects_wrong_types() -> None:
    with pytest.raises(TypeError):
        Record(value="text")  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Record(key=123)  # type: ignore[arg-type]


def test_record_equality_and_hash() -> None:
    assert _record() == _record()
    assert hash(_record()) == hash(_record())
    assert _record() != _record(value=b"other")
    assert _record() != _record(headers=(Header("a", b"2"), Header("b", None), Header("a", b"1")))
    assert _record() != _record(timestamp=1_700_000_000_124)


def test_record_with_helpers_copy_and_leave_the_original() -> None:
    r = _record()
    before = (r.key, r.value, r.headers, r.timestamp, r.offset_delta)

    v = r.with_value(b"new")
    assert v.value == b"new"
    assert (v.key, v.headers, v.timestamp, v.offset_delta) == (r.key, r.headers, r.timestamp,
                                                               r.offset_delta)
    assert r.with_value(None).value is None

    k = r.with_key(None)
    assert k.key is None and k.value == r.value
    assert r.with_key(b"k2").key == b"k2"

    t = r.with_timestamp(1)
    assert t.timestamp == 1 and t.value == r.value

    h = r.with_headers([("only", b"x")])
    assert h.headers == (Header("only", b"x"),)
    assert r.with_headers(()).headers == ()

    appended = r.with_header("a", b"3")
    assert appended.headers == (*r.headers, Header("a", b"3"))
    assert appended.header_values("a") == [b"1", b"2", b"3"]
    assert r.with_header("n", None).headers[-1] == Header("n", None)

    o = r.with_offset_delta(9)
    assert o.offset_delta == 9

    assert (r.key, r.value, r.headers, r.timestamp, r.offset_delta) == before


def test_record_timestamps_keep_the_millisecond() -> None:
    for ts in (0, 1, 1_700_000_000_999, 2**62, -1):
        assert Record(timestamp=ts).timestamp == ts


# ---------------------------------------------------------------------------- RecordBatch


def test_record_batch_defaults() -> None:
    b = RecordBatch(topic="t", partition=0, records=())
    assert (b.producer_id, b.producer_epoch, b.base_sequence) == (-1, -1, -1)
    assert b.transactional is False
    assert b.compression == "none"
    assert len(b) == 0


def test_record_batch_requires_keywords() -> None:
    with pytest.raises(TypeError):
        RecordBatch("t", 0, ())  # type: ignore[call-arg]


def test_record_batch_is_immutable() -> None:
    b = _batch((_record(),))
    for attr in ("topic", "partition", "records", "producer_id", "producer_epoch",
                 "base_sequence", "transactional", "compression"):
        with pytest.raises(dataclasses.FrozenInstanceError):
            setattr(b, attr, None)
    with pytest.raises((AttributeError, TypeError)):
        b.extra = 1  # type: ignore[attr-defined]  # slots: no new attributes


def test_with_records_keeps_producer_facts_and_takes_any_iterable() -> None:
    records = (_record(value=b"a"), _record(value=b"b"))
    b = _batch(records)
    changed = b.with_records(r.with_value(r.value.upper() if r.value else None) for r in records)
    assert changed is not b
    assert isinstance(changed.records, tuple)
    assert [r.value for r in changed.records] == [b"A", b"B"]
    assert len(changed) == 2
    for attr in ("topic", "partition", "producer_id", "producer_epoch", "base_sequence",
                 "transactional", "compression"):
        assert getattr(changed, attr) == getattr(b, attr), attr
    assert [r.value for r in b.records] == [b"a", b"b"]  # the original is untouched
    assert b.with_records([]).records == ()
    assert b.with_records(list(records)) == b


def test_with_upper_case_is_bytes_upper_and_returns_the_batch_when_nothing_changes() -> None:
    records = (_record(key=b"k1", value=b"ab\xe9c"), _record(key=b"k2", value=None),
               _record(key=None, value=b"DONE"))
    b = _batch(records)
    upper = b.with_upper_case()
    assert [r.value for r in upper.records] == [b"AB\xe9C", None, b"DONE"]
    assert [r.key for r in upper.records] == [b"k1", b"k2", None]
    assert upper.records[2] is records[2]  # nothing to change: the record itself
    assert [r.key for r in b.with_upper_case(keys=True).records] == [b"K1", b"K2", None]
    assert upper.with_upper_case() is upper
    for attr in ("topic", "partition", "producer_id", "producer_epoch", "base_sequence",
                 "transactional", "compression"):
        assert getattr(upper, attr) == getattr(b, attr), attr


def test_record_batch_equality() -> None:
    assert _batch((_record(),)) == _batch((_record(),))
    assert _batch((_record(),)) != _batch((_record(value=b"x"),))
    assert _batch(()) != _batch((), partition=3)


# ---------------------------------------------------------------------------- InterceptContext


def test_intercept_context_fields_and_defaults() -> None:
    ctx = _ctx()
    assert ctx.client_id == "app-1"
    assert ctx.client_address == "10.0.0.1:5000"
    assert ctx.principal is None
    assert (ctx.api_version, ctx.acks, ctx.transactional_id) == (9, -1, None)
    assert ctx.deadline > time.monotonic()
    assert ctx.received_at_ms == 0
    assert ctx.proxy_host == ""
    assert dict(ctx.extra) == {}
    assert _ctx().extra is not _ctx().extra  # no shared mutable default


def test_intercept_context_is_immutable() -> None:
    ctx = _ctx()
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.acks = 0  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        ctx.client_id = "other"  # type: ignore[misc]


def test_intercept_context_requires_the_request_facts() -> None:
    with pytest.raises(TypeError):
        InterceptContext(client_id="x")  # type: ignore[call-arg]


def test_acknowledged_batch_is_immutable() -> None:
    ack = AcknowledgedBatch(topic="t", partition=1, record_count=3, transformed=True)
    assert (ack.topic, ack.partition, ack.record_count, ack.transformed) == ("t", 1, 3, True)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ack.record_count = 4  # type: ignore[misc]


# ---------------------------------------------------------------------------- errors


@pytest.mark.parametrize(("name", "code"), [
    ("INVALID_RECORD", 87), ("POLICY_VIOLATION", 44), ("CORRUPT_MESSAGE", 2),
    ("UNSUPPORTED_FOR_MESSAGE_FORMAT", 43), ("UNSUPPORTED_COMPRESSION_TYPE", 76),
    ("REQUEST_TIMED_OUT", 7), ("INVALID_REQUEST", 42), ("UNKNOWN_TOPIC_ID", 100),
    ("MESSAGE_TOO_LARGE", 10), ("RECORD_LIST_TOO_LARGE", 18), ("INVALID_TIMESTAMP", 32),
    ("TOPIC_AUTHORIZATION_FAILED", 29), ("UNKNOWN_SERVER_ERROR", -1),
])
def test_error_names_map_to_kafka_codes(name: str, code: int) -> None:
    assert ERROR_CODES[name] == code
    assert error_code(name) == code
    assert error_code(name.lower()) == code
    assert RejectBatch("m", error=name).error_code == code


def test_error_code_passes_numbers_through() -> None:
    assert error_code(44) == 44
    assert RejectBatch("m", error=87).error_code == 87
    assert error_code(3) == 3  # UNKNOWN_TOPIC_OR_PARTITION: Kafka's, not in the table


def test_a_number_kafka_does_not_define_is_a_clear_value_error() -> None:
    """A response could not carry it: refused where the plugin names it, not replaced
    by another code on the way to the producer."""
    for number in (9999, 40000, -2):
        with pytest.raises(ValueError, match=f"unknown Kafka error code {number}:"):
            RejectBatch("m", error=number)


def test_unknown_error_name_is_a_clear_value_error() -> None:
    with pytest.raises(ValueError, match="NOT_A_KAFKA_ERROR") as info:
        error_code("NOT_A_KAFKA_ERROR")
    assert "POLICY_VIOLATION" in str(info.value)  # the message lists the known names
    with pytest.raises(ValueError, match="NOPE"):
        RejectBatch("m", error="NOPE")


@pytest.mark.parametrize("error", [0, "NONE"])
def test_reject_batch_refuses_the_success_code(error: str | int) -> None:
    # Code 0 would tell the producer its records were stored while the proxy drops them.
    with pytest.raises(ValueError):
        RejectBatch("silently dropped", error=error)


def test_reject_batch_defaults() -> None:
    exc = RejectBatch("values must be JSON")
    assert isinstance(exc, Exception)
    assert exc.message == "values must be JSON"
    assert str(exc) == "values must be JSON"
    # POLICY_VIOLATION: named by confluent-kafka, kafka-python and aiokafka, retried by none
    assert exc.error_code == 44
    assert exc.record_errors == ()


def test_reject_batch_record_errors_become_a_tuple() -> None:
    errors = [(0, "bad"), (3, None)]
    exc = RejectBatch("two bad records", error="POLICY_VIOLATION", record_errors=errors)
    assert exc.error_code == 44
    assert exc.record_errors == ((0, "bad"), (3, None))
    errors.append((4, "later"))
    assert exc.record_errors == ((0, "bad"), (3, None))  # a copy, not the caller's list


def test_reject_batch_can_be_raised_and_caught() -> None:
    with pytest.raises(RejectBatch) as info:
        raise RejectBatch("no", error="POLICY_VIOLATION")
    assert info.value.error_code == 44


# ---------------------------------------------------------------------------- base class


def test_interceptor_base_class_needs_intercept() -> None:
    class Incomplete(ProduceRequestInterceptor):
        pass

    with pytest.raises(TypeError, match="intercept"):
        Incomplete()  # type: ignore[abstract]


def test_interceptor_base_class_optional_hooks_are_no_ops() -> None:
    class Minimal(ProduceRequestInterceptor):
        def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
            return batch

    m = Minimal()
    m.configure({"anything": 1})
    m.on_acknowledgement(
        AcknowledgedBatch(topic="t", partition=0, record_count=1, transformed=False), 0, None)
    m.close()
    b = _batch((_record(),))
    assert m.intercept(b, _ctx()) is b


async def test_interceptor_may_be_async() -> None:
    class Async(ProduceRequestInterceptor):
        async def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
            return batch.with_records(r.with_value(b"x") for r in batch.records)

    out = await Async().intercept(_batch((_record(),)), _ctx())
    assert [r.value for r in out.records] == [b"x"]
