"""Learning the cluster's broker nodes when the proxy starts.

Clients keep the node addresses the proxy advertised (``host:broker_port_start +
node_id``) and reconnect straight to them, not to the bootstrap port. A proxy that
restarts must therefore have those node listeners open again before clients come
back, not only after some client happens to fetch Metadata through the bootstrap
port: a librdkafka 2.10+ client that knows only the node port stops using its
bootstrap servers and would see "connection refused" until it re-bootstraps
(``metadata.recovery.rebootstrap.trigger.ms``, five minutes by default).

So at start the proxy asks an upstream broker itself (ApiVersions v0, then Metadata
for no topics at the highest version both sides know) and opens a listener for
every node in the answer, through the same registry that rewriting uses. A broker
that requires SASL closes such a connection; discovery then fails with a log line,
and the listeners open on the first Metadata a client fetches, as before.

Before any of this, ``kiproxy run`` calls :func:`check_upstream`: a wrong
``--upstream`` ends the command with one line naming each address and why it
failed, unless ``wait_for_upstream`` asks to keep trying.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import struct
from functools import partial
from typing import TYPE_CHECKING, Any

from kiproxy.protocol.errors import ProtocolError
from kiproxy.protocol.framing import (
    encode_request_header,
    parse_response_header,
    request_header_version,
)
from kiproxy.protocol.messages import ApiKey, parse_response, request_type, serialize
from kiproxy.proxy.brokers.addresses import rewrite_response_frame
from kiproxy.proxy.brokers.api_versions import known_version_range
from kiproxy.proxy.brokers.failures import connect_error
from kiproxy.proxy.config.model import ProxyConfig
from kiproxy.proxy.net.frame_stream import FrameStream
from kiproxy.proxy.net.tls import upstream_context

if TYPE_CHECKING:
    from collections.abc import Callable

    from kiproxy.proxy.brokers.nodes import NodeRegistry
    from kiproxy.proxy.brokers.upstreams import Upstreams

log = logging.getLogger("kiproxy.discovery")

__all__ = ["DiscoveryError", "UpstreamUnreachable", "check_upstream", "discover_nodes",
           "metadata_request"]

_INT32 = struct.Struct(">i")
_CLIENT_ID = "kiproxy-discovery"


class DiscoveryError(Exception):
    """The cluster's nodes could not be learned from an upstream broker."""


def metadata_request(api_version: int, correlation_id: int) -> bytes:
    """A Metadata request frame (no length prefix) asking for no topics: brokers only."""
    header_version = request_header_version(ApiKey.METADATA, api_version)
    assert header_version is not None
    cls = request_type(ApiKey.METADATA, api_version)
    fields: dict[str, Any] = {"topics": ()}
    names = set(cls.__dataclass_fields__)
    # v0 reads an empty list as "every topic"; the caller never asks v0 (Kafka 4 dropped it).
    if "allow_auto_topic_creation" in names:
        fields["allow_auto_topic_creation"] = False
    for name in ("include_cluster_authorized_operations", "include_topic_authorized_operations"):
        if name in names:
            fields[name] = False
    return (encode_request_header(ApiKey.METADATA, api_version, correlation_id, _CLIENT_ID,
                                  header_version)
            + serialize(cls(**fields)))


async def _exchange(stream: FrameStream, frame: bytes) -> bytes:
    """Send one request and read its answer (no other request is in flight)."""
    stream.transport.writelines((_INT32.pack(len(frame)), frame))
    frames = await stream.read()
    if not frames:
        raise DiscoveryError("the broker closed the connection (does it require SASL or TLS?)")
    return bytes(frames[0])


def _metadata_version(api_versions_frame: bytes) -> int:
    """The highest Metadata version (>= 1) that both the broker and the proxy know."""
    _, body = parse_response_header(api_versions_frame, 0)
    answer = parse_response(ApiKey.API_VERSIONS, 0, api_versions_frame, body)
    if answer.error_code != 0:
        raise DiscoveryError(f"ApiVersions failed with error code {answer.error_code}")
    ours = known_version_range(ApiKey.METADATA)
    assert ours is not None
    for entry in answer.api_keys or ():
        if entry.api_key == ApiKey.METADATA:
            version = min(int(entry.max_version), ours[1])
            if version < max(int(entry.min_version), ours[0], 1):
                break
            return version
    raise DiscoveryError("the broker offers no Metadata version the proxy can read")


async def _ask(upstreams: Upstreams, nodes: NodeRegistry,
               learn_topic_ids: Callable[[Any], None],
               host: str, port: int, max_response_size: int) -> int:
    timeout = upstreams.connect_timeout
    _, stream = await upstreams.open(host, port, partial(FrameStream, max_response_size,
                                                         whole_frames=True))
    try:
        api_versions = encode_request_header(ApiKey.API_VERSIONS, 0, 1, _CLIENT_ID, 1)
        version = _metadata_version(
            await asyncio.wait_for(_exchange(stream, api_versions), timeout))
        frame = await asyncio.wait_for(_exchange(stream, metadata_request(version, 2)), timeout)
        named: list[int] = []

        def seen(node_id: int, host: str, port: int) -> tuple[str, int]:
            named.append(node_id)
            return nodes.seen(node_id, host, port)

        rewrite_response_frame(ApiKey.METADATA, version, frame, seen=seen,
                               observe=learn_topic_ids)
        await nodes.settle()
        return len(named)
    finally:
        await stream.close()


async def discover_nodes(upstreams: Upstreams, nodes: NodeRegistry,
                         learn_topic_ids: Callable[[Any], None], *,
                         max_response_size: int) -> int:
    """Ask the upstream bootstrap servers in turn for the cluster's nodes and open their
    listeners (through ``nodes``); return how many nodes the first broker that answered
    named. Topic ids in the answer go to ``learn_topic_ids``.

    Raises :class:`DiscoveryError` naming every address tried when none answered.
    """
    errors = []
    for host, port in upstreams.bootstrap:
        try:
            return await _ask(upstreams, nodes, learn_topic_ids, host, port, max_response_size)
        except (OSError, TimeoutError, ProtocolError, DiscoveryError, RuntimeError) as exc:
            # RuntimeError: uvloop's writes to a transport the broker already reset.
            errors.append(f"{host}:{port}: {str(exc) or type(exc).__name__}")
    raise DiscoveryError("; ".join(errors) or "no upstream address configured")


class UpstreamUnreachable(Exception):
    """No upstream bootstrap server accepted a connection within the start-up time."""


async def check_upstream(config: ProxyConfig) -> None:
    """Return once any upstream bootstrap server accepts a connection (TLS included).

    Tries every address in turn, again and again, for ``upstream_startup_timeout_ms``;
    then raises :class:`UpstreamUnreachable` naming each address and why it failed.
    Only reachability is checked: a broker that wants SASL first still passes.
    """
    loop = asyncio.get_running_loop()
    budget = config.upstream_startup_timeout_ms / 1000
    deadline = loop.time() + budget
    tls = upstream_context(config.upstream_tls)
    reasons: dict[str, str] = {}
    while True:
        for host, port in config.upstream_addresses:
            attempt = max(min(config.upstream_connect_timeout_ms / 1000,
                              deadline - loop.time()), 0.1)
            try:
                transport, _ = await asyncio.wait_for(loop.create_connection(
                    asyncio.Protocol, host, port, ssl=tls,
                    server_hostname=host if tls else None), attempt)
            except (OSError, ssl.SSLError) as exc:  # TimeoutError is an OSError
                reasons[f"{host}:{port}"] = connect_error(exc, attempt, tls is not None)
                continue
            transport.close()
            return
        if loop.time() >= deadline:
            break
        await asyncio.sleep(min(0.5, max(deadline - loop.time(), 0)))
    tried = "; ".join(f"{address}: {why}" for address, why in reasons.items())
    flag = "--upstream" if len(reasons) == 1 else "--upstream (or the config's upstream list)"
    raise UpstreamUnreachable(
        f"upstream {tried} (tried for {budget:g} s); start the cluster, fix {flag}, "
        "or pass --wait-for-upstream")
