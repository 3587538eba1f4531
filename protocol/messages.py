"""Kafka request and response bodies through kio's schema-generated dataclasses.

Only the messages the proxy must read or rewrite are ever parsed (Produce,
ApiVersions, Metadata, FindCoordinator, DescribeCluster and the responses that
carry ``node_endpoints``); every other frame stays opaque bytes. Parsing
checks that the whole body was consumed, so re-serializing a parsed message
gives the same bytes.
"""

from __future__ import annotations

import io
from functools import lru_cache
from typing import Any

from protocol.errors import MalformedMessage, UnsupportedVersion

__all__ = [
    "API_NAMES",
    "ApiKey",
    "api_name",
    "parse_request",
    "parse_response",
    "request_type",
    "response_type",
    "serialize",
]


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


def _parse(kind: str, entity_type: Any, api_key: int, api_version: int,
           data: bytes, offset: int) -> Any:
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
