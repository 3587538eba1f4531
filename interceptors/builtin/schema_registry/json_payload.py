"""JSON Schema payloads: the registry's schema compiled by jsonschema-rs, as ``json_schema`` does.

The payload (after the frame) is parsed as JSON the way the ``json_schema``
built-in parses values (msgspec, no NaN or Infinity) and checked by a
jsonschema-rs validator compiled once per id: the draft comes from ``$schema``
(2020-12 when absent), ``format`` is an annotation, and references resolve only
to the schemas the registry returned with it (each under its reference name),
never over the network. The error nearest the root is the one reported.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

try:
    import jsonschema_rs
except ModuleNotFoundError as exc:  # pragma: no cover - the extra is installed in CI
    raise ImportError("the schema_registry interceptor needs jsonschema-rs: pip install "
                      "'.[schema-registry]' (from a kiproxy checkout)") from exc

from kiproxy.interceptors.builtin.json_schema import _parse
from kiproxy.interceptors.builtin.schema_registry.formats import (
    PayloadError,
    SchemaCompileError,
    SchemaSource,
    check_each,
    walk_references,
)

if TYPE_CHECKING:
    from kiproxy.interceptors.api import Record

__all__ = ["JsonSchema", "compile_json", "parse_json"]

_BASE = "https://schema-registry.invalid/"  # references resolve against this; never fetched


def parse_json(payload: bytes | memoryview) -> Any:
    """``payload`` as JSON, or :class:`PayloadError` (``not JSON: ...``)."""
    try:
        return _parse(bytes(payload))
    except (ValueError, RecursionError) as exc:
        raise PayloadError(f"not JSON: {exc}") from None


class JsonSchema:
    """One JSON Schema id, compiled."""

    uses_message_indexes = False
    schema_type = "JSON"

    def __init__(self, schema_id: int, validator: Any, title: str | None) -> None:
        self.schema_id = schema_id
        self._validator = validator
        self._title = title

    def check(self, payload: bytes | memoryview, indexes: tuple[int, ...] = (),
              start: int = 0) -> None:
        """:meth:`decode`'s verdict, the value dropped."""
        self.decode(memoryview(payload)[start:], indexes)

    def check_run(self, records: tuple[Record, ...], begin: int, frame: bytes) -> int:
        """Records from ``begin`` on checked one at a time (:func:`.formats.check_each`)."""
        return check_each(self, records, begin, frame)

    def decode(self, payload: memoryview, indexes: tuple[int, ...]) -> Any:
        """The parsed document; :class:`PayloadError` when it is no JSON or breaks the schema."""
        doc = parse_json(payload)
        try:
            if self._validator.is_valid(doc):
                return doc
            errors = list(self._validator.iter_errors(doc))
        except ValueError as exc:
            raise PayloadError(f"not JSON: {exc}") from None
        if not errors:
            raise PayloadError(f"breaks schema id {self.schema_id}")
        error = min(errors, key=lambda e: len(e.instance_path))
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        field = "/".join(str(p) for p in error.instance_path)
        at = f"field {field}: " if field else ""
        raise PayloadError(f"{at}{error.message}{more} (schema id {self.schema_id})")

    def record_name(self, indexes: tuple[int, ...]) -> str:
        """The schema's ``title``, which Confluent's JSON serializers use as the record name."""
        if not self._title:
            raise PayloadError(f"schema id {self.schema_id} has no title, so it has no record "
                               "name for the subject strategy")
        return self._title


def compile_json(source: SchemaSource) -> JsonSchema:
    """Compile ``source`` with its references as an offline jsonschema-rs registry."""
    where = f"schema id {source.schema_id}"
    try:
        schema = json.loads(source.schema)
        resources = [(name if "://" in name else _BASE + name, json.loads(ref.schema))
                     for name, ref in walk_references(source)]
        options: dict[str, Any] = {"validate_formats": False, "offline": True}
        if resources:
            options["registry"] = jsonschema_rs.Registry(resources)
            options["base_uri"] = _BASE + f"{source.schema_id}.json"
        validator = jsonschema_rs.validator_for(schema, **options)
    except json.JSONDecodeError as exc:
        raise SchemaCompileError(f"{where} is not JSON: {exc}") from None
    except (jsonschema_rs.ValidationError, jsonschema_rs.ReferencingError, ValueError) as exc:
        raise SchemaCompileError(f"{where} is not a usable JSON Schema: {exc}") from None
    title = schema.get("title") if isinstance(schema, dict) else None
    return JsonSchema(source.schema_id, validator, title if isinstance(title, str) else None)
