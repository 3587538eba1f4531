"""Rewriting the responses that name broker addresses, so clients never leave the proxy.

Metadata brokers, FindCoordinator (v0-v3 one node, v4+ a coordinators list),
DescribeCluster brokers, and the KIP-951 ``node_endpoints`` of Produce v10+,
Fetch v16+, ShareFetch and ShareAcknowledge responses all name ``host:port``
pairs; each is replaced with the proxy's advertised host and the port of the
listener that stands for that node. Every rewrite also reports the real
address, which is how the proxy learns where each node lives.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from functools import lru_cache
from typing import Any

from kiproxy.protocol.errors import UnsupportedVersion
from kiproxy.protocol.framing import parse_response_header, response_header_version
from kiproxy.protocol.messages import (
    ApiKey,
    api_name,
    parse_response,
    response_tagged_section,
    response_type,
    serialize,
)

__all__ = [
    "REWRITTEN_APIS",
    "NodeAddress",
    "needs_rewrite",
    "rewritable",
    "rewrite_message",
    "rewrite_response_frame",
]

NodeAddress = tuple[str, int]
"""A ``(host, port)`` pair."""

NodeSeen = Callable[[int, str, int], NodeAddress]
"""Called with (node_id, real host, real port); returns the address to advertise."""


def _rewrite_nodes(nodes: tuple[Any, ...], id_field: str, seen: NodeSeen) -> tuple[Any, ...]:
    out = []
    for node in nodes:
        host, port = seen(getattr(node, id_field), node.host, node.port)
        out.append(dataclasses.replace(node, host=host, port=port))
    return tuple(out)


def _metadata(msg: Any, seen: NodeSeen) -> Any:
    return dataclasses.replace(msg, brokers=_rewrite_nodes(msg.brokers, "node_id", seen))


def _describe_cluster(msg: Any, seen: NodeSeen) -> Any:
    return dataclasses.replace(msg, brokers=_rewrite_nodes(msg.brokers, "broker_id", seen))


def _find_coordinator(msg: Any, seen: NodeSeen) -> Any:
    if hasattr(msg, "coordinators"):
        coordinators = tuple(
            c if c.node_id < 0 else dataclasses.replace(
                c, **dict(zip(("host", "port"), seen(c.node_id, c.host, c.port), strict=True))
            )
            for c in msg.coordinators
        )
        return dataclasses.replace(msg, coordinators=coordinators)
    if msg.node_id < 0:  # an error answer names no coordinator
        return msg
    host, port = seen(msg.node_id, msg.host, msg.port)
    return dataclasses.replace(msg, host=host, port=port)


def _node_endpoints(msg: Any, seen: NodeSeen) -> Any:
    endpoints = getattr(msg, "node_endpoints", ())
    if not endpoints:
        return msg
    return dataclasses.replace(msg, node_endpoints=_rewrite_nodes(endpoints, "node_id", seen))


_REWRITERS: dict[int, tuple[int, Callable[[Any, NodeSeen], Any]]] = {
    # api key: (first version that names addresses, rewriter)
    ApiKey.METADATA: (0, _metadata),
    ApiKey.FIND_COORDINATOR: (0, _find_coordinator),
    ApiKey.DESCRIBE_CLUSTER: (0, _describe_cluster),
    ApiKey.PRODUCE: (10, _node_endpoints),
    ApiKey.FETCH: (16, _node_endpoints),
    ApiKey.SHARE_FETCH: (0, _node_endpoints),
    ApiKey.SHARE_ACKNOWLEDGE: (0, _node_endpoints),
}

REWRITTEN_APIS = frozenset(_REWRITERS)
"""API keys whose responses may name broker addresses."""


def needs_rewrite(api_key: int, api_version: int) -> bool:
    """Whether responses of this API version can carry broker addresses."""
    entry = _REWRITERS.get(api_key)
    return entry is not None and api_version >= entry[0]


@lru_cache(maxsize=256)
def _endpoints_tag(api_key: int, api_version: int) -> int | None:
    """The tag of ``node_endpoints`` when it is a top-level tagged field of the response
    and the only field naming addresses (Produce v10+, Fetch v16+), else ``None``."""
    entry = _REWRITERS.get(api_key)
    if entry is None or entry[1] is not _node_endpoints:
        return None
    for f in dataclasses.fields(response_type(api_key, api_version)):
        if f.name == "node_endpoints":
            return int(f.metadata["tag"]) if "tag" in f.metadata else None
    return None


@lru_cache(maxsize=256)
def _response_plan(api_key: int, api_version: int) -> tuple[int | None, int | None]:
    """The response's header version (None: no schema) and :func:`_endpoints_tag`, in one
    lookup (every Produce v10+ answer asks for both)."""
    header_version = response_header_version(api_key, api_version)
    if header_version is None:
        return None, None
    return header_version, _endpoints_tag(api_key, api_version)


@lru_cache(maxsize=1024)
def rewritable(api_key: int, api_version: int) -> bool:
    """Whether the proxy can read, and so rewrite, the answer to this request version.

    False for a request whose answer may name broker addresses (see
    :func:`needs_rewrite`; a negative version counts) at a version the proxy
    has no schema for. Forwarded, the broker would act on it and its answer
    could be neither rewritten nor passed on, so the server refuses such a
    request up front.
    """
    entry = _REWRITERS.get(api_key)
    if entry is None or 0 <= api_version < entry[0]:
        return True
    if response_header_version(api_key, api_version) is None:
        return False
    try:
        response_type(api_key, api_version)
    except UnsupportedVersion:
        return False
    return True


def rewrite_message(api_key: int, message: Any, seen: NodeSeen) -> Any:
    """Return ``message`` with every broker address replaced through ``seen``."""
    return _REWRITERS[api_key][1](message, seen)


def rewrite_response_frame(
    api_key: int,
    api_version: int,
    frame: bytes,
    seen: NodeSeen,
    observe: Callable[[Any], None] | None = None,
) -> bytes:
    """Rewrite the addresses in a response frame (no length prefix); other bytes are kept.

    Raises :class:`kiproxy.protocol.errors.ProtocolError` if the response does not parse,
    or :class:`kiproxy.protocol.errors.UnsupportedVersion` if the proxy has no schema for
    the version (the server refuses such requests, see :func:`rewritable`):
    forwarding it unrewritten would let the client escape the proxy. ``observe``
    sees the parsed message first (the server learns topic ids from Metadata).
    """
    header_version, endpoints_tag = _response_plan(api_key, api_version)
    if header_version is None:
        raise UnsupportedVersion(
            f"{api_name(api_key)} response v{api_version} has no schema in the proxy: "
            "the broker addresses in it cannot be rewritten"
        )
    _, body_offset = parse_response_header(frame, header_version)
    tag = endpoints_tag if observe is None else None
    if tag is not None:
        tags, tagged_at = response_tagged_section(api_key, api_version, frame, body_offset)
        if tag not in tags:
            # No node_endpoints (Apache Kafka sends them only with NOT_LEADER errors): the
            # body is checked, not built. Produce and Fetch answers are most of a client's
            # traffic.
            return frame
        if api_key == ApiKey.FETCH:
            return _fetch_endpoints(api_version, frame, body_offset, tagged_at, seen)
    message = parse_response(api_key, api_version, frame, body_offset)
    if observe is not None:
        observe(message)
    rewritten = rewrite_message(api_key, message, seen)
    if rewritten is message or rewritten == message:
        return frame
    return frame[:body_offset] + serialize(rewritten)


_FETCH_TOP = 10
"""A Fetch v16+ body's fields before its topics: throttle_time_ms, error_code,
session_id."""


def _fetch_endpoints(api_version: int, frame: bytes, body_offset: int, tagged_at: int,
                     seen: NodeSeen) -> bytes:
    """A Fetch answer (checked, with tagged fields from ``tagged_at``) with its
    ``node_endpoints`` rewritten, its topics and records neither built nor copied:
    some brokers (Tansu) send the field in every answer, and a full parse would copy
    every fetched record. The tagged fields are read as those of the same answer with
    no topics, rewritten, and written back after the topics as they came."""
    head = frame[body_offset:body_offset + _FETCH_TOP]
    empty = head + b"\x01" + frame[tagged_at:]  # no topics: a compact array of 0
    message = parse_response(ApiKey.FETCH, api_version, empty)
    rewritten = rewrite_message(ApiKey.FETCH, message, seen)
    if rewritten is message or rewritten == message:
        return frame
    written = serialize(rewritten)
    if written[:_FETCH_TOP + 1] != empty[:_FETCH_TOP + 1]:  # not the layout read above
        whole = parse_response(ApiKey.FETCH, api_version, frame, body_offset)
        return frame[:body_offset] + serialize(rewrite_message(ApiKey.FETCH, whole, seen))
    return frame[:tagged_at] + written[_FETCH_TOP + 1:]
