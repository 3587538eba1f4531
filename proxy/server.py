"""The proxy server: the bootstrap listener, one listener per broker node, and routing.

Every request is routed by API key: Produce goes through the produce pipeline
(:mod:`proxy.produce`); ApiVersions answers are cut to what the proxy can
carry; responses that name broker addresses are rewritten; everything else is
forwarded as opaque bytes without being decoded.

A request whose answer would have to be rewritten at a version the proxy has no
schema for (never offered in ApiVersions, but a client can send it) is refused:
the client is closed with one warning, as a Kafka broker closes a connection
that sends a request version it cannot parse.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from functools import partial
from typing import TypeVar

from kiproxy.protocol.errors import SaslStateError, UnsupportedVersion
from kiproxy.protocol.framing import RequestHeader
from kiproxy.protocol.messages import ApiKey, api_name
from kiproxy.proxy.addresses import needs_rewrite, rewritable, rewrite_response_frame
from kiproxy.proxy.api_versions import (
    PRODUCE_MAX_VERSION,
    cut_api_versions_frame,
    known_version_range,
    unsupported_api_versions_response,
)
from kiproxy.proxy.config import ProxyConfig
from kiproxy.proxy.connection import ClientConnection, FrameStream
from kiproxy.proxy.discovery import DiscoveryError, discover_nodes
from kiproxy.proxy.memory import HeapTrimmer, ReceiveBudget
from kiproxy.proxy.metrics import HealthServer, Metrics
from kiproxy.proxy.nodes import NodeRegistry
from kiproxy.proxy.observe import ObserverHub
from kiproxy.proxy.outcome import Answer, Forward, RequestOutcome
from kiproxy.proxy.produce import ProducePipeline
from kiproxy.proxy.sasl import SaslRound
from kiproxy.proxy.tls import client_context, principal_from_peercert, upstream_context

log = logging.getLogger("kiproxy")

__all__ = ["ProxyServer"]

_BEFORE_AUTHENTICATION = frozenset(
    {ApiKey.API_VERSIONS, ApiKey.SASL_HANDSHAKE, ApiKey.SASL_AUTHENTICATE})
"""What a Kafka broker accepts on a connection whose SASL exchange is under way."""

_DISCOVERY_WAIT = 3.0
"""Seconds start() waits for the first node discovery before announcing itself."""

_Protocol = TypeVar("_Protocol", bound=asyncio.BaseProtocol)


class ProxyServer:
    """A running kiproxy: listeners, connections and the produce pipeline."""

    def __init__(
        self,
        config: ProxyConfig,
        produce: ProducePipeline | None = None,
        *,
        observers: ObserverHub | None = None,
        metrics: Metrics | None = None,
    ) -> None:
        self.config = config
        self.metrics = metrics
        """Prometheus metrics, when ``metrics_listen`` is set."""
        self.observers = observers or ObserverHub(metrics=metrics)
        self.observed = self.observers.active or metrics is not None
        """Responses are counted or observed (the produce pipeline then summarises)."""
        self._health: HealthServer | None = None
        self._client_tls = client_context(config.tls)
        self._upstream_tls = upstream_context(config.upstream_tls)
        self._sweeper: asyncio.Task[None] | None = None
        self.receive_budget = ReceiveBudget(config.max_client_buffered_bytes)
        """Bytes of partial client frames held across every connection."""
        self._trimmer = HeapTrimmer(
            lambda: self.receive_budget.released + self.produce.offload.budget.released)
        self._trim_task: asyncio.Task[None] | None = None
        self._discovery: asyncio.Task[None] | None = None
        host, port = config.listen_address
        self.listen_host = host
        self._listen_port = port
        self.produce = produce or ProducePipeline(None)
        self.produce.observed = self.observed
        # Produce v13 names topics by id; with several workers a process may not have
        # seen the Metadata that maps an id, so v13 is neither offered nor accepted.
        self.produce.max_version = 12 if config.workers > 1 else PRODUCE_MAX_VERSION
        self.produce.metrics = metrics
        if metrics is not None:
            decode_budget = self.produce.offload.budget
            metrics.watch_limits(lambda: {
                "max_decode_memory": decode_budget.waits,
                "max_client_buffered_bytes": self.receive_budget.pauses,
                "max_frame_size": self.receive_budget.frames_too_large,
            }, lambda: {
                "max_decode_memory": decode_budget.used,
                "max_client_buffered_bytes": self.receive_budget.used,
            })
        self.nodes = NodeRegistry(
            advertised_host=config.advertised_host or host,
            broker_port_start=config.broker_port_start
            if config.broker_port_start is not None else port + 1,
            node_ports=config.node_ports,
            open_listener=self._open_node_listener,
        )
        self.produce.nodes_seen = self.nodes.seen
        self._servers: dict[int | None, asyncio.Server] = {}
        self.connections: set[ClientConnection] = set()
        self._tasks: set[asyncio.Task[None]] = set()
        self.started_at = 0.0

    # ------------------------------------------------------------------ listeners

    async def start(self) -> None:
        """Open the bootstrap listener."""
        server = await asyncio.get_running_loop().create_server(
            partial(FrameStream, self.config.max_frame_size, partial(self._accept, node_id=None),
                    self.receive_budget),
            self.listen_host, self._listen_port,
            reuse_address=True, reuse_port=self.config.workers > 1 or None,
            ssl=self._client_tls,
        )
        self._servers[None] = server
        self._listen_port = server.sockets[0].getsockname()[1]
        if self.config.broker_port_start is None and self.config.listen_address[1] == 0:
            self.nodes.broker_port_start = self._listen_port + 1
        self.started_at = time.time()
        log.info("kiproxy listening on %s (upstream %s)", self.bootstrap_address,
                 ", ".join(self.config.upstream))
        if self.config.idle_timeout_ms:
            self._sweeper = asyncio.create_task(self._close_idle())
        self._trim_task = asyncio.create_task(self._trimmer.run())
        if self.config.metrics_listen is not None and self.metrics is not None:
            self._health = HealthServer(self.metrics, self.readiness)
            await self._health.start(*self.config.metrics_listen_address)
            log.info("metrics and health checks on http://%s/metrics", self._health.address)
        # Listeners first, then outbound connections: discovery's ephemeral source
        # ports must not take a port this process is about to listen on.
        await self._learn_nodes()

    async def _learn_nodes(self) -> None:
        """Open the node listeners before clients come back (see :mod:`proxy.discovery`).

        Waits a few seconds at most; if no upstream answers by then, keeps trying in
        the background until one does or a client's Metadata has taught the nodes.
        """
        self._discovery = asyncio.create_task(self._keep_discovering())
        await asyncio.wait({self._discovery}, timeout=_DISCOVERY_WAIT)

    async def _discover_once(self, retry: bool = False) -> bool:
        try:
            count = await discover_nodes(self)
        except Exception as exc:  # never fatal: clients' Metadata opens the listeners too
            reason = exc if isinstance(exc, DiscoveryError) else repr(exc)
            # Warn once; a broker that requires SASL before Metadata fails every retry.
            log.log(logging.DEBUG if retry else logging.WARNING,
                    "could not learn the cluster's nodes from the upstream brokers (%s); "
                    "retrying, and node listeners open as clients fetch metadata", reason)
            return False
        log.info("learned %d broker node(s) from upstream; node listeners %s", count,
                 ", ".join(f"{n}->{p}" for n, p in sorted(
                     (k, v) for k, v in self.listener_ports.items() if k is not None)))
        return True

    async def _keep_discovering(self) -> None:
        delay, retry = 1.0, False
        while not await self._discover_once(retry):
            await asyncio.sleep(delay)
            if self.nodes.known_nodes:
                return
            delay, retry = min(delay * 2, 30.0), True

    @property
    def metrics_address(self) -> str | None:
        """``host:port`` of the metrics endpoint, when it is open."""
        return self._health.address if self._health is not None else None

    async def readiness(self) -> str | None:
        """``None`` when ready to carry traffic, else why not."""
        if self.config.interceptor.class_name and self.produce.interceptor is None:
            return "the interceptor is not loaded"
        errors = []
        for host, port in self.config.upstream_addresses:
            try:
                _, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 2)
            except (OSError, TimeoutError) as exc:
                errors.append(f"{host}:{port}: {exc or type(exc).__name__}")
                continue
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
            return None
        return "no upstream broker reachable (" + "; ".join(errors) + ")"

    @property
    def bootstrap_address(self) -> str:
        """``host:port`` clients should use as ``bootstrap.servers``."""
        return f"{self.nodes.advertised_host}:{self._listen_port}"

    async def _open_node_listener(self, node_id: int, port: int) -> None:
        try:
            server = await asyncio.get_running_loop().create_server(
                partial(FrameStream, self.config.max_frame_size,
                        partial(self._accept, node_id=node_id), self.receive_budget),
                self.listen_host, port,
                reuse_address=True, reuse_port=self.config.workers > 1 or None,
                ssl=self._client_tls,
            )
        except OSError as exc:
            log.error("cannot open listener port %d for node %d: %s (set node_ports or "
                      "broker_port_start to free ports)", port, node_id, exc)
            raise
        self._servers[node_id] = server

    @property
    def listener_ports(self) -> dict[int | None, int]:
        """Open listeners: node id (``None`` for bootstrap) -> port."""
        return {k: s.sockets[0].getsockname()[1] for k, s in self._servers.items() if s.sockets}

    async def _close_idle(self) -> None:
        idle = self.config.idle_timeout_ms / 1000
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(min(max(idle / 4, 0.05), 5.0))
            now = loop.time()
            closing = []
            for conn in list(self.connections):
                if conn.idle and now - conn.last_activity >= idle:
                    log.info("closing idle client %s (client_id %r): no traffic for %.0f s",
                             conn.client_address, conn.client_id, idle,
                             extra=conn.log_context)
                    closing.append(conn.close())
            # Together: one peer that is slow to close must not hold up the others.
            await asyncio.gather(*closing, return_exceptions=True)

    async def _accept(self, client: FrameStream, node_id: int | None) -> None:
        if len(self.connections) >= self.config.max_connections:
            peer = client.get_extra_info("peername")
            log.warning("refusing client %s: max_connections (%d) reached", peer,
                        self.config.max_connections)
            if self.metrics is not None:
                self.metrics.refused_connections.inc()
            client.transport.abort()
            return
        conn = ClientConnection(self, client, node_id)
        if self._client_tls is not None and self.config.tls.client_ca is not None:
            conn.principal = principal_from_peercert(client.get_extra_info("peercert"))
        self.connections.add(conn)
        if self.metrics is not None:
            self.metrics.connections.inc()
            self.metrics.active_connections.inc()
        try:
            await conn.run()
        except asyncio.CancelledError:
            pass
        except Exception:
            log.exception("connection from %s failed", conn.client_address, extra=conn.log_context)
        finally:
            self.connections.discard(conn)
            if self.metrics is not None:
                self.metrics.active_connections.dec()
            await conn.close()

    # ------------------------------------------------------------------ upstream

    def bootstrap_upstreams(self) -> list[tuple[str, int] | None]:
        """Upstream bootstrap servers, then every node seen, in the order to try them."""
        out: list[tuple[str, int] | None] = list(self.config.upstream_addresses)
        out.extend(a for a in self.nodes.known_nodes.values() if a not in out)
        return out

    def upstream_for_node(self, node_id: int) -> tuple[str, int] | None:
        """The real address of a broker node."""
        return self.nodes.upstream_for(node_id)

    async def open_upstream(
        self, host: str, port: int, protocol_factory: Callable[[], _Protocol]
    ) -> tuple[asyncio.BaseTransport, _Protocol]:
        """Open a connection to a broker (TLS if configured), run by the factory's protocol."""
        tls = self._upstream_tls
        return await asyncio.get_running_loop().create_connection(
            protocol_factory, host, port, ssl=tls, server_hostname=host if tls else None)

    # ------------------------------------------------------------------ routing

    def _rewriter(self, header: RequestHeader) -> Callable[[bytes], bytes] | None:
        if header.api_key == ApiKey.API_VERSIONS:
            return partial(cut_api_versions_frame, header.api_version,
                           produce_max=self.produce.max_version)
        if needs_rewrite(header.api_key, header.api_version):
            observe = self.produce.learn_topic_ids if header.api_key == ApiKey.METADATA else None
            return partial(rewrite_response_frame, header.api_key, header.api_version,
                           seen=self.nodes.seen, observe=observe)
        return None

    async def handle_request(
        self, conn: ClientConnection, header: RequestHeader, frame: bytes
    ) -> RequestOutcome:
        """Decide what to do with one client request."""
        if conn.sasl.awaiting_verdict and header.api_key not in _BEFORE_AUTHENTICATION:
            # The broker refuses this (ILLEGAL_SASL_STATE) and closes the connection; the
            # proxy must not run the interceptor or answer for it on the broker's behalf.
            raise SaslStateError(
                f"{api_name(header.api_key)} request before its SASL {conn.sasl.mechanism} "
                "authentication succeeded (the broker would refuse it: ILLEGAL_SASL_STATE)")
        if header.api_key == ApiKey.PRODUCE:
            return await self.produce.handle(conn, header, frame, self._rewriter(header))
        if not rewritable(header.api_key, header.api_version):
            # Checked before forwarding: the broker would act on the request and its
            # answer could then be neither rewritten nor passed on (it names brokers).
            raise UnsupportedVersion(_unrewritable_message(header))
        if header.api_key == ApiKey.API_VERSIONS:
            known = known_version_range(ApiKey.API_VERSIONS)
            if known is not None and header.api_version > known[1]:
                return Answer(unsupported_api_versions_response(header.correlation_id))
        elif header.api_key == ApiKey.SASL_HANDSHAKE and header.body_offset is not None:
            if header.api_version == 0:
                # v0 is followed by raw SASL tokens outside Kafka framing (clients older
                # than Kafka 1.0); the proxy carries only framed SaslAuthenticate.
                raise UnsupportedVersion(
                    "SaslHandshake v0 (raw SASL tokens without Kafka framing) is not carried "
                    "by the proxy; use a client that sends SaslHandshake v1 and "
                    "SaslAuthenticate (Kafka 1.0+ clients do)")
            conn.sasl.on_handshake(header.api_version, frame, header.body_offset)
        elif header.api_key == ApiKey.SASL_AUTHENTICATE and header.body_offset is not None:
            sasl_round = conn.sasl.on_authenticate(header.api_version, frame, header.body_offset)
            return Forward(frame, on_response=partial(
                self._sasl_answered, conn, sasl_round, header.api_version,
                header.header_version == 2))
        return Forward(frame, on_response=self._rewriter(header))

    @staticmethod
    def _sasl_answered(conn: ClientConnection, sasl_round: SaslRound | None, version: int,
                       flexible: bool, frame: bytes) -> bytes:
        """Learn (or forget) the principal from a SaslAuthenticate answer; pass it on unchanged.

        The principal is set only when the exchange is decided in the client's
        favour (PLAIN: error_code 0; SCRAM: the server-final-message's ``v=``),
        never on the first SCRAM round. A failed exchange clears the principal
        SASL had given the connection (a failed KIP-368 re-authentication: the
        broker no longer vouches for it) and is logged once.
        """
        verdict = conn.sasl.on_response(sasl_round, version, flexible, frame)
        if verdict is None:
            return frame
        mechanism = sasl_round.mechanism if sasl_round is not None else conn.sasl.mechanism
        if verdict.succeeded:
            if verdict.user != conn.principal:
                conn.principal = verdict.user
                log.info("client %s (client_id %r) authenticated as %r (SASL %s)",
                         conn.client_address, conn.client_id, verdict.user, mechanism,
                         extra=conn.log_context)
            conn.sasl.principal = verdict.user
            return frame
        if conn.sasl.principal is not None and conn.principal == conn.sasl.principal:
            conn.principal = None
        conn.sasl.principal = None
        log.warning("SASL authentication of client %s (client_id %r) as %r failed: %s "
                    "(SASL %s)", conn.client_address, conn.client_id, verdict.user,
                    verdict.reason, mechanism, extra=conn.log_context)
        return frame

    # ------------------------------------------------------------------ shutdown

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting, let owed responses go out for ``grace`` seconds, then close all."""
        if grace is None:
            grace = self.config.shutdown_grace_ms / 1000
        for server in self._servers.values():
            server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._trim_task is not None:
            self._trim_task.cancel()
        if self._discovery is not None:
            self._discovery.cancel()
        for conn in list(self.connections):
            await conn.drain()
        deadline = time.monotonic() + grace
        while any(not c.idle for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        await asyncio.gather(*(c.close() for c in list(self.connections)),
                             return_exceptions=True)
        for server in self._servers.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1)
        await self.produce.close()
        if self._health is not None:
            await self._health.stop()
        await asyncio.to_thread(self.observers.close)
        log.info("kiproxy stopped")


def _unrewritable_message(header: RequestHeader) -> str:
    name = api_name(header.api_key)
    known = known_version_range(header.api_key)
    reads = f"; it reads {name} v{known[0]}-v{known[1]}" if known is not None else ""
    return (f"{name} request v{header.api_version} refused: the proxy has no schema for "
            f"that version, so the broker addresses in the answer could not be "
            f"rewritten (use a version offered in ApiVersions{reads})")
