"""Avro payloads: the registry's schema parsed once by fastavro, each payload walked in C.

A payload is valid when it is exactly one datum of the schema its id names, by
the Avro specification's binary encoding: :meth:`AvroSchema.check` walks it with
the compiled checker (:mod:`._avro_check`, built from fastavro's parsed
schema), which builds no values and names the field that fails ("field amount:
expected double: the payload ends too early"). Avro binary carries no field
tags, so bytes left over mean the payload was written with another schema.
:meth:`AvroSchema.decode` checks the same way, then reads the values with
fastavro (for CEL rules); a logical type fastavro cannot convert (an
out-of-range date) is a payload error there. References are parsed first, as
named types the main schema may use by their full names.

Why a checker of our own: fastavro builds a dict of every record it reads,
about 5 us for a 10-field record, where the check needs none of it
(``bench/schema_registry.py`` measures both).

Logical types come back as fastavro gives them (``decimal.Decimal``,
``uuid.UUID``, ``datetime``); :func:`plain` turns them into what CEL rules read.
"""

from __future__ import annotations

import datetime
import decimal
import io
import json
import uuid
from typing import TYPE_CHECKING, Any

try:
    import fastavro
    from fastavro.schema import SchemaParseException, UnknownType
    from google.protobuf.timestamp_pb2 import Timestamp
except ModuleNotFoundError as exc:  # pragma: no cover - the extra is installed in CI
    raise ImportError("the schema_registry interceptor needs fastavro and protobuf: pip "
                      "install '.[schema-registry]' (from a kiproxy checkout)") from exc

from kiproxy.interceptors.builtin.schema_registry._avro_check import (
    AvroCheckError,
    Checker,
    Node,
)
from kiproxy.interceptors.builtin.schema_registry.formats import (
    PayloadError,
    SchemaCompileError,
    SchemaSource,
    walk_references,
)

if TYPE_CHECKING:
    from kiproxy.interceptors.api import Record

__all__ = ["AvroSchema", "compile_avro", "plain"]


def _type_name(schema: Any) -> str:
    if isinstance(schema, str):
        return schema
    if isinstance(schema, list):
        return "union of " + ", ".join(_type_name(s) for s in schema)
    if isinstance(schema, dict):
        logical = schema.get("logicalType")
        base = str(schema.get("name") or schema.get("type"))
        return f"{base} ({logical})" if logical else base
    return str(schema)


class AvroSchema:
    """One Avro schema id, parsed and compiled."""

    uses_message_indexes = False
    schema_type = "AVRO"

    def __init__(self, schema_id: int, parsed: Any, named: dict[str, Any]) -> None:
        self.schema_id = schema_id
        self._parsed = parsed
        self._named = named
        self._name = parsed.get("name") if isinstance(parsed, dict) else None
        self._checker = Checker(_node(parsed, named, {}, {}))

    def check(self, payload: bytes | memoryview, indexes: tuple[int, ...] = (),
              start: int = 0) -> None:
        """None when ``payload[start:]`` is one datum of the schema, else
        :class:`PayloadError`; no value is built."""
        try:
            self._checker.check(payload, start)
        except AvroCheckError as exc:
            raise PayloadError(self._explain(exc)) from None

    def check_run(self, records: tuple[Record, ...], begin: int, frame: bytes) -> int:
        """The index of the first record from ``begin`` on whose value is not ``frame``
        followed by one datum (the walk in C, no Python call per record)."""
        return self._checker.check_run(records, begin, frame)

    def decode(self, payload: memoryview, indexes: tuple[int, ...]) -> Any:
        """The decoded datum; :class:`PayloadError` naming the field that failed."""
        self.check(payload)
        try:
            return fastavro.schemaless_reader(io.BytesIO(payload), self._parsed, None)
        except Exception as exc:  # a logical type fastavro cannot convert
            raise PayloadError(f"does not decode as {self._what()}: {_cause(exc)}") from None

    def record_name(self, indexes: tuple[int, ...]) -> str:
        """The record's full name (``namespace.name``)."""
        if not isinstance(self._name, str):
            raise PayloadError(f"schema id {self.schema_id} is not a named Avro type, so "
                               "it has no record name for the subject strategy")
        return self._name

    def _what(self) -> str:
        return f"{self._name or _type_name(self._parsed)} (schema id {self.schema_id})"

    def _explain(self, exc: AvroCheckError) -> str:
        if exc.left_over:
            return (f"{exc.left_over} byte(s) left over after reading {self._what()}: the "
                    "payload was written with another schema")
        if not exc.path:
            return f"does not decode as {self._what()}: {exc.problem}"
        path = ""
        for part in exc.path:
            path += part if part.startswith("[") or not path else "." + part
        return f"field {path}: expected {exc.expected}: {exc.problem} ({self._what()})"


_PRIMITIVES = frozenset(("null", "boolean", "int", "long", "float", "double", "bytes",
                         "string"))


def _node(schema: Any, named: dict[str, Any], made: dict[str, Node],
          empty: dict[str, bool]) -> Node:
    """The checker's node for ``schema`` (named types built once, so they may recurse)."""
    if isinstance(schema, list):
        branches = tuple(_node(s, named, made, empty) for s in schema)
        node = Node("union", _type_name(schema))
        node.set(branches, size=len(branches))
        return node
    if isinstance(schema, str):
        if schema in _PRIMITIVES:
            node = Node(schema, schema)
            node.set(zero=schema == "null")
            return node
        if schema in made:
            return made[schema]
        if schema not in named:
            raise SchemaCompileError(f"unknown Avro type {schema!r}")
        return _node(named[schema], named, made, empty)
    kind = schema["type"]
    if not isinstance(kind, str):  # {"type": {"type": "array", ...}}
        return _node(kind, named, made, empty)
    desc = _type_name(schema)
    if kind in _PRIMITIVES:  # logical types are checked as the type they annotate
        return _node(kind, named, made, empty)
    node = Node("record" if kind == "error" else kind, desc)
    if "name" in schema:
        made[schema["name"]] = node
    if kind in ("record", "error"):
        fields = schema.get("fields", ())
        children = tuple(_node(f["type"], named, made, empty) for f in fields)
        node.set(children, tuple(f["name"] for f in fields),
                 zero=_empty(schema, named, frozenset(), empty))
    elif kind == "enum":
        node.set(size=len(schema["symbols"]))
    elif kind == "fixed":
        node.set(size=int(schema["size"]), zero=int(schema["size"]) == 0)
    elif kind == "array":
        node.set((_node(schema["items"], named, made, empty),))
    elif kind == "map":
        node.set((_node(schema["values"], named, made, empty),))
    else:
        raise SchemaCompileError(f"unknown Avro type {kind!r}")
    return node


def _empty(schema: Any, named: dict[str, Any], inside: frozenset[str],
           known: dict[str, bool]) -> bool:
    """True when every datum of ``schema`` is written in no bytes (null, records of such).
    ``known``: the named records decided so far (each is decided once, or a schema whose
    records name the next one twice would take time exponential in its depth)."""
    if isinstance(schema, str):
        if schema in _PRIMITIVES:
            return schema == "null"
        if schema in inside or schema not in named:  # a record within itself takes bytes
            return False
        return _empty(named[schema], named, inside, known)
    if not isinstance(schema, dict):
        return False  # a union writes its branch index
    kind = schema["type"]
    if kind in ("record", "error"):
        name = schema.get("name", "")
        if name in known:
            return known[name]
        decided = all(_empty(f["type"], named, inside | {name}, known)
                      for f in schema.get("fields", ()))
        if name:
            known[name] = decided
        return decided
    if kind == "fixed":
        return int(schema["size"]) == 0
    if isinstance(kind, str):
        return kind == "null"
    return _empty(kind, named, inside, known)


def _cause(exc: BaseException) -> str:
    if isinstance(exc, (EOFError, StopIteration)):
        return "the payload ends too early"
    return str(exc) or type(exc).__name__


def compile_avro(source: SchemaSource) -> AvroSchema:
    """Parse ``source`` (and its references, as named types) with fastavro."""
    named: dict[str, Any] = {}
    try:
        for _name, ref in walk_references(source):
            fastavro.parse_schema(json.loads(ref.schema), named_schemas=named)
        parsed = fastavro.parse_schema(json.loads(source.schema), named_schemas=named)
    except (json.JSONDecodeError, SchemaParseException, UnknownType, ValueError,
            TypeError, KeyError) as exc:
        raise SchemaCompileError(
            f"schema id {source.schema_id} is not an Avro schema fastavro can parse: "
            f"{type(exc).__name__}: {exc}") from None
    try:
        return AvroSchema(source.schema_id, parsed, named)
    except (KeyError, TypeError, ValueError) as exc:  # SchemaCompileError is a ValueError
        raise SchemaCompileError(f"schema id {source.schema_id} cannot be compiled for the "
                                 f"payload check: {type(exc).__name__}: {exc}") from None


def plain(value: Any) -> Any:
    """``value`` with Avro's logical-type objects as CEL reads them: a decimal as a float,
    a uuid, date or time as text, a timestamp as a ``google.protobuf.Timestamp`` (a CEL
    timestamp; a ``datetime`` inside a map is no CEL value), a local one read as UTC."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, datetime.datetime):
        stamp = Timestamp()
        stamp.FromDatetime(value if value.tzinfo else value.replace(tzinfo=datetime.UTC))
        return stamp
    if isinstance(value, datetime.date):
        return value.isoformat()
    if isinstance(value, datetime.time):
        return value.isoformat()
    return value
