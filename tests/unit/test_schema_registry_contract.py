"""The schema_registry checks over an in-memory registry: framing, ids, subjects, payloads, rules.

The registry here is a small fake of the client's interface, so each check's
record error and the lookup/caching behaviour can be pinned down exactly; the
integration tests (tests/integration/test_schema_registry.py) run the same
checks against a real Apicurio Registry with confluent-kafka's serializers.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import struct
from dataclasses import dataclass, field
from typing import Any

import fastavro
import pytest

from kiproxy.interceptors import Header, Record, RecordBatch
from kiproxy.interceptors.builtin.schema_registry.contract import ContractCheck
from kiproxy.interceptors.builtin.schema_registry.settings import parse_settings
from kiproxy.interceptors.builtin.schema_registry.wire import (
    FramingError,
    confluent_frame,
    header_id,
    message_indexes,
)
from kiproxy.interceptors.errors import ErrorCode


class Unknown(Exception):
    pass


class Down(Exception):
    pass


@dataclass(frozen=True)
class Ref:
    name: str
    subject: str
    version: int
    schema: Schema


@dataclass(frozen=True)
class Schema:
    schema_id: int
    schema_type: str
    schema: str
    references: tuple[Ref, ...] = ()


@dataclass
class FakeRegistry:
    """The client interface, in memory: ids, their subjects, latest versions; can go down."""

    schemas: dict[int, Schema] = field(default_factory=dict)
    subjects: dict[int, list[str]] = field(default_factory=dict)
    latest: dict[str, int] = field(default_factory=dict)
    down: bool = False
    stale_latest: dict[str, int] = field(default_factory=dict)
    """What a cache in the client still answers for a subject unless asked ``fresh``."""
    calls: list[tuple[str, object]] = field(default_factory=list)
    gate: asyncio.Event | None = None

    async def schema_by_id(self, schema_id: int, *, fresh: bool = False) -> Schema:
        self.calls.append(("schema", schema_id))
        if self.gate is not None:
            await self.gate.wait()
        if self.down:
            raise Down("http://127.0.0.1:1: connection refused")
        if schema_id not in self.schemas:
            raise Unknown(schema_id)
        return self.schemas[schema_id]

    async def subjects_of(self, schema_id: int, *,
                          fresh: bool = False) -> tuple[tuple[str, int], ...]:
        self.calls.append(("subjects", schema_id))
        if self.down:
            raise Down("connection refused")
        return tuple((s, 1) for s in self.subjects.get(schema_id, ()))

    async def latest_id(self, subject: str, *, fresh: bool = False) -> int:
        self.calls.append(("latest", subject))
        if self.down:
            raise Down("connection refused")
        return self.latest[subject] if fresh else self.stale_latest.get(subject,
                                                                        self.latest[subject])


ORDER = {"type": "record", "name": "Order", "namespace": "shop", "fields": [
    {"name": "id", "type": "string"}, {"name": "amount", "type": "double"},
    {"name": "currency", "type": "string"}]}
PAYMENT = {"type": "record", "name": "Payment", "namespace": "shop", "fields": [
    {"name": "id", "type": "string"}, {"name": "amount", "type": "string"}]}


def avro(schema: dict[str, Any], datum: dict[str, Any]) -> bytes:
    buf = io.BytesIO()
    fastavro.schemaless_writer(buf, fastavro.parse_schema(schema), datum)
    return buf.getvalue()


def framed(schema_id: int, payload: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", schema_id) + payload


def registry() -> FakeRegistry:
    return FakeRegistry(
        schemas={17: Schema(17, "AVRO", json.dumps(ORDER)),
                 18: Schema(18, "AVRO", json.dumps(PAYMENT)),
                 30: Schema(30, "JSON", json.dumps({"title": "Event", "type": "object",
                                                    "required": ["kind"]}))},
        subjects={17: ["orders-value"], 18: ["payments-value"], 30: ["events-value"]},
        latest={"orders-value": 17},
    )


def checker(config: dict[str, Any], fake: FakeRegistry | None = None,
            **lifetimes: float) -> ContractCheck:
    config = {"registry": {"url": "http://127.0.0.1:1"}, **config}
    return ContractCheck(parse_settings(config), fake or registry(), unknown_id=Unknown,
                         unavailable=Down, **lifetimes)


def batch(topic: str, *values: bytes | None, key: bytes | None = None,
          headers: tuple[Header, ...] = ()) -> RecordBatch:
    return RecordBatch(topic=topic, partition=0, records=tuple(
        Record(key=key, value=v, headers=headers, offset_delta=i) for i, v in enumerate(values)))


GOOD = framed(17, avro(ORDER, {"id": "o1", "amount": 9.5, "currency": "EUR"}))
ORDERS = {"topics": {"orders": {"value": "payload"}}}


def test_framing_reads_the_id_and_the_protobuf_indexes() -> None:
    assert confluent_frame(b"\x00\x00\x00\x00\x11rest")[0] == 17
    with pytest.raises(FramingError, match=r"magic byte 0.*first byte 0x7b"):
        confluent_frame(b'{"a": 1}')
    with pytest.raises(FramingError, match=r"schema id 0 .*8-byte id.*as-confluent=true"):
        confluent_frame(b"\x00" + struct.pack(">q", 5) + b"payload")  # Apicurio, no headers
    assert message_indexes(memoryview(b"\x00pay"))[0] == (0,)
    indexes, rest = message_indexes(memoryview(b"\x04\x02\x00pay"))  # zigzag 2 -> [1, 0]
    assert indexes == (1, 0) and bytes(rest) == b"pay"
    with pytest.raises(FramingError):
        message_indexes(memoryview(b"\x04\x02"))
    long_id = (Header("apicurio.value.globalId", struct.pack(">q", 42)),)
    assert header_id(long_id, "apicurio.value.globalId", "long") == 42
    assert header_id((Header("sid", b"42"),), "sid", "string") == 42
    with pytest.raises(FramingError, match="no schema id header"):
        header_id((), "sid", "long")


async def test_good_records_pass_and_a_second_batch_asks_the_registry_nothing() -> None:
    fake = registry()
    check = checker(ORDERS, fake)
    assert await check.check(batch("orders", GOOD, GOOD)) is None
    asked = list(fake.calls)
    assert ("schema", 17) in asked and ("subjects", 17) in asked
    assert await check.check(batch("orders", GOOD)) is None
    assert fake.calls == asked
    assert await check.check(batch("other-topic", b"anything")) is None


async def test_each_bad_record_is_named_with_its_cause() -> None:
    check = checker(ORDERS)
    wrong_subject = framed(18, avro(PAYMENT, {"id": "p", "amount": "1"}))
    mismatch = framed(17, avro(PAYMENT, {"id": "p", "amount": "12.5"}))
    refusal = await check.check(batch("orders", GOOD, b"plain", framed(99, b""), wrong_subject,
                                      mismatch, None))
    assert refusal is not None and refusal.code == ErrorCode.INVALID_RECORD
    errors = dict(refusal.record_errors)
    assert sorted(errors) == [1, 2, 3, 4]
    assert "record 1: not framed with a schema id" in errors[1]
    assert errors[2] == "record 2: schema id 99 is not registered"
    assert errors[3] == ("record 3: schema id 18 is registered under payments-value, "
                         "not orders-value")
    assert errors[4].startswith("record 4: field amount: expected double")
    assert refusal.message.startswith("4 of 6 record(s) of orders[0] broke the data contract")
    assert check.rejections["subject"] == 1 and check.rejections["payload"] == 1


async def test_levels_id_and_subject_do_not_decode() -> None:
    mismatch = framed(17, b"\xff\xff\xff")
    assert await checker({"topics": {"orders": {"value": "id"}}}).check(
        batch("orders", mismatch)) is None
    assert await checker({"topics": {"orders": {"value": "subject"}}}).check(
        batch("orders", mismatch)) is None
    refusal = await checker({"topics": {"orders": {"value": "id"}}}).check(
        batch("orders", framed(5, b"")))
    assert refusal is not None


async def test_record_name_strategies() -> None:
    fake = registry()
    fake.subjects[17] = ["shop.Order"]
    check = checker({"topics": {"orders": {"value": {"check": "subject",
                                                     "subject_strategy": "RecordName"}}}}, fake)
    assert await check.check(batch("orders", GOOD)) is None
    fake.subjects[17] = ["orders-shop.Order"]
    check = checker({"topics": {"orders": {"value": "subject",
                                           "subject_strategy": "TopicRecordName"}}}, fake)
    assert await check.check(batch("orders", GOOD)) is None


async def test_latest_version() -> None:
    fake = registry()
    fake.schemas[19] = Schema(19, "AVRO", json.dumps(ORDER))
    fake.subjects[19] = ["orders-value"]
    check = checker({"topics": {"orders": {"value": "payload", "require_latest": True}}}, fake)
    assert await check.check(batch("orders", GOOD)) is None
    refusal = await check.check(batch("orders", framed(19, GOOD[5:])))
    assert refusal is not None
    assert refusal.record_errors[0][1] == ("record 0: schema id 19 is not the latest version "
                                           "of orders-value (schema id 17 is)")


async def test_a_new_latest_version_is_taken_once_lookup_ttl_s_has_passed() -> None:
    """The lookups are the cache: past ``lookup_ttl_s`` they ask the registry, not a cache
    of the client's, which would keep the old answer as long again."""
    fake = registry()
    fake.schemas[19] = Schema(19, "AVRO", json.dumps(ORDER))
    fake.subjects[19] = ["orders-value"]
    check = checker({"lookup_ttl_s": 0.05,
                     "topics": {"orders": {"value": "payload", "require_latest": True}}}, fake)
    assert await check.check(batch("orders", GOOD)) is None
    fake.latest["orders-value"] = 19
    fake.stale_latest["orders-value"] = 17
    await asyncio.sleep(0.1)
    newer = batch("orders", framed(19, GOOD[5:]))
    deadline = asyncio.get_running_loop().time() + 5
    while (refusal := await check.check(newer)) is not None:
        assert asyncio.get_running_loop().time() < deadline, refusal
        await asyncio.sleep(0.02)


async def test_keys_headers_unframed_and_tombstones() -> None:
    config = {"topics": {"orders": {
        "key": {"check": "payload", "header": {"name": "kid", "encoding": "string"}},
        "value": {"check": "payload", "allow_unframed": True},
        "tombstones": "reject"}}}
    fake = registry()
    fake.subjects[17] = ["orders-key", "orders-value"]
    check = checker(config, fake)
    key = GOOD[5:]
    ok = batch("orders", GOOD, b"unframed is allowed", key=key, headers=(Header("kid", b"17"),))
    assert await check.check(ok) is None
    refusal = await check.check(batch("orders", GOOD, None, key=key))
    assert refusal is not None
    errors = dict(refusal.record_errors)
    assert errors[0] == "record 0: key: no schema id header 'kid'"
    assert "null value (tombstone)" in errors[1]
    # tombstones pass by default
    assert await checker(ORDERS).check(batch("orders", None)) is None


async def test_protobuf_nested_type_and_unknown_fields() -> None:
    proto = ('syntax = "proto3";\npackage shop;\n'
             'message Order { string id = 1; double amount = 2;\n'
             '  message Line { string sku = 1; int32 qty = 2; } }\n')
    fake = registry()
    fake.schemas[40] = Schema(40, "PROTOBUF", proto)
    fake.subjects[40] = ["lines-value"]
    check = checker({"topics": {"lines": {"value": "payload"}}}, fake)
    from google.protobuf import descriptor_pb2  # noqa: F401 - the runtime the decoder uses
    line = b"\x0a\x03abc\x10\x02"  # sku="abc", qty=2
    assert await check.check(batch("lines", framed(40, b"\x04\x00\x00" + line))) is None
    # the same bytes read as the top-level Order: field 2 arrives as a varint, not a double
    refusal = await check.check(batch("lines", framed(40, b"\x00" + line)))
    assert refusal is not None
    assert "field amount (number 2) arrived as varint" in refusal.record_errors[0][1]
    refusal = await check.check(batch("lines", framed(40, b"\x02\x0a" + line)))  # index [5]
    assert refusal is not None and "has only 1" in refusal.record_errors[0][1]



async def test_a_descriptor_importing_well_known_types_builds() -> None:
    """As confluent-kafka's ProtobufSerializer registers a message holding a Timestamp: a
    base64 FileDescriptorProto importing google/protobuf/timestamp.proto, no reference."""
    from google.protobuf import descriptor_pb2

    field = descriptor_pb2.FieldDescriptorProto
    fdp = descriptor_pb2.FileDescriptorProto(
        name="ev.proto", package="shop", syntax="proto3",
        dependency=["google/protobuf/timestamp.proto", "google/protobuf/wrappers.proto"])
    message = fdp.message_type.add(name="Ev")
    message.field.add(name="id", number=1, type=field.TYPE_STRING, label=field.LABEL_OPTIONAL)
    message.field.add(name="at", number=2, type=field.TYPE_MESSAGE, label=field.LABEL_OPTIONAL,
                      type_name=".google.protobuf.Timestamp")
    message.field.add(name="n", number=3, type=field.TYPE_MESSAGE, label=field.LABEL_OPTIONAL,
                      type_name=".google.protobuf.Int32Value")
    fake = registry()
    fake.schemas[41] = Schema(41, "PROTOBUF",
                              base64.b64encode(fdp.SerializeToString()).decode())
    fake.subjects[41] = ["evs-value"]
    rules = [{"name": "typed", "expr": "value.at > timestamp('1970-01-01T00:00:01Z') && "
                                       "value.n == 7"}]
    check = checker({"topics": {"evs": {"value": "payload", "rules": rules}}}, fake)
    event = b"\x0a\x02e1" + b"\x12\x02\x08\x05" + b"\x1a\x02\x08\x07"  # at 5 s, n 7
    assert await check.check(batch("evs", framed(41, b"\x00" + event))) is None
    refusal = await check.check(batch("evs", framed(41, b"\x00\x1a\x02\x08\x08")))  # n 8
    assert refusal is not None and "rule typed failed" in refusal.record_errors[0][1]
    # type.proto imports any.proto and source_context.proto: each added after its imports
    deep = descriptor_pb2.FileDescriptorProto(
        name="t.proto", package="shop", syntax="proto3",
        dependency=["google/protobuf/type.proto", "google/protobuf/any.proto"])
    holder = deep.message_type.add(name="Holder")
    holder.field.add(name="t", number=1, type=field.TYPE_MESSAGE, label=field.LABEL_OPTIONAL,
                     type_name=".google.protobuf.Type")
    fake.schemas[43] = Schema(43, "PROTOBUF", base64.b64encode(deep.SerializeToString()).decode())
    fake.subjects[43] = ["deep-value"]
    deep_check = checker({"topics": {"deep": {"value": "payload"}}}, fake)
    assert await deep_check.check(batch("deep", framed(43, b"\x00\x0a\x03\x0a\x01x"))) is None
    refusal = await check.check(batch("evs", framed(41, b"\x00" + b"\x12\x02\x58\x05")))
    assert refusal is not None  # a field a Timestamp does not have (number 11)
    assert refusal.record_errors[0][1].startswith(
        "record 0: field number 11 in at (varint) is not in the schema (shop.Ev")

async def test_json_schema_payload() -> None:
    check = checker({"topics": {"events": {"value": "payload"}}})
    assert await check.check(batch("events", framed(30, b'{"kind": "a"}'))) is None
    refusal = await check.check(batch("events", framed(30, b'{"other": 1}')))
    assert refusal is not None
    assert refusal.record_errors[0][1] == ('record 0: "kind" is a required property '
                                           "(schema id 30)")


async def test_rules_over_decoded_and_plain_json_values() -> None:
    rules = [{"name": "positive_amount", "expr": "value.amount > 0.0"},
             {"name": "known_currency", "expr": "value.currency in ['EUR', 'USD']",
              "message": "currency must be EUR or USD"}]
    check = checker({"topics": {"orders": {"value": "payload", "rules": rules}}})
    bad = framed(17, avro(ORDER, {"id": "o", "amount": -1.0, "currency": "GBP"}))
    refusal = await check.check(batch("orders", GOOD, bad))
    assert refusal is not None
    assert refusal.record_errors == ((1, "record 1: rule positive_amount failed: "
                                         "value.amount > 0.0 is false; rule known_currency "
                                         "failed: currency must be EUR or USD"),)
    assert check.rule_rejections == {"positive_amount": 1, "known_currency": 1}
    plain = ContractCheck(parse_settings({"topics": {"t": {"rules": [
        {"name": "has_kind", "expr": "value.kind == 'x' && topic == 't'"}]}}}), None,
        unknown_id=Unknown, unavailable=Down)
    assert await plain.check(batch("t", b'{"kind": "x"}')) is None
    refusal = await plain.check(batch("t", b'{"kind": 1}', b"nope"))
    assert refusal is not None
    errors = dict(refusal.record_errors)
    assert "rule has_kind could not be evaluated" in errors[0] or "failed" in errors[0]
    assert errors[1].startswith("record 1: not JSON")



async def test_rules_read_avro_timestamps_as_cel_timestamps() -> None:
    """timestamp-millis, -micros and local-timestamp-millis, nullable or not, as docs say."""
    import datetime

    def stamp(logical: str) -> dict[str, str]:
        return {"type": "long", "logicalType": logical}

    event = {"type": "record", "name": "Ev", "namespace": "shop", "fields": [
        {"name": "at", "type": ["null", stamp("timestamp-millis")], "default": None},
        {"name": "us", "type": stamp("timestamp-micros")},
        {"name": "local", "type": stamp("local-timestamp-millis")}]}
    fake = registry()
    fake.schemas[42] = Schema(42, "AVRO", json.dumps(event))
    fake.subjects[42] = ["evs-value"]
    rules = [{"name": "recent", "expr": "value.at == null || value.at > "
                                        "timestamp('2023-01-01T00:00:00Z')"},
             {"name": "ordered", "expr": "value.us <= value.local + duration('1h')"}]
    check = checker({"topics": {"evs": {"value": "payload", "rules": rules}}}, fake)
    utc = datetime.UTC
    when = datetime.datetime(2024, 5, 1, 12, tzinfo=utc)
    good = {"at": when, "us": when, "local": datetime.datetime(2024, 5, 1, 12)}
    old = {**good, "at": datetime.datetime(2020, 1, 1, tzinfo=utc)}
    unset = {**good, "at": None}
    refusal = await check.check(batch("evs", *(framed(42, avro(event, d))
                                               for d in (good, unset, old))))
    assert refusal is not None
    assert refusal.record_errors == ((2, "record 2: rule recent failed: value.at == null || "
                                         "value.at > timestamp('2023-01-01T00:00:00Z') is "
                                         "false"),)

async def test_allowed_unframed_values_go_through_the_rules_as_json() -> None:
    rules = [{"name": "positive_amount", "expr": "value.amount > 0.0"}]
    check = checker({"topics": {"orders": {
        "value": {"check": "payload", "allow_unframed": True}, "rules": rules}}})
    assert await check.check(batch("orders", GOOD, b'{"amount": 2.5}')) is None
    refusal = await check.check(batch("orders", b'{"amount": -1.0}', b"legacy bytes", GOOD))
    assert refusal is not None
    errors = dict(refusal.record_errors)
    assert errors[0] == "record 0: rule positive_amount failed: value.amount > 0.0 is false"
    assert errors[1].startswith("record 1: not JSON") and errors[1].endswith(
        "(the rules read the value as JSON)")
    assert sorted(errors) == [0, 1]
    # Without rules, an allowed unframed value passes whatever it holds.
    lenient = checker({"topics": {"orders": {"value": {"check": "payload",
                                                       "allow_unframed": True}}}})
    assert await lenient.check(batch("orders", b"legacy bytes")) is None


@dataclass
class FakeGlobalIds:
    """Apicurio globalId -> the Confluent-compatible API's id, in memory."""

    ids: dict[int, int]
    down: bool = False
    calls: list[int] = field(default_factory=list)

    async def registry_id(self, global_id: int) -> int:
        self.calls.append(global_id)
        if self.down:
            raise Down("connection refused")
        if global_id not in self.ids:
            raise Unknown(f"Apicurio global id {global_id} is not registered")
        return self.ids[global_id]


async def test_apicurio_global_ids_in_headers_are_translated() -> None:
    config = {"registry": {"url": "http://127.0.0.1:1/apis/ccompat/v7"},
              "topics": {"orders": {"value": {"check": "payload",
                                              "header": "apicurio.value.globalId"}}}}
    settings = parse_settings(config)
    assert settings.global_ids and settings.policy_for("orders").value.header.id == "global_id"
    fake, global_ids = registry(), FakeGlobalIds({5: 17})
    check = ContractCheck(settings, fake, unknown_id=Unknown, unavailable=Down,
                          global_ids=global_ids)

    def carrying(global_id: int, payload: bytes = GOOD[5:]) -> RecordBatch:
        return batch("orders", payload, headers=(
            Header("apicurio.value.globalId", struct.pack(">q", global_id)),))

    assert await check.check(carrying(5)) is None
    assert ("schema", 17) in fake.calls and global_ids.calls == [5]
    assert await check.check(carrying(5)) is None
    assert global_ids.calls == [5]  # a globalId names one version for good: kept
    for _ in range(2):
        refusal = await check.check(carrying(6))
        assert refusal is not None and refusal.record_errors == ((0, (
            "record 0: Apicurio global id 6 is not registered (header "
            "apicurio.value.globalId)")),)
    assert global_ids.calls == [5, 6]  # the unknown answer is remembered a while
    refusal = await check.check(carrying(5, b"\x02"))
    assert refusal is not None and "field" in refusal.record_errors[0][1]
    global_ids.down = True
    refusal = await check.check(carrying(7))
    assert refusal is not None and refusal.code == ErrorCode.REQUEST_TIMED_OUT
    assert await check.check(carrying(5)) is None  # translated before: still checked
    # The header's id kind: by name, or as configured; global_id needs Apicurio's ccompat URL.
    header = {"name": "apicurio.value.contentId"}
    plain = parse_settings({**config, "topics": {"o": {"value": {"check": "id",
                                                                 "header": header}}}})
    assert plain.policy_for("o").value.header.id == "registry" and not plain.global_ids
    with pytest.raises(ValueError, match=r"registry.url: .* id: global_id"):
        parse_settings({"registry": {"url": "http://127.0.0.1:1"},
                        "topics": config["topics"]})
    with pytest.raises(ValueError,
                       match=r"topics.o.value.header.id: expected 'registry' or 'global_id'"):
        parse_settings({**config, "topics": {"o": {"value": {"check": "id", "header": {
            "name": "h", "id": "content"}}}}})


def test_bad_configuration_names_the_key() -> None:
    cases = {
        "topics.orders.value.check": {"topics": {"orders": {"value": "paylod"}}},
        "topics.orders.rules[0].expr": {"topics": {"orders": {"value": "payload", "rules": [
            {"name": "r", "expr": "value.amount >"}]}}},
        "topics.orders.rule: unknown key; did you mean topics.orders.rules?": {
            "topics": {"orders": {"rule": []}}},
        "on_registry_unavailable": {"topics": {"o": {}}, "on_registry_unavailable": "maybe"},
    }
    for where, config in cases.items():
        with pytest.raises(ValueError, match=re.escape(where)):
            parse_settings({"registry": {"url": "x"}, **config})
    with pytest.raises(ValueError, match=r"^registry: "):
        parse_settings({"topics": {"o": {"value": "id"}}})


async def test_registry_down_policy_and_cached_ids() -> None:
    fake = registry()
    check = checker(ORDERS, fake, negative_ttl_s=0.2)
    assert await check.check(batch("orders", GOOD)) is None
    fake.down = True
    assert await check.check(batch("orders", GOOD)) is None  # cached: still checked
    fake.schemas[20] = Schema(20, "AVRO", json.dumps(ORDER))
    new = framed(20, GOOD[5:])
    refusal = await check.check(batch("orders", new))
    assert refusal is not None and refusal.code == ErrorCode.REQUEST_TIMED_OUT
    assert "could not check orders[0] against the schema registry" in refusal.message
    passing = checker({**ORDERS, "on_registry_unavailable": "pass"}, fake)
    assert await passing.check(batch("orders", new)) is None
    assert passing.unavailable_passed == 1
    fake.down = False
    fake.subjects[20] = ["orders-value"]
    refusal = await check.check(batch("orders", new))  # "unavailable" is remembered briefly
    assert refusal is not None and refusal.code == ErrorCode.REQUEST_TIMED_OUT
    await asyncio.sleep(0.25)  # negative_ttl_s
    assert await check.check(batch("orders", new)) is None


async def test_one_lookup_in_flight_per_id() -> None:
    fake = registry()
    fake.gate = asyncio.Event()
    check = checker(ORDERS, fake)
    first = asyncio.ensure_future(check.check(batch("orders", GOOD)))
    second = asyncio.ensure_future(check.check(batch("orders", GOOD)))
    await asyncio.sleep(0.01)
    fake.gate.set()
    assert await first is None and await second is None
    assert fake.calls.count(("schema", 17)) == 1


async def test_id_level_judges_each_frame_once_and_names_every_record() -> None:
    fake = registry()
    check = checker({"topics": {"orders": {"value": "subject"}}}, fake)
    unknown = framed(99, b"whatever")
    refusal = await check.check(batch("orders", GOOD, GOOD, unknown, GOOD, unknown, b"x"))
    assert refusal is not None
    assert [i for i, _ in refusal.record_errors] == [2, 4, 5]
    assert refusal.record_errors[1] == (4, "record 4: schema id 99 is not registered")
    assert check.rejections["unknown_id"] == 2 and check.rejections["unframed"] == 1
    assert fake.calls.count(("schema", 99)) == 1


async def test_an_id_registered_under_another_subject_later_is_accepted_at_once() -> None:
    fake = registry()
    check = checker({"topics": {"orders": {"value": "payload"},
                                "archive": {"value": "payload"}}}, fake)
    assert await check.check(batch("orders", GOOD)) is None
    assert await check.check(batch("archive", GOOD)) is not None  # not under archive-value
    fake.subjects[17].append("archive-value")
    # asked again at most once a second per (id, subject): a refusing producer cannot
    # turn each record into a registry request
    assert await check.check(batch("archive", GOOD)) is not None
    await asyncio.sleep(1.05)
    assert await check.check(batch("archive", GOOD)) is None


async def test_a_compiled_schema_is_refreshed_after_cache_ttl_s_while_it_serves() -> None:
    fake = registry()
    check = checker(ORDERS, fake, cache_ttl_s=0.1)
    assert await check.check(batch("orders", GOOD)) is None
    await asyncio.sleep(0.15)
    fake.gate = asyncio.Event()  # the refresh waits; the batch does not
    assert await check.check(batch("orders", GOOD)) is None
    await asyncio.sleep(0.01)
    assert fake.calls.count(("schema", 17)) == 2
    fake.gate.set()


BROKEN = Schema(17, "AVRO", json.dumps({"type": "record", "name": "Order", "fields": [
    {"name": "id", "type": "shop.NoSuchType"}]}))


@pytest.mark.parametrize("policy", ["reject", "pass"])
async def test_a_schema_the_proxy_cannot_compile_is_not_the_records_fault(
        policy: str, caplog: pytest.LogCaptureFixture) -> None:
    fake = registry()
    fake.schemas[17] = BROKEN
    check = checker({**ORDERS, "on_registry_unavailable": policy}, fake, negative_ttl_s=0.2)
    refusal = await check.check(batch("orders", GOOD))
    if policy == "reject":
        assert refusal is not None and refusal.code == ErrorCode.REQUEST_TIMED_OUT
        assert "schema id 17: the proxy cannot compile its schema" in refusal.message
    else:
        assert refusal is None and check.unavailable_passed == 1
    assert check.lookups.uncompilable == 1
    [line] = [r for r in caplog.records if "cannot be compiled by the" in r.getMessage()]
    assert line.levelname == "WARNING" and "schema id 17" in line.getMessage()
    assert "NoSuchType" in line.getMessage()
    await check.check(batch("orders", GOOD))
    assert fake.calls.count(("schema", 17)) == 1  # remembered for negative_ttl_s

    fake.schemas[17] = registry().schemas[17]  # the registry's schema fixed
    await asyncio.sleep(0.25)
    assert await check.check(batch("orders", GOOD)) is None
    assert fake.calls.count(("schema", 17)) == 2
    refusal = await check.check(batch("orders", framed(17, b"\x02")))
    # compiled: a record that does not match is the record's fault
    assert refusal is not None and refusal.code == ErrorCode.INVALID_RECORD


class _Unreadable(FakeRegistry):
    """A registry whose answer for id 21 has a field of the wrong type (``"references":
    5``): the client raises what parsing it raises."""

    async def schema_by_id(self, schema_id: int, *, fresh: bool = False) -> Schema:
        if schema_id == 21:
            self.calls.append(("schema", schema_id))
            raise TypeError("'int' object is not iterable")
        return await super().schema_by_id(schema_id, fresh=fresh)


async def test_an_answer_the_proxy_cannot_read_is_retried_later_not_refused_for_good() -> None:
    """It escaped the check as the plugin's failure: INVALID_RECORD, which producers do
    not retry (the records were lost), and it was asked again for every batch."""
    base = registry()
    fake = _Unreadable(schemas=base.schemas, subjects=base.subjects, latest=base.latest)
    check = checker(ORDERS, fake, negative_ttl_s=30)
    for _ in range(2):
        refusal = await check.check(batch("orders", framed(21, GOOD[5:])))
        assert refusal is not None and refusal.code == ErrorCode.REQUEST_TIMED_OUT
        assert "the registry's answer cannot be read (TypeError: " in refusal.message
    assert fake.calls.count(("schema", 21)) == 1  # remembered for negative_ttl_s


async def test_a_schema_nested_past_the_recursion_limit_is_uncompilable_not_bad_data(
        ) -> None:
    deep = '{"type": "array", "items": ' * 1200 + '"int"' + "}" * 1200
    fake = registry()
    fake.schemas[22] = Schema(22, "AVRO", deep)
    fake.subjects[22] = ["orders-value"]
    refusal = await checker(ORDERS, fake).check(batch("orders", framed(22, b"\x00")))
    assert refusal is not None and refusal.code == ErrorCode.REQUEST_TIMED_OUT
    assert "the proxy cannot compile its schema (RecursionError" in refusal.message


async def test_a_batch_of_many_unknown_ids_starts_a_bounded_number_of_lookups() -> None:
    """Values not framed by a serializer (raw numbers after a 0 byte) read as many made-up
    ids: every one was looked up at once, filling the registry's request slots that other
    producers wait on (one batch of 0.5 MB took 800 MB). A batch now starts at most
    LOOKUPS_PER_BATCH lookups and is refused with a code producers retry; the retry does
    the next ones, so a batch of real ids gets checked in the end."""
    from kiproxy.interceptors.builtin.schema_registry.contract import LOOKUPS_PER_BATCH

    fake = registry()
    check = checker(ORDERS, fake)
    made_up = [framed(1000 + i, b"\x02") for i in range(200)]
    refusal = await check.check(batch("orders", *made_up))
    assert refusal is not None and refusal.code == ErrorCode.REQUEST_TIMED_OUT
    assert "needs 200 schema registry lookups" in refusal.message
    assert len(fake.calls) == LOOKUPS_PER_BATCH
    assert check.rejections["too_many_lookups"] == 1

    real = registry()
    for i in range(100):  # 100 real ids (and their subjects) in one batch
        real.schemas[100 + i] = Schema(100 + i, "AVRO", json.dumps(ORDER))
        real.subjects[100 + i] = ["orders-value"]
    check = checker(ORDERS, real)
    values = [framed(100 + i, GOOD[5:]) for i in range(100)]
    outcomes = [await check.check(batch("orders", *values)) for _ in range(3)]
    assert all(o is not None and o.code == ErrorCode.REQUEST_TIMED_OUT for o in outcomes[:-1])
    assert outcomes[-1] is None  # 200 lookups, at most 64 a pass: checked on the third try
    for kind in ("schema", "subjects"):  # each asked once
        assert sorted(sid for k, sid in real.calls if k == kind) == list(range(100, 200))


async def test_many_records_of_one_new_id_ask_once_and_pass_first_time() -> None:
    """Each record waiting for the same answer counted as a lookup of its own, so a batch
    of 65 records of a new id was refused as needing 65 lookups."""
    fake = registry()
    check = checker(ORDERS, fake)
    assert await check.check(batch("orders", *[GOOD] * 200)) is None
    assert sorted(fake.calls) == [("schema", 17), ("subjects", 17)]


async def test_a_subjects_lookup_the_registry_could_not_answer_is_remembered_a_while(
        ) -> None:
    """An id's subjects (and a subject's latest version) the registry could not give were
    asked again for every batch while it was down, not once per negative_ttl_s as an id
    is (and as the page says)."""
    fake = registry()
    check = checker(ORDERS, fake, negative_ttl_s=0.2)
    await check.lookups.lookup(17)  # the schema is cached; its subjects are not
    fake.down = True
    for _ in range(3):
        refusal = await check.check(batch("orders", GOOD))
        assert refusal is not None and refusal.code == ErrorCode.REQUEST_TIMED_OUT
        assert "subjects of schema id 17" in refusal.message
    assert fake.calls.count(("subjects", 17)) == 1
    fake.down = False
    await asyncio.sleep(0.25)  # negative_ttl_s: asked again, and now answered
    assert await check.check(batch("orders", GOOD)) is None
    assert fake.calls.count(("subjects", 17)) == 2
