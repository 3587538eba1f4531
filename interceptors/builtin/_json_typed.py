"""A typed first look at JSON values for the JSON Schema validator.

Contract: :func:`typed_check` turns a JSON Schema into a function ``accepts(value)``,
or ``None`` when the schema uses anything outside the subset below. ``accepts``
returning ``True`` means the value is JSON and the schema holds for it: the verdict
the full path (parse, then jsonschema-rs) gives. ``False`` decides nothing; the caller
takes the full path, which also writes the error. So the check may refuse more than
the schema does, never less, and a property test holds it to that.

The subset is what most topic schemas are: an object with ``required`` names and
``properties`` of ``type`` string (``minLength``, ``maxLength``), integer
(``minimum``, ``maximum``, integral bounds), number, boolean or null, or no type at
all; annotations (``title``, ``description``, ``format``...) anywhere. ``{}``, the
empty schema, is "any JSON". Such a schema becomes a msgspec Struct, whose decoder
builds only the named fields and skips the rest of the object without creating
Python objects for it: a 1 KiB value of 40 fields is checked in about a quarter of
the time of parsing it whole. What msgspec's skipping lets through, the check adds
back: the value must be UTF-8 (skipped strings are not decoded), hold no integer
longer than Python's digit limit and no number that may be beyond a double's range (a
three-digit exponent, or 200 digits in a row: skipped numbers are not converted), and
anything msgspec refuses (a float where an integer is asked for, 1.0 included) goes
the full way. Bounds must fit in 64 bits.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from typing import Annotated, Any

import msgspec

from kiproxy.interceptors.json_numbers import json_number_may_overflow

__all__ = ["typed_check"]

_ANNOTATIONS = frozenset({
    "$schema", "$id", "$comment", "title", "description", "examples", "default",
    "format", "deprecated", "readOnly", "writeOnly",
})
_SCALARS: dict[str, Any] = {"string": str, "integer": int, "number": float,
                            "boolean": bool, "null": type(None)}
_BOUNDED = {"minimum": "integer", "maximum": "integer", "minLength": "string",
            "maxLength": "string"}


_INT64 = range(-(2**63), 2**63)  # the bounds msgspec's constraints take


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value in _INT64


def _property_type(schema: Any) -> Any:
    """The msgspec type of one property's schema, or ``None`` when outside the subset."""
    if not isinstance(schema, Mapping):
        return None
    keys = set(schema) - _ANNOTATIONS
    if not keys:
        return msgspec.Raw  # any JSON value
    kind = schema.get("type")
    if not isinstance(kind, str) or kind not in _SCALARS:
        return None
    bounds: dict[str, int] = {}
    for key in keys - {"type"}:
        bound = schema[key]
        if _BOUNDED.get(key) != kind or not _is_int(bound):
            return None
        if key.endswith("Length") and bound < 0:
            return None
        bounds[key] = bound
    base = _SCALARS[kind]
    if not bounds:
        return base
    if kind == "integer":
        meta = msgspec.Meta(ge=bounds.get("minimum"), le=bounds.get("maximum"))
    else:
        meta = msgspec.Meta(min_length=bounds.get("minLength"), max_length=bounds.get("maxLength"))
    return Annotated[base, meta]


def _root_type(schema: Mapping[str, Any]) -> Any:
    keys = set(schema) - _ANNOTATIONS
    if not keys:
        return msgspec.Raw
    if keys - {"type", "properties", "required"} or schema.get("type", "object") != "object":
        return None
    properties = schema.get("properties", {})
    required = schema.get("required", [])
    if (not isinstance(properties, Mapping) or not isinstance(required, list)
            or not all(isinstance(name, str) for name in required)
            or len(set(required)) != len(required)):
        return None
    fields: list[tuple[str, Any] | tuple[str, Any, Any]] = []
    rename: dict[str, str] = {}
    for name in dict.fromkeys([*required, *properties]):
        kind = _property_type(properties.get(name, {}))
        if kind is None:
            return None
        attr = f"f{len(fields)}"  # JSON names need not be Python identifiers
        rename[attr] = name
        fields.append((attr, kind) if name in required else (attr, kind, msgspec.UNSET))
    return msgspec.defstruct("Value", fields, rename=rename, kw_only=True)


_maybe_huge = json_number_may_overflow
"""Whether a skipped field may hold a number beyond a double's range (1e400): an
exponent of 100 or more, or 200 digits in a row (with an exponent under 100,
overflowing takes 210 digits; also in a string, where the full way decides). Compiled:
the regular expression it stands for read a value byte by byte (3 us for 1 KiB with a
pre-scan, 28 us without), the cost of the whole typed check."""


def typed_check(schema: Mapping[str, Any]) -> Callable[[bytes], bool] | None:
    """``accepts(value)`` for a schema in the subset (see the module docstring), else ``None``."""
    kind = _root_type(schema)
    if kind is None:
        return None
    decode = msgspec.json.Decoder(kind).decode
    # msgspec skips an integer of any length; Python's json refuses one longer than
    # the interpreter's digit limit (4,300 by default), and that makes it "not JSON".
    limit = sys.get_int_max_str_digits()
    too_long = re.compile(rb"[0-9]{%d}" % (limit + 1)).search if limit else None

    def accepts(value: bytes) -> bool:
        if too_long is not None and len(value) > limit and too_long(value):
            return False
        if _maybe_huge(value):  # the full way decides whether it overflows
            return False
        if not value.isascii():
            try:
                value.decode()
            except UnicodeDecodeError:
                return False
        try:
            decode(value)
        except (msgspec.DecodeError, RecursionError):
            return False
        return True

    return accepts
