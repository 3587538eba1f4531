"""Kafka request and response bodies through kio's schema-generated dataclasses.

Only the messages the proxy must read or rewrite are ever parsed (Produce,
ApiVersions, Metadata, FindCoordinator, DescribeCluster and the responses that
carry ``node_endpoints``); every other frame stays opaque bytes. Parsing
checks that the whole body was consumed, so re-serializing a parsed message
gives the same bytes.
"""

from __future__ import annotations

import dataclasses
import io
import struct
import types
from collections.abc import Callable
from functools import cache, lru_cache
from typing import Any, get_args, get_origin

from kiproxy.protocol.errors import MalformedMessage, UnsupportedVersion
from kiproxy.protocol.wire import read_uvarint

__all__ = [
    "API_NAMES",
    "ApiKey",
    "api_name",
    "kafka_error_codes",
    "parse_request",
    "parse_response",
    "request_type",
    "response_tagged_section",
    "response_tags",
    "response_type",
    "serialize",
]


@cache
def kafka_error_codes() -> frozenset[int]:
    """Every error code Kafka defines (0, NONE, included): what a response's
    ``error_code`` can carry."""
    from kio.schema.errors import ErrorCode as KioErrorCode

    return frozenset(int(code) for code in KioErrorCode)


class ApiKey:
    """API keys the proxy treats specially."""

    PRODUCE = 0
    FETCH = 1
    METADATA = 3
    FIND_COORDINATOR = 10
    SASL_HANDSHAKE = 17
    API_VERSIONS = 18
    SASL_AUTHENTICATE = 36
    DESCRIBE_CLUSTER = 60
    SHARE_FETCH = 78
    SHARE_ACKNOWLEDGE = 79


def _api_names() -> dict[int, str]:
    from kio.schema.index import api_key_map

    return {
        key: "".join(part.capitalize() for part in name.split("_"))
        for key, name in api_key_map.items()
    }


API_NAMES: dict[int, str] = _api_names()


def api_name(api_key: int) -> str:
    """Kafka's name for an API key (``Produce``, ``Metadata``, ...), or ``ApiKey(N)``."""
    return API_NAMES.get(api_key, f"ApiKey({api_key})")


@lru_cache(maxsize=1024)
def request_type(api_key: int, api_version: int) -> Any:
    """The kio dataclass of a request version; :class:`UnsupportedVersion` if unknown."""
    from kio.index import KioIndexError, load_request_schema

    try:
        return load_request_schema(api_key, api_version)
    except KioIndexError:
        raise UnsupportedVersion(
            f"{api_name(api_key)} request v{api_version} is not a known schema"
        ) from None


@lru_cache(maxsize=1024)
def response_type(api_key: int, api_version: int) -> Any:
    """The kio dataclass of a response version; :class:`UnsupportedVersion` if unknown."""
    from kio.index import KioIndexError, load_response_schema

    try:
        return load_response_schema(api_key, api_version)
    except KioIndexError:
        raise UnsupportedVersion(
            f"{api_name(api_key)} response v{api_version} is not a known schema"
        ) from None


@lru_cache(maxsize=1024)
def _reader(entity_type: Any) -> Any:
    from kio.serial import entity_reader

    return entity_reader(entity_type)


@lru_cache(maxsize=1024)
def _writer(entity_type: Any) -> Any:
    from kio.serial import entity_writer

    return entity_writer(entity_type)


# ------------------------------------------------------------ length pre-check
#
# kio's native reader sizes an array from its length prefix before reading the
# elements, and a Rust allocation failure aborts the whole process. So every
# length in a body is first checked against the bytes that remain, as Kafka's
# own generated parsers do ("Tried to allocate a collection of size N, but
# there are only M bytes remaining"), before kio sees the body.
#
# The same walk refuses a null (length -1, compact 0) in a field whose schema
# has no nullableVersions for this version, as Kafka's parsers do ("non-nullable
# field X was serialized as null"): kio's reader hands back None for a null
# array whatever the schema says, and code that trusts the type iterates it.
# kio's dataclasses carry the schema's nullability in their types: a field (or
# an array element) is nullable exactly when its type is ``X | None``.

_Skip = Callable[[bytes, int, int], int]
_FIXED_SIZES = {
    "int8": 1, "int16": 2, "int32": 4, "int64": 8, "uint8": 1, "uint16": 2, "uint32": 4,
    "uint64": 8, "float64": 8, "uuid": 16, "bool": 1, "error_code": 2, "timedelta_i32": 4,
    "timedelta_i64": 8, "datetime_i64": 8,
}
_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")


class _TooLong(Exception):
    """A length prefix that runs past the end of the body (internal to the pre-check)."""


class _NullInNonNullable(Exception):
    """A null in a field the schema says is not nullable (internal to the pre-check)."""


def _length(data: bytes, pos: int, end: int, flexible: bool, wide: bool) -> tuple[int, int]:
    """Read a length prefix (-1 = null); refuse one longer than the bytes left."""
    if flexible:
        if pos < end and data[pos] < 0x80:  # one-byte varint: the common case
            n, pos = data[pos] - 1, pos + 1
        else:
            n, pos = read_uvarint(data, pos, end, "length", _TooLong)
            n -= 1
    else:
        size = 4 if wide else 2
        if pos + size > end:
            raise _TooLong(f"length truncated at byte {pos}")
        n = (_I32 if wide else _I16).unpack_from(data, pos)[0]
        pos += size
    if n > end - pos:
        raise _TooLong(f"length {n} at byte {pos} runs past the {end - pos} bytes left")
    return n, pos


def _fixed(size: int) -> _Skip:
    def skip(data: bytes, pos: int, end: int) -> int:
        if pos + size > end:
            raise _TooLong(f"field truncated at byte {pos}")
        return pos + size
    return skip


def _not_null(n: int, start: int, name: str | None) -> None:
    """Refuse a null length when ``name`` (the field's) is set, i.e. it is not nullable."""
    if n == -1 and name is not None:
        raise _NullInNonNullable(f"non-nullable field {name} was serialized as null "
                                 f"(byte {start})")


def _sized(flexible: bool, wide: bool, non_nullable: str | None) -> _Skip:
    """Skip a string, bytes or records field; ``non_nullable`` names it unless nullable."""
    if flexible:
        def skip_compact(data: bytes, pos: int, end: int) -> int:
            if pos < end and data[pos] < 0x80:  # _length's common case, without the call
                n, after = data[pos] - 1, pos + 1
                if n > end - after:
                    raise _TooLong(f"length {n} at byte {after} runs past the "
                                   f"{end - after} bytes left")
            else:
                n, after = _length(data, pos, end, True, wide)
            if n < 0:
                _not_null(n, pos, non_nullable)
                return after
            return after + n
        return skip_compact

    def skip(data: bytes, pos: int, end: int) -> int:
        start = pos
        n, pos = _length(data, pos, end, flexible, wide)
        _not_null(n, start, non_nullable)
        return pos + max(n, 0)
    return skip


def _array(element: _Skip | int, flexible: bool, non_nullable: str | None) -> _Skip:
    """Skip an array field; ``non_nullable`` names it unless the schema lets it be null."""
    def count(data: bytes, pos: int, end: int) -> tuple[int, int]:
        n, after = _length(data, pos, end, flexible, True)
        _not_null(n, pos, non_nullable)
        return n, after

    if isinstance(element, int):
        size = element

        def skip_fixed(data: bytes, pos: int, end: int) -> int:
            n, pos = count(data, pos, end)
            if n > 0 and pos + n * size > end:
                raise _TooLong(f"array of {n} at byte {pos} runs past the body")
            return pos + max(n, 0) * size
        return skip_fixed

    def skip(data: bytes, pos: int, end: int) -> int:
        if flexible and pos < end and data[pos] < 0x80:  # count's common case, inline
            n, after = data[pos] - 1, pos + 1
            if n > end - after:
                raise _TooLong(f"length {n} at byte {after} runs past the "
                               f"{end - after} bytes left")
            if n < 0:
                _not_null(n, pos, non_nullable)
        else:
            n, after = count(data, pos, end)
        for _ in range(n):
            after = element(data, after, end)
        return after
    return skip


def _nullable_entity(entity: _Skip) -> _Skip:
    def skip(data: bytes, pos: int, end: int) -> int:
        if pos >= end:
            raise _TooLong(f"struct marker truncated at byte {pos}")
        return pos + 1 if data[pos] == 0xFF else entity(data, pos + 1, end)
    return skip


def _strip_none(field_type: Any) -> tuple[Any, bool]:
    """``(T, True)`` for ``T | None``, else ``(field_type, False)``."""
    if get_origin(field_type) is types.UnionType and type(None) in get_args(field_type):
        return next(a for a in get_args(field_type) if a is not type(None)), True
    return field_type, False


def _field_skipper(f: dataclasses.Field[Any], flexible: bool, tagged: bool,
                   owner: str) -> _Skip | int:
    """How to skip one field: a function, or the size of a fixed-size field."""
    field_type, nullable = _strip_none(f.type)
    # A nullable struct carries a marker byte; a tagged one is absent instead.
    optional = nullable and not tagged
    is_array = get_origin(field_type) is tuple
    inner: Any = get_args(field_type)[0] if is_array else field_type
    inner, inner_nullable = _strip_none(inner) if is_array else (inner, nullable)
    name = f"{owner}.{f.name}"
    skip: _Skip | int
    if isinstance(inner, type) and dataclasses.is_dataclass(inner):
        skip = _entity_skipper(inner)
        if optional and not is_array:
            skip = _nullable_entity(skip)
    else:
        kafka_type = f.metadata["kafka_type"]
        if kafka_type in _FIXED_SIZES:
            skip = _FIXED_SIZES[kafka_type]
        else:  # string, bytes, records
            element = f"an element of {name}" if is_array else name
            skip = _sized(flexible, wide=kafka_type != "string",
                          non_nullable=None if inner_nullable else element)
    if is_array:
        return _array(skip, flexible, non_nullable=None if nullable else name)
    return skip


@cache
def _entity_plan(entity_type: Any) -> tuple[bool, tuple[_Skip | int, ...], dict[int, _Skip]]:
    """``(flexible, skips of the plain fields in order, skips of the tagged fields by tag)``;
    a run of fixed-size plain fields is its size in bytes (:func:`_skip_plain`)."""
    flexible = bool(entity_type.__flexible__)
    owner = entity_type.__name__
    plain: list[_Skip | int] = []
    tagged: dict[int, _Skip] = {}
    fixed_run = 0  # consecutive fixed-size fields are skipped in one step
    for f in dataclasses.fields(entity_type):
        if "tag" in f.metadata:
            tag_skip = _field_skipper(f, flexible, tagged=True, owner=owner)
            tagged[int(f.metadata["tag"])] = (
                _fixed(tag_skip) if isinstance(tag_skip, int) else tag_skip)
            continue
        field_skip = _field_skipper(f, flexible, tagged=False, owner=owner)
        if isinstance(field_skip, int):
            fixed_run += field_skip
            continue
        if fixed_run:
            plain.append(fixed_run)
            fixed_run = 0
        plain.append(field_skip)
    if fixed_run:
        plain.append(fixed_run)
    return flexible, tuple(plain), tagged


def _skip_plain(data: bytes, pos: int, end: int, plain: tuple[_Skip | int, ...]) -> int:
    """Skip an entity's plain fields (a fixed-size run is stepped over without a call)."""
    for step in plain:
        if isinstance(step, int):
            if pos + step > end:
                raise _TooLong(f"field truncated at byte {pos}")
            pos += step
        else:
            pos = step(data, pos, end)
    return pos


def _skip_tagged(data: bytes, pos: int, end: int, tagged: dict[int, _Skip],
                 seen: list[int] | None = None) -> int:
    """Skip a tagged-field section (checking the fields the schema knows)."""
    if pos < end and data[pos] == 0:  # no tagged fields: the common case
        return pos + 1
    count, pos = read_uvarint(data, pos, end, "tagged field count", _TooLong)
    for _ in range(count):
        tag, pos = read_uvarint(data, pos, end, "tag", _TooLong)
        size, pos = read_uvarint(data, pos, end, "tagged field size", _TooLong)
        if size > end - pos:
            raise _TooLong(f"tagged field {tag} at byte {pos} runs past the body")
        if tag in tagged:
            tagged[tag](data, pos, pos + size)
        if seen is not None:
            seen.append(tag)
        pos += size
    return pos


@cache
def _entity_skipper(entity_type: Any) -> _Skip:
    flexible, plain, tagged = _entity_plan(entity_type)

    def skip(data: bytes, pos: int, end: int) -> int:
        for step in plain:  # _skip_plain, inline: this runs for every element of an array
            if isinstance(step, int):
                if pos + step > end:
                    raise _TooLong(f"field truncated at byte {pos}")
                pos += step
            else:
                pos = step(data, pos, end)
        if not flexible:
            return pos
        if pos < end and data[pos] == 0:  # no tagged fields: the common case, inline
            return pos + 1
        return _skip_tagged(data, pos, end, tagged)

    return skip


def response_tags(api_key: int, api_version: int, data: bytes, offset: int = 0) -> list[int]:
    """The tags of the top-level tagged fields of a response body, without building it.

    The body is checked as :func:`parse_response` checks it before reading (every
    length, array count and known tagged field within the body, nothing left over),
    so a caller that needs only to know whether a tagged field is present (KIP-951's
    ``node_endpoints``) can skip parsing the rest. Raises :class:`MalformedMessage`.
    """
    return response_tagged_section(api_key, api_version, data, offset)[0]


def response_tagged_section(api_key: int, api_version: int, data: bytes,
                            offset: int = 0) -> tuple[list[int], int]:
    """:func:`response_tags`, and where the top-level tagged-field section starts (its
    count; ``len(data)`` for a version without tagged fields)."""
    entity_type = response_type(api_key, api_version)
    flexible, plain, tagged = _entity_plan(entity_type)
    end = len(data)
    seen: list[int] = []
    try:
        pos = start = _skip_plain(data, offset, end, plain)
        if flexible:
            pos = _skip_tagged(data, pos, end, tagged, seen)
    except (_TooLong, _NullInNonNullable) as exc:
        raise MalformedMessage(
            f"{api_name(api_key)} response v{api_version} does not parse "
            f"(body at byte {offset}): {exc}") from None
    if pos != end:
        raise MalformedMessage(
            f"{api_name(api_key)} response v{api_version}: {end - pos} unread bytes after "
            f"the body (byte {pos})")
    return seen, start


def _parse(kind: str, entity_type: Any, api_key: int, api_version: int,
           data: bytes, offset: int) -> Any:
    try:
        _entity_skipper(entity_type)(data, offset, len(data))
    except (_TooLong, _NullInNonNullable) as exc:
        raise MalformedMessage(
            f"{api_name(api_key)} {kind} v{api_version} does not parse "
            f"(body at byte {offset}): {exc}"
        ) from None
    try:
        value, size = _reader(entity_type)(data, offset)
    except Exception as exc:  # kio raises struct/Value/Index errors for bad input
        raise MalformedMessage(
            f"{api_name(api_key)} {kind} v{api_version} does not parse "
            f"(body at byte {offset}): {type(exc).__name__}: {exc}"
        ) from None
    if offset + size != len(data):
        raise MalformedMessage(
            f"{api_name(api_key)} {kind} v{api_version}: {len(data) - offset - size} "
            f"unread bytes after the body (byte {offset + size})"
        )
    return value


def parse_request(api_key: int, api_version: int, data: bytes, offset: int = 0) -> Any:
    """Parse a request body that starts at ``data[offset]`` and runs to the end."""
    return _parse("request", request_type(api_key, api_version), api_key, api_version,
                  data, offset)


def parse_response(api_key: int, api_version: int, data: bytes, offset: int = 0) -> Any:
    """Parse a response body that starts at ``data[offset]`` and runs to the end."""
    return _parse("response", response_type(api_key, api_version), api_key, api_version,
                  data, offset)


def serialize(message: Any) -> bytes:
    """Serialize a kio request or response dataclass to its body bytes."""
    buf = io.BytesIO()
    entity_type: Any = type(message)
    _writer(entity_type)(buf, message)
    return buf.getvalue()
