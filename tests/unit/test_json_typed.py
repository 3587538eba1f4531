"""The JSON Schema validator's typed first look accepts only what the full path accepts."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from kiproxy.interceptors.builtin._json_typed import _maybe_huge, typed_check
from kiproxy.interceptors.builtin.json_schema import (
    JsonSchemaValidator,
    _load_schema,
    _Schema,
)

NAMES = st.sampled_from(["id", "kind", "a b", "é", "", "0", "$x", "kind2"])
INT64 = st.integers(-(2**63), 2**63 - 1)
SCALARS = st.one_of(
    st.none(), st.booleans(), st.integers(-(2**80), 2**80), INT64,
    st.floats(allow_nan=False, allow_infinity=False), st.just(1.0), st.just(-0.0),
    st.text(max_size=8),
)
JSON = st.recursive(SCALARS, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(NAMES, inner, max_size=3)), max_leaves=8)
ANNOTATIONS = st.dictionaries(st.sampled_from(["title", "description", "format", "$comment"]),
                              st.just("x"), max_size=2)


@st.composite
def properties(draw: st.DrawFn) -> dict[str, Any]:
    """A property schema of the subset: a scalar type, its bounds, annotations."""
    schema: dict[str, Any] = draw(ANNOTATIONS)
    kind = draw(st.sampled_from([None, "string", "integer", "number", "boolean", "null"]))
    if kind is None:
        return schema
    schema["type"] = kind
    bounds = {"integer": ("minimum", "maximum", -5), "string": ("minLength", "maxLength", 0)}
    if kind in bounds:
        low_name, high_name, least = bounds[kind]
        low, high = sorted(draw(st.lists(st.integers(least, least + 9), min_size=2, max_size=2)))
        for key in draw(st.sets(st.sampled_from([low_name, high_name]))):
            schema[key] = low if key == low_name else high
    return schema


@st.composite
def schemas(draw: st.DrawFn) -> dict[str, Any]:
    props = draw(st.dictionaries(NAMES, properties(), max_size=4))
    schema: dict[str, Any] = {"type": "object", "properties": props}
    schema["required"] = draw(st.lists(NAMES, unique=True, max_size=3))
    return schema


def _conforming(draw: Callable[[st.SearchStrategy[Any]], Any], schema: dict[str, Any]) -> Any:
    """A value of ``schema``'s type within its bounds (int64 integers, finite floats)."""
    kind = schema.get("type")
    if kind == "string":
        low = schema.get("minLength", 0)
        return draw(st.text(min_size=low, max_size=max(low, schema.get("maxLength", 6))))
    if kind == "integer":
        return draw(st.integers(schema.get("minimum", -(2**63)), schema.get("maximum", 2**63 - 1)))
    if kind == "number":
        return draw(st.one_of(INT64, st.floats(allow_nan=False, allow_infinity=False)))
    if kind == "boolean":
        return draw(st.booleans())
    if kind == "null":
        return None
    return draw(JSON)


@st.composite
def documents(draw: st.DrawFn, schema: dict[str, Any]) -> bytes:
    """Values near the schema: conforming fields, wrong ones, extra ones, broken bytes."""
    doc: dict[str, Any] = draw(st.dictionaries(NAMES, JSON, max_size=3))
    for name, prop in schema["properties"].items():
        if draw(st.booleans()):
            doc[name] = _conforming(draw, prop) if draw(st.booleans()) else draw(JSON)
    for name in schema["required"]:
        if draw(st.integers(0, 5)) and name not in doc:
            doc[name] = _conforming(draw, schema["properties"].get(name, {}))
    value = json.dumps(doc, ensure_ascii=draw(st.booleans())).encode()
    return _mutated(draw, value)


def _mutated(draw: st.DrawFn, value: bytes) -> bytes:
    choice = draw(st.integers(0, 7))
    if choice == 0 and value.endswith(b"}") and len(value) > 2:  # invalid UTF-8 in a string
        bad = draw(st.sampled_from([b"\xff", b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80"]))
        return value[:-1] + b', "zz": "' + bad + b'"}'
    if choice == 1 and value.endswith(b"}") and len(value) > 2:  # a duplicated name, last wins
        name = draw(NAMES)
        return value[:-1] + b", " + json.dumps(name).encode() + b": " + json.dumps(
            draw(SCALARS)).encode() + b"}"
    if choice == 2 and value.endswith(b"}") and len(value) > 2:  # numbers JSON allows
        text = draw(st.sampled_from([b"1e999", b"-1e999", b"1e-400", b"1E2", b"-0", b"1.0"]))
        return value[:-1] + b', "' + draw(NAMES).encode() + b'": ' + text + b"}"
    if choice == 3:
        at = draw(st.integers(0, len(value)))
        return value[:at] + draw(st.binary(max_size=3)) + value[at:]
    if choice == 4:
        return draw(st.sampled_from([b"", b"[]", b"null", b"1", b'"x"', b"NaN", b"\xef\xbb\xbf{}"]))
    return value


def _full_path(schema: dict[str, Any]) -> tuple[JsonSchemaValidator, _Schema]:
    plugin = JsonSchemaValidator()
    full = _load_schema(schema, "test")
    return plugin, _Schema(full.validator, None)


@settings(max_examples=400, deadline=None)
@given(st.data())
def test_what_the_typed_check_accepts_the_full_path_accepts(data: st.DataObject) -> None:
    schema = data.draw(schemas())
    accepts = typed_check(schema)
    assert accepts is not None
    plugin, full = _full_path(schema)
    for _ in range(5):
        value = data.draw(documents(schema))
        if accepts(value):
            assert plugin._check(value, full) is None, (schema, value)


@settings(max_examples=200, deadline=None)
@given(st.data())
def test_conforming_values_take_the_typed_path(data: st.DataObject) -> None:
    """Not a vacuous check: a value with every named field of its type is accepted."""
    schema = data.draw(schemas())
    accepts = typed_check(schema)
    assert accepts is not None
    doc = {name: _conforming(data.draw, prop) for name, prop in schema["properties"].items()}
    doc.update({name: data.draw(JSON) for name in schema["required"] if name not in doc})
    value = json.dumps(doc, ensure_ascii=data.draw(st.booleans())).encode()
    assume(not _maybe_huge(value))  # may hold a number beyond a double: the full way
    assert accepts(value)


@settings(max_examples=300, deadline=None)
@given(JSON, st.booleans())
def test_the_empty_schema_accepts_exactly_json(doc: Any, ascii_only: bool) -> None:
    accepts = typed_check({})
    assert accepts is not None
    value = json.dumps(doc, ensure_ascii=ascii_only).encode()
    assume(not _maybe_huge(value))  # may hold a number beyond a double: the full way
    assert accepts(value)


@pytest.mark.parametrize("value", [
    b'{"id": 1, "kind": "a", "x": "\xff"}', b'{"id": 1, "kind": "a", "x": [1,', b"NaN",
    b'{"id": 1, "kind": "a"} x', b"\xef\xbb\xbf{}", b'"\\ud800"', b"[" * 2000 + b"]" * 2000,
    b'{"x": 1e400}', b'{"x": 2.5E+308}', b'{"x": ' + b"9" * 400 + b".0}",
])
def test_the_empty_schema_leaves_what_is_not_json_to_the_full_path(value: bytes) -> None:
    accepts = typed_check({})
    assert accepts is not None and not accepts(value)


@pytest.mark.parametrize("schema", [
    {"type": "object", "properties": {"a": {"type": "string", "pattern": "^x"}}},
    {"type": "object", "properties": {"a": {"type": "object"}}},
    {"type": "object", "properties": {"a": {"type": "array"}}},
    {"type": "object", "properties": {"a": {"type": ["string", "null"]}}},
    {"type": "object", "properties": {"a": {"type": "integer", "exclusiveMinimum": 0}}},
    {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0.5}}},
    {"type": "object", "properties": {"a": {"type": "number", "minimum": 0}}},
    {"type": "object", "properties": {"a": {"minimum": 0}}},
    {"type": "object", "properties": {"a": {"enum": [1, 2]}}},
    {"type": "object", "properties": {"a": True}},
    {"type": "object", "additionalProperties": False},
    {"type": "object", "required": ["a", "a"]},
    {"type": "array"},
    {"oneOf": [{"type": "object"}]},
    {"$ref": "#/$defs/x", "$defs": {"x": {}}},
])
def test_schemas_outside_the_subset_get_no_typed_check(schema: dict[str, Any]) -> None:
    assert typed_check(schema) is None


def test_the_validator_gives_the_same_verdicts_on_either_path() -> None:
    schema = {"type": "object", "required": ["id", "kind"],
              "properties": {"id": {"type": "integer", "minimum": 0}, "kind": {"type": "string"}}}
    plugin = JsonSchemaValidator()
    plugin.configure({"default_schema": schema})
    assert plugin.default.accepts is not None
    _, full = _full_path(schema)
    values = [b'{"id": 1, "kind": "a", "n": 2}', b'{"id": 1.0, "kind": "a"}',
              b'{"id": -1, "kind": "a"}', b'{"kind": "a"}', b'{"id": 1, "kind": "a", "x": "\xff"}',
              b'{"id": -1, "kind": "a", "id": 1}', b"[]", b"NaN"]
    for value in values:
        assert plugin._check(value, plugin.default) == plugin._check(value, full), value
    assert plugin._check(b'{"id": 1.0, "kind": "a"}', plugin.default) is None
    assert not plugin.default.accepts(b'{"id": 1.0, "kind": "a"}')  # the full path decided


def test_an_integer_past_pythons_digit_limit_is_left_to_the_full_path() -> None:
    """msgspec skips it; json refuses it (so the full path calls the value not JSON)."""
    schema = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {}}}
    accepts = typed_check(schema)
    assert accepts is not None
    plugin, full = _full_path(schema)
    huge = b"1" + b"0" * 5000
    for value in (b'{"a": 1, "x": ' + huge + b"}", b'{"b": ' + huge + b"}"):
        assert not accepts(value)
        assert plugin._check(value, full) is not None
    assert accepts(b'{"a": 1, "x": "' + huge + b'"}') is False  # refusing more is allowed
    empty = typed_check({})
    assert empty is not None and not empty(huge)


@pytest.mark.parametrize("bound", [
    {"type": "integer", "maximum": 2**64 - 1}, {"type": "integer", "minimum": -(2**63) - 1},
    {"type": "string", "maxLength": 2**63},
])
def test_bounds_past_64_bits_get_no_typed_check_and_still_load(bound: dict[str, Any]) -> None:
    schema = {"type": "object", "properties": {"a": bound}}
    assert typed_check(schema) is None
    plugin = JsonSchemaValidator()
    plugin.configure({"default_schema": schema})
    assert plugin.default.accepts is None and plugin.default.validator is not None


@settings(max_examples=2000, deadline=None)
@given(value=st.binary(max_size=24) | st.lists(st.sampled_from(
    [b"1", b"0", b"9", b".", b"e", b"E", b"+", b"-", b'"', b" ", b"x"]), max_size=40).map(
    b"".join))
def test_the_compiled_look_for_huge_numbers_finds_what_its_expression_finds(
        value: bytes) -> None:
    """``_maybe_huge`` is one pass in C standing for a regular expression (which read a
    value byte by byte: 3 us of a 1 KiB record's check): it answers as the expression
    does on any bytes."""
    import re

    expression = re.compile(rb"[0-9.][eE]\+?0*[1-9][0-9]{2}|[0-9]{200}").search
    assert _maybe_huge(value) == (expression(value) is not None)


@pytest.mark.parametrize(("value", "huge"), [
    (b'{"n": 1e400}', True), (b'{"n": 1E+0100}', True), (b'{"n": .5e100}', True),
    (b'{"n": 1e99}', False), (b'{"n": 1e+00099}', False),
    (b'{"n": ' + b"1" * 200 + b"}", True), (b'{"n": ' + b"1" * 199 + b"}", False),
    (b'"' + b"1" * 199 + b'.1"', False), (b"", False),
    (json.dumps({f"k{i}": f"city-{i:06d}" for i in range(50)}).encode(), False),
])
def test_the_look_for_huge_numbers_at_its_edges(value: bytes, huge: bool) -> None:
    assert _maybe_huge(value) is huge
