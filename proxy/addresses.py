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
from typing import Any

from protocol.framing import parse_response_header, response_header_version
from protocol.messages import ApiKey, parse_response, serialize

__all__ = ["REWRITTEN_APIS", "NodeAddress", "rewrite_response_frame"]

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

    Raises :class:`protocol.errors.ProtocolError` if the response does not parse:
    forwarding it unrewritten would let the client escape the proxy. ``observe``
    sees the parsed message first (the server learns topic ids from Metadata).
    """
    header_version = response_header_version(api_key, api_version)
    assert header_version is not None, "needs_rewrite() is only true for known versions"
    _, body_offset = parse_response_header(frame, header_version)
    message = parse_response(api_key, api_version, frame, body_offset)
    if observe is not None:
        observe(message)
    rewritten = rewrite_message(api_key, message, seen)
    if rewritten is message or rewritten == message:
        return frame
    return frame[:body_offset] + serialize(rewritten)
