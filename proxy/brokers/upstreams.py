"""Where broker connections go, and how they are opened.

Contract: a bootstrap connection tries the configured upstream bootstrap
servers in order, then every broker node seen since; a node connection goes
to that node's real address (:class:`~kiproxy.proxy.brokers.nodes.NodeRegistry`).
Connections use TLS when ``upstream_tls`` is on, with the host name checked
as configured. Each attempt is bounded by ``upstream_connect_timeout_ms``.
This object is shared by client connections and node discovery; it holds no
connection itself.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from collections.abc import Callable
from typing import TypeVar

from kiproxy.protocol.log_limit import RateLimitedLog
from kiproxy.proxy.brokers.failures import UpstreamFailureLog
from kiproxy.proxy.brokers.nodes import NodeRegistry

__all__ = ["Upstreams"]

_Protocol = TypeVar("_Protocol", bound=asyncio.BaseProtocol)


class Upstreams:
    """The cluster the proxy fronts, as addresses to connect to."""

    def __init__(self, bootstrap: list[tuple[str, int]], nodes: NodeRegistry,
                 tls: ssl.SSLContext | None, connect_timeout: float) -> None:
        self.bootstrap = bootstrap
        """The configured upstream bootstrap servers."""
        self.connect_timeout = connect_timeout
        """Seconds one connection attempt may take."""
        self._nodes = nodes
        self._tls = tls
        self.failures = UpstreamFailureLog()
        """Client connections that could not reach a broker, logged once per interval."""
        self.lost = RateLimitedLog(logging.getLogger("kiproxy.connection"))
        """Broker connections lost with answers owed (a WARNING each): one line per broker
        and reason per interval, so a broker that closes every connection a client
        opens costs a line every 10 s, not one per reconnect."""

    @property
    def tls(self) -> bool:
        """Whether broker connections use TLS (``upstream_tls``)."""
        return self._tls is not None

    def bootstrap_candidates(self) -> list[tuple[str, int]]:
        """Upstream bootstrap servers, then every node seen, in the order to try them."""
        out = list(self.bootstrap)
        out.extend(a for a in self._nodes.known_nodes.values() if a not in out)
        return out

    def for_node(self, node_id: int) -> tuple[str, int] | None:
        """The real address of a broker node, if it has been seen."""
        return self._nodes.upstream_for(node_id)

    async def open(
        self, host: str, port: int, protocol_factory: Callable[[], _Protocol]
    ) -> tuple[asyncio.BaseTransport, _Protocol]:
        """Open a connection to a broker (TLS if configured), run by the factory's protocol."""
        tls = self._tls
        return await asyncio.wait_for(asyncio.get_running_loop().create_connection(
            protocol_factory, host, port, ssl=tls, server_hostname=host if tls else None),
            self.connect_timeout)
