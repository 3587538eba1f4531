"""The compiled Avro payload check: what it accepts fastavro reads whole; what it refuses, it names.

Every schema below gets valid datums written by fastavro, which the check must
accept; then every truncation, every single-byte change and a trailing byte of
each: whatever the check still accepts, fastavro must read to the last byte.
"""

from __future__ import annotations

import decimal
import io
import json
from dataclasses import dataclass
from typing import Any

import fastavro
import pytest

from kiproxy.interceptors.builtin.schema_registry._avro_check import MAX_DEPTH, MAX_EMPTY_ITEMS
from kiproxy.interceptors.builtin.schema_registry.avro import compile_avro
from kiproxy.interceptors.builtin.schema_registry.formats import PayloadError
from kiproxy.interceptors.builtin.schema_registry.registry import RegisteredSchema

ADDRESS = {"type": "record", "name": "Address", "namespace": "shop",
           "fields": [{"name": "street", "type": "string"}, {"name": "zip", "type": "string"}]}
ORDER = {"type": "record", "name": "Order", "namespace": "shop", "fields": [
    {"name": "id", "type": "string"},
    {"name": "amount", "type": "double"},
    {"name": "qty", "type": "int"},
    {"name": "ts", "type": {"type": "long", "logicalType": "timestamp-millis"}},
    {"name": "express", "type": "boolean"},
    {"name": "ratio", "type": "float"},
    {"name": "blob", "type": "bytes"},
    {"name": "status", "type": {"type": "enum", "name": "Status",
                                "symbols": ["NEW", "PAID", "SHIPPED"]}},
    {"name": "digest", "type": {"type": "fixed", "name": "Digest", "size": 4}},
    {"name": "address", "type": ["null", ADDRESS]},
    {"name": "lines", "type": {"type": "array", "items": {
        "type": "record", "name": "Line", "fields": [
            {"name": "sku", "type": "string"}, {"name": "n", "type": "long"}]}}},
    {"name": "tags", "type": {"type": "map", "values": ["null", "string", "long"]}},
    {"name": "price", "type": {"type": "bytes", "logicalType": "decimal", "precision": 9,
                               "scale": 2}},
    {"name": "note", "type": ["null", "string"], "default": None},
]}
ORDER_DATUMS = [
    {"id": "o-1", "amount": 12.5, "qty": 3, "ts": 1_700_000_000_000, "express": True,
     "ratio": 0.5, "blob": b"\x00\xff", "status": "PAID", "digest": b"abcd",
     "address": {"street": "Rue de l'Été", "zip": "75001"},
     "lines": [{"sku": "a", "n": 1}, {"sku": "ü", "n": -300}],
     "tags": {"k": "v", "n": 5, "z": None}, "price": decimal.Decimal("123.45"), "note": "ok"},
    {"id": "", "amount": -0.0, "qty": -2**31, "ts": 0, "express": False, "ratio": 1e30,
     "blob": b"", "status": "NEW", "digest": b"\x00\x00\x00\x00", "address": None,
     "lines": [], "tags": {}, "price": decimal.Decimal("-0.01"), "note": None},
]
LIST = {"type": "record", "name": "Node", "fields": [
    {"name": "value", "type": "int"}, {"name": "next", "type": ["null", "Node"]}]}
EMPTY = {"type": "record", "name": "Marker", "fields": []}
NULLS = {"type": "record", "name": "Holder", "fields": [
    {"name": "markers", "type": {"type": "array", "items": EMPTY}},
    {"name": "nothing", "type": {"type": "array", "items": "null"}},
    {"name": "count", "type": "int"}]}
CASES = [
    (ORDER, ORDER_DATUMS),
    (LIST, [{"value": 1, "next": {"value": 2, "next": None}}, {"value": -1, "next": None}]),
    (NULLS, [{"markers": [{}, {}, {}], "nothing": [None] * 5, "count": 7}]),
    ("string", ["plain", "日本語"]),
    (["null", "long", {"type": "array", "items": "int"}], [None, 5, [1, 2, 3]]),
]


@dataclass(frozen=True)
class _Source:
    schema_id: int
    schema_type: str
    schema: str
    references: tuple[Any, ...] = ()


def compiled(schema: Any, schema_id: int = 7) -> Any:
    return compile_avro(_Source(schema_id, "AVRO", json.dumps(schema)))


def written(schema: Any, datum: Any) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, fastavro.parse_schema(schema), datum)
    return out.getvalue()


def fastavro_reads_whole(schema: Any, payload: bytes) -> bool:
    buf = io.BytesIO(payload)
    try:
        fastavro.schemaless_reader(buf, fastavro.parse_schema(schema), None)
    except Exception:
        return False
    return buf.tell() == len(payload)


def accepts(check: Any, payload: bytes) -> bool:
    try:
        check.check(payload)
    except PayloadError:
        return False
    return True


@pytest.mark.parametrize(("schema", "datums"), CASES, ids=lambda c: str(c)[:30])
def test_valid_payloads_pass_and_anything_else_it_passes_fastavro_reads_whole(
        schema: Any, datums: list[Any]) -> None:
    check = compiled(schema)
    refused = 0
    for datum in datums:
        payload = written(schema, datum)
        check.check(payload)
        check.check(b"\x00\x00\x00\x00\x07" + payload, (), 5)
        assert check.decode(memoryview(payload), ()) is not None or datum is None
        variants = [payload[:cut] for cut in range(len(payload))] + [payload + b"\x00"]
        variants += [payload[:i] + bytes([b]) + payload[i + 1:]
                     for i in range(len(payload)) for b in (0x00, 0x01, 0x7F, 0x80, 0xFF)
                     if payload[i] != b]
        for variant in variants:
            if accepts(check, variant):
                assert fastavro_reads_whole(schema, variant), variant
            else:
                refused += 1
    assert refused > 0


def test_each_refusal_names_the_field_and_the_cause() -> None:
    check = compiled(ORDER)
    good = written(ORDER, ORDER_DATUMS[0])
    with pytest.raises(PayloadError) as exc:
        check.check(good[:3])
    assert str(exc.value) == ("field id: expected string: a length of 3 byte(s) where 2 are "
                              "left: the payload ends too early (shop.Order (schema id 7))")
    with pytest.raises(PayloadError) as exc:
        check.check(good + b"\x02")
    assert str(exc.value) == ("1 byte(s) left over after reading shop.Order (schema id 7): "
                              "the payload was written with another schema")
    # the street of the address: its length byte made negative
    at = good.index(b"Rue") - 1
    with pytest.raises(PayloadError) as exc:
        check.check(good[:at] + b"\x03" + good[at + 1:])
    assert str(exc.value).startswith("field address.street: expected string: a negative "
                                     "length (-2)")
    # the second line's sku: not UTF-8
    at = good.index("ü".encode())
    with pytest.raises(PayloadError) as exc:
        check.check(good[:at] + b"\xff\xfe" + good[at + 2:])
    assert str(exc.value).startswith("field lines[1].sku: expected string: a string that is "
                                     "not UTF-8 (invalid start byte at byte 0)")


def test_out_of_range_indexes_and_ints_are_refused() -> None:
    enum = {"type": "enum", "name": "E", "symbols": ["A", "B"]}
    with pytest.raises(PayloadError, match=r"enum symbol 2 where the schema has 2"):
        compiled(enum).check(b"\x04")
    with pytest.raises(PayloadError, match=r"enum symbol -1 where the schema has 2"):
        compiled(enum).check(b"\x01")
    with pytest.raises(PayloadError, match=r"union branch 2 where the schema has 2"):
        compiled(["null", "int"]).check(b"\x04")
    with pytest.raises(PayloadError, match=r"an int out of 32-bit range \(2147483648\)"):
        compiled("int").check(b"\x80\x80\x80\x80\x10")
    with pytest.raises(PayloadError, match=r"a varint longer than 5 bytes"):
        compiled("int").check(b"\x80" * 5 + b"\x00")
    with pytest.raises(PayloadError, match=r"a varint beyond 64 bits"):
        compiled("long").check(b"\xff" * 10 + b"\x01")
    with pytest.raises(PayloadError, match=r"a varint beyond 64 bits"):
        compiled("long").check(b"\xff" * 9 + b"\x02")
    compiled("long").check(b"\xff" * 9 + b"\x01")  # the smallest long, in 10 bytes


def test_hostile_payloads_are_refused_without_running_away() -> None:
    nested = b"".join(b"\x02\x02" for _ in range(MAX_DEPTH + 5)) + b"\x02\x00"
    with pytest.raises(PayloadError, match=r"nested deeper than"):
        compiled(LIST).check(nested)
    # a block claiming more items than there are bytes
    with pytest.raises(PayloadError, match=r"a block of 1000000 item\(s\) where 1 byte"):
        compiled({"type": "array", "items": "long"}).check(b"\x80\x89\x7a\x00")
    # items written in no bytes: accepted up to a bound, refused beyond it
    nulls = {"type": "array", "items": "null"}
    compiled(nulls).check(b"\x80\x89\x7a\x00")
    too_many = fastavro_long(MAX_EMPTY_ITEMS + 1)
    with pytest.raises(PayloadError, match=r"more than \d+ items of no width"):
        compiled(nulls).check(too_many + b"\x00")


def test_a_run_of_records_with_one_frame_is_checked_in_one_call() -> None:
    from kiproxy.interceptors.api import Record
    check = compiled(ORDER)
    frame = b"\x00\x00\x00\x00\x07"
    good = frame + written(ORDER, ORDER_DATUMS[0])
    other = b"\x00\x00\x00\x00\x08" + written(ORDER, ORDER_DATUMS[1])
    records = tuple(Record(value=v) for v in (good, good, good[:-1], good, other, None, good))
    assert check.check_run(records, 0, frame) == 2
    assert check.check_run(records, 3, frame) == 4
    assert check.check_run(records, 5, frame) == 5
    assert check.check_run(records, 6, frame) == 7


def fastavro_long(n: int) -> bytes:
    out = io.BytesIO()
    fastavro.schemaless_writer(out, "long", n)
    return out.getvalue()


def test_references_compile_as_named_types() -> None:
    ref = RegisteredSchema(schema_id=3, schema_type="AVRO", schema=json.dumps(ADDRESS),
                           references=())
    from kiproxy.interceptors.builtin.schema_registry.registry import SchemaReference
    main = {"type": "record", "name": "Customer", "namespace": "shop",
            "fields": [{"name": "home", "type": "shop.Address"}]}
    source = RegisteredSchema(
        schema_id=4, schema_type="AVRO", schema=json.dumps(main),
        references=(SchemaReference(name="shop.Address", subject="address", version=1,
                                    schema=ref),))
    check = compile_avro(source)
    payload = written({**main, "fields": [{"name": "home", "type": ADDRESS}]},
                      {"home": {"street": "s", "zip": "z"}})
    check.check(payload)
    with pytest.raises(PayloadError, match=r"field home.zip: expected string"):
        check.check(payload[:-1])


def _doubling(depth: int, last: Any) -> dict[str, Any]:
    """Records R0..R{depth}, each naming the next twice (inline, then by name); the last is
    a record of one field of type ``last``."""
    node: dict[str, Any] = {"type": "record", "name": f"R{depth}",
                            "fields": [{"name": "n", "type": last}]}
    for d in range(depth - 1, -1, -1):
        node = {"type": "record", "name": f"R{d}",
                "fields": [{"name": "a", "type": node}, {"name": "b", "type": f"R{d + 1}"}]}
    return node


def test_records_that_name_the_next_twice_compile_and_check_in_linear_time() -> None:
    """A 4 KB schema whose every record names the next twice took time doubling with each
    level: at depth 20, 4 s to compile and 17 ms to check an empty payload, holding the
    GIL; at depth 40 it never ends. Each record's width is now decided once, and a
    record written in no bytes is not walked."""
    empty = compile_avro(RegisteredSchema(schema_id=1, schema_type="AVRO", references=(),
                                          schema=json.dumps(_doubling(40, "null"))))
    empty.check(b"")  # nulls all the way down: no bytes, valid
    with pytest.raises(PayloadError):
        empty.check(b"\x00")  # a byte more than the datum
    ints = compile_avro(RegisteredSchema(schema_id=2, schema_type="AVRO", references=(),
                                         schema=json.dumps(_doubling(3, "int"))))
    ints.check(b"\x02" * 2 ** 3)  # 8 ints: a datum that really is exponential in size
