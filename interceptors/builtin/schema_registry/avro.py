"""Avro payloads: the registry's schema parsed once by fastavro, each payload read in full.

A payload is valid when fastavro's ``schemaless_reader`` reads it with the
schema its id names *and* consumes every byte: Avro binary carries no field
tags, so bytes left over mean the payload was written with another schema.
References are parsed first, as named types the main schema may use by their
full names. When a payload fails, its top-level fields are read one by one to
name the first that does not decode ("field amount (double): ..."); only a
failing record pays for that.

Logical types come back as fastavro gives them (``decimal.Decimal``,
``uuid.UUID``, ``datetime``); :func:`plain` turns them into what CEL rules read.
"""

from __future__ import annotations

import datetime
import decimal
import io
import json
import uuid
from typing import Any

try:
    import fastavro
    from fastavro.schema import SchemaParseException, UnknownType
except ModuleNotFoundError as exc:  # pragma: no cover - the extra is installed in CI
    raise ImportError("the schema_registry interceptor needs fastavro: pip install "
                      "'kafka-interceptor-proxy[schema-registry]'") from exc

from kiproxy.interceptors.builtin.schema_registry.formats import (
    PayloadError,
    SchemaCompileError,
    SchemaSource,
    walk_references,
)

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
    """One Avro schema id, parsed."""

    uses_message_indexes = False
    schema_type = "AVRO"

    def __init__(self, schema_id: int, parsed: Any, named: dict[str, Any]) -> None:
        self.schema_id = schema_id
        self._parsed = parsed
        self._named = named
        self._name = parsed.get("name") if isinstance(parsed, dict) else None

    def decode(self, payload: memoryview, indexes: tuple[int, ...]) -> Any:
        """The decoded datum; :class:`PayloadError` naming the field that failed."""
        buf = io.BytesIO(payload)
        try:
            value = fastavro.schemaless_reader(buf, self._parsed, None)
        except Exception as exc:  # fastavro raises EOFError, ValueError, IndexError, ...
            raise PayloadError(self._diagnose(payload, exc)) from None
        left = len(payload) - buf.tell()
        if left:
            raise PayloadError(
                f"{left} byte(s) left over after reading {self._what()}: the payload was "
                "written with another schema")
        return value

    def record_name(self, indexes: tuple[int, ...]) -> str:
        """The record's full name (``namespace.name``)."""
        if not isinstance(self._name, str):
            raise PayloadError(f"schema id {self.schema_id} is not a named Avro type, so "
                               "it has no record name for the subject strategy")
        return self._name

    def _what(self) -> str:
        return f"{self._name or _type_name(self._parsed)} (schema id {self.schema_id})"

    def _diagnose(self, payload: memoryview, exc: Exception) -> str:
        cause = _cause(exc)
        if not (isinstance(self._parsed, dict) and self._parsed.get("type") == "record"):
            return f"does not decode as {self._what()}: {cause}"
        buf = io.BytesIO(payload)
        for field in self._parsed.get("fields", ()):
            try:
                schema = fastavro.parse_schema(field["type"], named_schemas=dict(self._named),
                                               _force=True)
                fastavro.schemaless_reader(buf, schema, None)
            except Exception as field_exc:
                return (f"field {field['name']}: expected {_type_name(field['type'])}: "
                        f"{_cause(field_exc)} ({self._what()})")
        return f"does not decode as {self._what()}: {cause}"


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
    return AvroSchema(source.schema_id, parsed, named)


def plain(value: Any) -> Any:
    """``value`` with Avro's logical-type objects as CEL reads them (float, str, int)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [plain(v) for v in value]
    if isinstance(value, decimal.Decimal):
        return float(value)
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, datetime.datetime):
        return value if value.tzinfo else value.replace(tzinfo=datetime.UTC)
    if isinstance(value, datetime.date):
        return value.isoformat()
    if isinstance(value, datetime.time):
        return value.isoformat()
    return value
