"""The ApiVersions answer: cut to what the proxy can carry.

The broker's ApiVersions response is passed on with every API key the proxy
does not know removed and every max version capped at the newest schema the
proxy ships, so a client never speaks a version the proxy cannot parse. Produce
keeps the broker's advertised minimum (Kafka 4 still advertises 0 because
librdkafka's feature detection needs it, KAFKA-18659); the proxy answers
v0-v2 requests itself with an error instead of forwarding the old format.
An API whose responses the proxy rewrites also loses the versions below its
oldest schema that would name broker addresses (ShareFetch and
ShareAcknowledge v0, which brokers with KIP-932's early access advertise and
the shipped schemas no longer have): the proxy refuses those requests, so it
must not offer them.

The answer is always passed on in Kafka's own encoding, which leaves out a
tagged field that holds its default value. Some brokers (Tansu) write every
tagged field of ApiVersions v3+ (``SupportedFeatures`` empty,
``FinalizedFeaturesEpoch`` -1, ...); librdkafka before 2.2.0 skips tagged
fields one byte short (librdkafka #4278) and fails such an answer with "Read
underflow". Leaving the defaults out says exactly the same thing to every
client, and lets those librdkafka versions (Debian 12's kcat 1.7.1 with
librdkafka 2.0.2) connect.
"""

from __future__ import annotations

import dataclasses
from functools import cache
from typing import Any

from kiproxy.protocol.errors import ProtocolError
from kiproxy.protocol.framing import encode_response_header, parse_response_header
from kiproxy.protocol.messages import ApiKey, parse_response, response_type, serialize
from kiproxy.proxy.brokers.addresses import needs_rewrite

__all__ = [
    "PRODUCE_MAX_VERSION",
    "cut_api_versions_frame",
    "known_version_range",
    "unsupported_api_versions_response",
]

PRODUCE_MAX_VERSION = 13
"""Newest Produce version the record-batch codec and pipeline handle."""

_UNSUPPORTED_VERSION = 35


@cache
def known_version_range(api_key: int) -> tuple[int, int] | None:
    """``(min, max)`` of the schemas shipped for an API key, or ``None`` if unknown."""
    from kio.schema.index import api_key_map, schema_name_map

    name = api_key_map.get(api_key)
    if name is None:
        return None
    versions = sorted(schema_name_map[name])
    return versions[0], versions[-1]


def _cut(entries: tuple[Any, ...], produce_max: int,
         fetch_range: tuple[int, int] | None = None) -> tuple[Any, ...]:
    out = []
    for entry in entries:
        known = known_version_range(entry.api_key)
        if known is None:
            continue
        min_version = entry.min_version
        max_version = min(entry.max_version, known[1])
        if entry.api_key == ApiKey.PRODUCE:
            max_version = min(max_version, produce_max)
        elif entry.api_key == ApiKey.FETCH and fetch_range is not None:
            min_version = max(min_version, fetch_range[0])
            max_version = min(max_version, fetch_range[1])
        elif min_version < known[0] and needs_rewrite(entry.api_key, known[0] - 1):
            # Older than every schema, yet its answer names brokers: unreadable, so
            # unrewritable (Produce v0-v2 are older too but name no brokers).
            min_version = known[0]
        if max_version < min_version:
            continue
        out.append(dataclasses.replace(entry, min_version=min_version,
                                       max_version=max_version))
    return tuple(out)


def cut_api_versions_frame(api_version: int, frame: bytes,
                           produce_max: int = PRODUCE_MAX_VERSION,
                           fetch_range: tuple[int, int] | None = None) -> bytes:
    """Rewrite an ApiVersions response frame (header v0) to what the proxy can carry.

    ``produce_max`` caps the Produce version offered (v12 when several worker
    processes share the listeners: v13 names topics by id, and a worker can only
    resolve ids it saw in a Metadata response of its own). ``fetch_range``, given
    when a fetch-side hook is configured, bounds the Fetch versions offered to those
    whose responses the proxy decodes.

    A broker that did not know the requested version answers in v0 format; that
    answer is recognised and cut the same way.
    """
    _, body_offset = parse_response_header(frame, 0)
    known = known_version_range(ApiKey.API_VERSIONS)
    version = api_version if known and api_version <= known[1] else 0
    try:
        message = parse_response(ApiKey.API_VERSIONS, version, frame, body_offset)
    except ProtocolError:
        if version == 0:
            raise
        version = 0
        message = parse_response(ApiKey.API_VERSIONS, 0, frame, body_offset)
    cut = dataclasses.replace(message, api_keys=_cut(message.api_keys, produce_max,
                                                     fetch_range))
    body = serialize(cut)
    if cut == message and body == frame[body_offset:]:
        return frame
    return frame[:body_offset] + body


def unsupported_api_versions_response(correlation_id: int) -> bytes:
    """A v0 ApiVersions answer with UNSUPPORTED_VERSION, naming the versions the proxy reads.

    Sent when a client asks with a newer ApiVersions version than the proxy's
    schemas; the client then retries with one it is offered.
    """
    from kio.schema.errors import ErrorCode

    known = known_version_range(ApiKey.API_VERSIONS)
    assert known is not None
    response_cls = response_type(ApiKey.API_VERSIONS, 0)
    entry_type = _nested_type(response_cls, "api_keys")
    message = response_cls(
        error_code=ErrorCode(_UNSUPPORTED_VERSION),
        api_keys=(entry_type(api_key=ApiKey.API_VERSIONS, min_version=known[0],
                             max_version=known[1]),),
    )
    return encode_response_header(correlation_id, 0) + serialize(message)


def _nested_type(cls: Any, field_name: str) -> Any:
    import typing

    hints = typing.get_type_hints(cls)
    return typing.get_args(hints[field_name])[0]
