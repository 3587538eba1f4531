"""``interceptors.builtin.json_schema:JsonSchemaValidator`` - rejects values that are not JSON.

A batch is rejected (INVALID_RECORD by default) when any value is not JSON or
violates the JSON Schema of its topic; ``record_errors`` names each bad record
by its index in the batch. Topics without a schema only need well-formed JSON,
unless ``require_schema`` is set, in which case they pass untouched.

Config::

    interceptor:
      class: interceptors.builtin.json_schema:JsonSchemaValidator
      config:
        schemas:                       # topic -> schema (inline mapping or a file path)
          orders: {type: object, required: [id, amount]}
          payments: schemas/payment.json
        default_schema: null           # schema for other topics (optional)
        require_schema: false          # true: topics with no schema are not checked
        allow_null: true               # tombstones (null values) pass
        error: INVALID_RECORD          # or POLICY_VIOLATION
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import jsonschema

from interceptors import InterceptContext, ProduceRequestInterceptor, RecordBatch, RejectBatch

_MAX_REPORTED = 50


def _load_schema(value: Any, where: str) -> Any:
    if isinstance(value, str):
        try:
            value = json.loads(Path(value).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ValueError(f"{where}: cannot read schema file {value}: {exc}") from None
    if not isinstance(value, Mapping):
        raise ValueError(f"{where}: a schema must be a mapping or a file path")
    try:
        validator_cls = jsonschema.validators.validator_for(value)
        validator_cls.check_schema(dict(value))
    except jsonschema.SchemaError as exc:
        raise ValueError(f"{where}: invalid JSON Schema: {exc.message}") from None
    return validator_cls(value)


class JsonSchemaValidator(ProduceRequestInterceptor):
    """Rejects batches with values that are not JSON or break the topic's JSON Schema."""

    def __init__(self) -> None:
        self.validators: dict[str, Any] = {}
        self.default: Any = None
        self.require_schema = False
        self.allow_null = True
        self.error = "INVALID_RECORD"

    def configure(self, config: Mapping[str, Any]) -> None:
        """Read ``schemas``, ``default_schema``, ``require_schema``, ``allow_null``, ``error``."""
        schemas = config.get("schemas", {}) or {}
        if not isinstance(schemas, Mapping):
            raise ValueError("schemas must be a mapping of topic to schema")
        self.validators = {str(t): _load_schema(s, f"schemas.{t}") for t, s in schemas.items()}
        if config.get("default_schema") is not None:
            self.default = _load_schema(config["default_schema"], "default_schema")
        self.require_schema = bool(config.get("require_schema", False))
        self.allow_null = bool(config.get("allow_null", True))
        self.error = str(config.get("error", "INVALID_RECORD"))
        RejectBatch("check", self.error)  # fail at start on an unknown error name

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Return the batch unchanged, or raise RejectBatch listing the bad records."""
        validator = self.validators.get(batch.topic, self.default)
        if validator is None and self.require_schema:
            return batch
        errors: list[tuple[int, str]] = []
        for i, record in enumerate(batch.records):
            problem = self._check(record.value, validator)
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

    def _check(self, value: bytes | None, validator: Any) -> str | None:
        if value is None:
            return None if self.allow_null else "null value"
        try:
            doc = json.loads(value)
        except (ValueError, UnicodeDecodeError) as exc:
            return f"not JSON: {exc}"
        if validator is None:
            return None
        error = jsonschema.exceptions.best_match(validator.iter_errors(doc))
        if error is None:
            return None
        path = "/".join(str(p) for p in error.absolute_path) or "(root)"
        return f"schema violation at {path}: {error.message}"
