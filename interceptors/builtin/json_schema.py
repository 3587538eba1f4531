"""``JsonSchemaValidator`` (``json_schema``) - rejects values that are not JSON.

A batch is rejected (INVALID_RECORD by default) when any value is not JSON or
violates the JSON Schema of its topic; ``record_errors`` names each bad record
by its index in the batch. Topics without a schema only need well-formed JSON,
unless ``require_schema`` is set, in which case they pass untouched.

Config::

    interceptor:
      class: kiproxy.interceptors.builtin.json_schema:JsonSchemaValidator
      config:
        schemas:                       # topic -> schema (inline mapping or a file path)
          orders: {type: object, required: [id, amount]}
          payments: schemas/payment.json
        default_schema: null           # schema for other topics (optional)
        require_schema: false          # true: topics with no schema are not checked
        allow_null: true               # tombstones (null values) pass
        error: INVALID_RECORD          # or POLICY_VIOLATION

Values are parsed by msgspec (the standard ``json`` decides what msgspec refuses) and
schemas are checked by jsonschema-rs (compiled; the draft comes from ``$schema``,
2020-12 when absent). Each record is first only asked ``is_valid``; the errors are
collected for failing records alone. As with the Python ``jsonschema`` package
before it, ``format`` is an annotation, not an assertion, and no ``$ref`` is fetched
over the network: a schema whose ``$ref`` does not resolve fails at start. ``NaN``
and ``Infinity``, which Python's ``json`` reads but JSON does not have, are "not JSON",
as is a number beyond a double's range (``1e400``, which would be read as infinity)
and text that is not UTF-8 (UTF-16 or UTF-32, which ``json`` would detect and read) or
starts with a byte-order mark: JSON exchanged between systems is UTF-8 (RFC 8259,
section 8.1).

Simple schemas (an object of required and typed scalar properties, see
``_json_typed``) first get a typed look: msgspec decodes only the named fields and
skips the rest. A value it accepts is valid; anything else takes the path above,
which decides and writes the error, so verdicts and messages are the same either way.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Annotated, Any, NamedTuple

from pydantic import AfterValidator, BeforeValidator, Field

try:
    import jsonschema_rs
    import msgspec
except ModuleNotFoundError as exc:
    if exc.name not in ("jsonschema_rs", "msgspec"):
        raise
    raise ImportError(f"the json_schema interceptor needs {exc.name}: "
                      "pip install '.[jsonschema]' (from a kiproxy checkout)") from None

from kiproxy.interceptors import (
    InterceptContext,
    PluginSettings,
    ProduceRequestInterceptor,
    RecordBatch,
    RejectBatch,
    TopicPattern,
    TopicSelector,
)
from kiproxy.interceptors.builtin._json_typed import typed_check
from kiproxy.interceptors.settings import ErrorName

_MAX_REPORTED = 50


class _Schema(NamedTuple):
    """A topic's schema: the compiled validator and, for simple schemas, the typed check."""

    validator: jsonschema_rs.Validator | None
    accepts: Callable[[bytes], bool] | None


_ANY_JSON = _Schema(None, typed_check({}))


def _read_schema(value: Any) -> Any:
    """A schema file path read into its mapping; anything else as it is."""
    if isinstance(value, str):
        try:
            return json.loads(Path(value).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"cannot read schema file {value}: {exc}") from None
    if not isinstance(value, Mapping):
        raise ValueError("a schema must be a mapping or a file path")
    return value


def _compile(value: dict[str, Any]) -> jsonschema_rs.Validator:
    try:
        # format stays an annotation and $ref never goes to the network: what the
        # Python jsonschema package, used before, did by default.
        return jsonschema_rs.validator_for(value, validate_formats=False, offline=True)
    except jsonschema_rs.ValidationError as exc:  # the schema breaks its meta-schema
        at = f" (at {_path(exc.instance_path)})" if exc.instance_path else ""
        raise ValueError(f"invalid JSON Schema{at}: {exc.message}") from None
    except jsonschema_rs.ReferencingError as exc:
        raise ValueError(f"invalid JSON Schema: {exc}") from None


def _valid_schema(value: dict[str, Any]) -> dict[str, Any]:
    _compile(value)
    return value


Schema = Annotated[dict[str, Any], BeforeValidator(_read_schema), AfterValidator(_valid_schema)]
"""A JSON Schema: inline, or the path of a file holding it (read at load)."""


class JsonSchemaSettings(PluginSettings):
    """Settings of ``json_schema``."""

    schemas: dict[str, Schema] = Field(default_factory=dict)
    """Topic -> its JSON Schema: a mapping, or the path of a JSON file."""
    default_schema: Schema | None = None
    """The schema of other topics; without one they only need to be JSON."""
    require_schema: bool = False
    """Topics without a schema are not checked at all (not even for JSON)."""
    allow_null: bool = True
    """Tombstones (null values) pass."""
    error: ErrorName = "INVALID_RECORD"
    """The error code of a rejection."""


def _load_schema(value: Any, where: str = "") -> _Schema:
    """A topic's schema (a mapping, or a file path) compiled; ``where`` begins an error."""
    try:
        schema = _read_schema(value)
        return _Schema(_compile(schema), typed_check(schema))
    except ValueError as exc:
        raise ValueError(f"{where}: {exc}" if where else str(exc)) from None


def _path(parts: list[str | int]) -> str:
    return "/".join(str(p) for p in parts) or "(root)"


def _not_json(constant: str) -> None:
    raise ValueError(f"{constant} is not a JSON value")


def _finite(text: str) -> float:
    number = float(text)
    if math.isinf(number):
        raise ValueError(f"{text} is beyond a double's range")
    return number


# NaN and Infinity are no JSON values though Python's json reads them (jsonschema-rs
# would see them as null), nor is a number that only overflows to infinity. One decoder
# for all: json.loads(..., parse_constant=) would build a new one per record.
_DECODER = json.JSONDecoder(parse_constant=_not_json, parse_float=_finite)
_BOM = b"\xef\xbb\xbf"
_FAST = msgspec.json.Decoder()


def _parse(value: bytes) -> Any:
    """``value`` read as UTF-8 JSON text: ``json.loads`` of it decoded as UTF-8, without
    NaN, Infinity or a number beyond a double's range; ValueError for anything else.

    msgspec reads strict UTF-8 JSON several times faster than ``json``, to the same
    values (integers of any size stay exact), and refuses NaN and Infinity as well; what
    it refuses besides (a lone surrogate escape, a number too large for a float, text
    that is not UTF-8) goes to ``json``, which decides, so a value's verdict is the one
    ``json`` gives to the same UTF-8 text.
    """
    try:
        return _FAST.decode(value)
    except ValueError:  # msgspec.DecodeError, or UnicodeDecodeError from a string's bytes
        pass
    if value.startswith(_BOM):
        raise ValueError("it starts with a byte-order mark, which JSON text does not have "
                         "(RFC 8259)")
    try:
        text = value.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 ({exc.reason} at byte {exc.start}); JSON between "
                         "systems is UTF-8 (RFC 8259), not UTF-16 or UTF-32") from None
    return _DECODER.decode(text)


class JsonSchemaValidator(ProduceRequestInterceptor[JsonSchemaSettings]):
    """Rejects batches with values that are not JSON or break the topic's JSON Schema."""

    def __init__(self) -> None:
        self.schemas: TopicSelector[_Schema] = TopicSelector.of_names({})
        self.require_schema = False
        self.allow_null = True
        self.error = "INVALID_RECORD"

    def configure(self, config: JsonSchemaSettings) -> None:
        """Take the validated settings and compile every schema."""
        default = _ANY_JSON if config.default_schema is None \
            else _load_schema(config.default_schema)
        self.schemas = TopicSelector(
            ((TopicPattern.name(t), _load_schema(s)) for t, s in config.schemas.items()),
            default)
        self.require_schema = config.require_schema
        self.allow_null = config.allow_null
        self.error = config.error

    @property
    def default(self) -> _Schema:
        """The schema of topics without one of their own."""
        return self.schemas.default or _ANY_JSON

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Return the batch unchanged, or raise RejectBatch listing the bad records."""
        schema = self.schemas.select(batch.topic) or _ANY_JSON
        if schema.validator is None and self.require_schema:
            return batch
        errors: list[tuple[int, str]] = []
        for i, record in enumerate(batch.records):
            problem = self._check(record.value, schema)
            if problem is not None:
                errors.append((i, problem))
                if len(errors) >= _MAX_REPORTED:
                    break
        if errors:
            first_index, first = errors[0]
            raise RejectBatch(
                f"{len(errors)} record(s) of {batch.topic}[{batch.partition}] failed JSON "
                f"validation; first, record {first_index}: {first}",
                self.error, errors,
            )
        return batch

    def _check(self, value: bytes | None, schema: _Schema) -> str | None:
        if value is None:
            return None if self.allow_null else "null value"
        if schema.accepts is not None and schema.accepts(value):
            return None
        validator = schema.validator
        try:
            doc = _parse(value)
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
            return f"not JSON: {exc}"
        if validator is None:
            return None
        try:
            if validator.is_valid(doc):
                return None
            # Only a failing record pays for the error objects.
            errors = list(validator.iter_errors(doc))
        except ValueError as exc:  # a string with a lone surrogate (\ud800) is not UTF-8
            return f"not JSON: {exc}"
        if not errors:
            return "schema violation"
        # The error nearest the root, as jsonschema's best_match preferred.
        error = min(errors, key=lambda e: len(e.instance_path))
        more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
        return f"schema violation at {_path(error.instance_path)}: {error.message}{more}"
