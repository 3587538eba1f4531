"""A registered schema, compiled once: the payload check and the record name.

Contract: ``compile_schema`` (in :mod:`.contract`) turns what the registry returned for an id
(its type, text and resolved references) into a :class:`CompiledSchema`, or
raises :class:`SchemaCompileError` naming the id and why. A compiled schema
answers, for one payload:

* :meth:`CompiledSchema.check` - None, or :class:`PayloadError`: the verdict
  alone, which Avro reaches without building values;
* :meth:`CompiledSchema.decode` - the decoded value as Python data (dicts,
  lists, str, bytes, int, float, bool, None), or :class:`PayloadError` with the
  cause in a producer developer's words ("field amount (double): ...");
* :meth:`CompiledSchema.record_name` - the fully qualified record name the
  RecordName / TopicRecordName subject strategies use (Avro: the record's full
  name; Protobuf: the message the indexes choose; JSON Schema: its ``title``).

The shapes this module reads (:class:`SchemaSource`, :class:`ReferenceSource`)
are protocols that the registry client's ``RegisteredSchema`` and
``SchemaReference`` satisfy, and what the contract check asks of the registry
(:class:`SchemaLookup`, :class:`GlobalIdLookup`) protocols its client and
``apicurio_ids.GlobalIds`` satisfy; nothing here does I/O.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from kiproxy.interceptors.api import Record

__all__ = [
    "CompiledSchema",
    "PayloadError",
    "ReferenceSource",
    "SchemaCompileError",
    "SchemaSource",
    "check_each",
    "walk_references",
]


class ReferenceSource(Protocol):
    """A schema reference, resolved (the registry client's ``SchemaReference``)."""

    @property
    def name(self) -> str:
        """The import path (Protobuf), full name (Avro) or ``$ref`` (JSON) it is used by."""
    @property
    def subject(self) -> str:
        """The subject it is registered under."""
    @property
    def version(self) -> int:
        """Its version under that subject."""
    @property
    def schema(self) -> SchemaSource:
        """The referenced schema itself."""


class SchemaSource(Protocol):
    """A registered schema (the registry client's ``RegisteredSchema``)."""

    @property
    def schema_id(self) -> int:
        """The id producers put in the frame."""
    @property
    def schema_type(self) -> str:
        """AVRO, PROTOBUF or JSON."""
    @property
    def schema(self) -> str:
        """The schema text as the registry returns it."""
    @property
    def references(self) -> Sequence[ReferenceSource]:
        """The schemas it references, resolved recursively."""


class SchemaCompileError(ValueError):
    """The registry's schema (or one it references) cannot be compiled here."""


class PayloadError(ValueError):
    """A payload does not decode with the schema its id names."""


class CompiledSchema(Protocol):
    """A schema ready to check payloads; built once per id and cached."""

    schema_id: int
    schema_type: str
    uses_message_indexes: bool
    """True for Protobuf: the frame carries message indexes after the id."""

    def check(self, payload: bytes | memoryview, indexes: tuple[int, ...] = (),
              start: int = 0) -> None:
        """None when ``payload[start:]`` decodes (as :meth:`decode` would), else
        :class:`PayloadError`."""

    def check_run(self, records: tuple[Record, ...], begin: int, frame: bytes) -> int:
        """The index of the first record from ``begin`` on whose value is not ``frame``
        followed by a payload that checks; ``len(records)`` when there is none."""

    def decode(self, payload: memoryview, indexes: tuple[int, ...]) -> Any:
        """The decoded payload, or :class:`PayloadError`."""

    def record_name(self, indexes: tuple[int, ...]) -> str:
        """The fully qualified record name, or :class:`PayloadError` when there is none."""


class SchemaLookup(Protocol):
    """What the check asks of the registry client."""

    async def schema_by_id(self, schema_id: int, *, fresh: bool = False) -> Any:
        """The registered schema (a :class:`~.formats.SchemaSource`); ``fresh``: asked of
        the registry now, and not kept by the client."""
    async def subjects_of(self, schema_id: int, *,
                          fresh: bool = False) -> tuple[tuple[str, int], ...]:
        """``(subject, version)`` pairs the id is registered under (``fresh``: not cached)."""
    async def latest_id(self, subject: str, *, fresh: bool = False) -> int:
        """The id of the subject's latest version (``fresh``: not cached)."""


class GlobalIdLookup(Protocol):
    """What the check asks of Apicurio's native API (a :class:`~.apicurio_ids.GlobalIds`)."""

    async def registry_id(self, global_id: int) -> int:
        """The Confluent-compatible API's id of the version an Apicurio globalId names."""


def check_each(schema: CompiledSchema, records: tuple[Record, ...], begin: int,
               frame: bytes) -> int:
    """:meth:`CompiledSchema.check_run` one :meth:`~CompiledSchema.check` at a time."""
    for index in range(begin, len(records)):
        value = records[index].value
        if value is None or value[:len(frame)] != frame:
            return index
        try:
            schema.check(value, (), len(frame))
        except PayloadError:
            return index
    return len(records)


def walk_references(schema: SchemaSource) -> list[tuple[str, SchemaSource]]:
    """Every referenced schema, depth first (dependencies before their users), once each."""
    seen: set[tuple[str, int]] = set()
    ordered: list[tuple[str, SchemaSource]] = []

    def visit(node: SchemaSource, depth: int) -> None:
        if depth > 32:
            raise SchemaCompileError(f"schema id {schema.schema_id}: references nest deeper "
                                     "than 32 levels")
        for ref in node.references:
            key = (ref.subject, ref.version)
            if key in seen:
                continue
            seen.add(key)
            visit(ref.schema, depth + 1)
            ordered.append((ref.name, ref.schema))

    visit(schema, 0)
    return ordered
