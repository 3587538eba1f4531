"""The proxy server: listeners, the process-wide parts, and the configuration generation.

Contract:

- One bootstrap listener plus one listener per broker node, discovered from
  metadata as it changes (:mod:`kiproxy.proxy.brokers.discovery`,
  :mod:`kiproxy.proxy.brokers.nodes`). A node listener that cannot be opened (its
  port taken) is tried again every :data:`LISTENER_RETRY` seconds, with one ERROR
  line per reason (and one INFO line once it opens); until it opens, ``/readyz``
  answers 503 naming the node, the port and why (:meth:`ProxyServer.readiness`).
- The server owns what lives as long as the process: listeners, the node
  registry, upstream addresses, the decode threads and memory budgets, metrics.
  Everything a configuration makes (interceptor, observers, limits) is one
  :class:`~kiproxy.proxy.generation.Generation`, built completely before it is
  installed and swapped whole by :meth:`ProxyServer.switch` (hot reload); the
  replaced one is closed once no request runs under it.
- A listener with ``proxy_protocol`` on reads the PROXY header first
  (:meth:`~kiproxy.proxy.net.frame_stream.FrameStream.read_proxy_header`, at most
  ``proxy_protocol_timeout_ms``) and judges it
  (:func:`~kiproxy.proxy.net.proxy_protocol.accept_proxy_header`); a refused
  connection is closed with one WARNING line, and nothing reaches a broker.
  The client identity then names the original client (the peer is kept).
- Connections get a frozen :class:`~kiproxy.proxy.connection.ConnectionServices`
  and their client's identity, never the server; what each request does is
  decided by the :class:`~kiproxy.proxy.dispatch.RequestDispatcher`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import time
import uuid
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

from kiproxy.interceptors.identity import ClientIdentity
from kiproxy.protocol.log_limit import MORE_IN_INTERVAL, RateLimitedLog
from kiproxy.proxy.admin.guard import AdminGuard
from kiproxy.proxy.admin.http import HealthServer
from kiproxy.proxy.brokers.discovery import DiscoveryError, discover_nodes
from kiproxy.proxy.brokers.nodes import NodeRegistry
from kiproxy.proxy.brokers.upstreams import Upstreams
from kiproxy.proxy.config.model import ProxyConfig
from kiproxy.proxy.connection import ClientConnection, ConnectionServices
from kiproxy.proxy.dispatch import RequestDispatcher
from kiproxy.proxy.generation import (
    Generation,
    GenerationCell,
    audit_sink,
    build_generation,
    close_generation,
    dead_letter_sink,
    uses_audit_topic,
    uses_dead_letter,
)
from kiproxy.proxy.net.buffers import HeapTrimmer, ReceiveBudget
from kiproxy.proxy.net.frame_stream import FrameStream
from kiproxy.proxy.net.proxy_protocol import Refuse, UseHeader, accept_proxy_header
from kiproxy.proxy.net.tls import ListenerTls, principal_from_peercert, upstream_context
from kiproxy.proxy.observe.audit import AuditLog
from kiproxy.proxy.observe.kafka_sink import KafkaSink
from kiproxy.proxy.observe.metrics import Metrics
from kiproxy.proxy.produce.offload import BatchOffload
from kiproxy.proxy.produce.pipeline import learn_topic_ids
from kiproxy.proxy.reload.reloader import (
    FileWatch,
    Reloader,
    ReloadResult,
    config_hash,
    redacted,
    watched_paths,
)

log = logging.getLogger("kiproxy")
_refusals = RateLimitedLog(log)
"""Connections refused before they are served: one line per 10 s for max_connections,
and per listener, peer host and kind for a PROXY header the listener does not accept, with
the count of the others."""

__all__ = ["ProxyServer"]

_DISCOVERY_WAIT = 3.0
"""Seconds start() waits for the first node discovery before announcing itself."""
LISTENER_RETRY = 5.0
"""Seconds between tries to open a node listener that could not be opened."""


class ProxyServer:
    """A running kiproxy: listeners, connections and the current configuration generation."""

    def __init__(self, config: ProxyConfig, *, metrics: Metrics | None = None,
                 load: Callable[[], ProxyConfig] | None = None,
                 siblings: tuple[tuple[str, int], ...] = (),
                 config_file: str | Path | None = None) -> None:
        """``load`` reads the configuration again (the file and the command line's
        overrides) for a reload; ``siblings`` are the metrics endpoints of the other
        worker processes, which ``POST /reload`` reloads too; ``config_file`` is
        watched with ``reload.watch``."""
        self.metrics = metrics
        """Prometheus metrics, when ``metrics_listen`` is set."""
        host, port = config.listen_address
        self.listen_host = host
        self._listen_port = port
        self.nodes = NodeRegistry(
            advertised_host=config.advertised_host or host,
            broker_port_start=config.broker_port_start
            if config.broker_port_start is not None else port + 1,
            node_ports=config.node_ports,
            open_listener=self._open_node_listener,
        )
        self.offload = BatchOffload(config.decompression_limits(),
                                    max_decode_memory=config.max_decode_memory,
                                    inline_encode_seconds=config.max_inline_encode_ms / 1000)
        """Decode threads and the decode memory budget, shared by every generation."""
        self.topic_names: dict[uuid.UUID, str] = {}
        """Topic id -> name from Metadata responses, shared by every generation."""
        self.receive_budget = ReceiveBudget(config.max_client_buffered_bytes)
        """Bytes of partial client frames held across every connection."""
        self._trimmer = HeapTrimmer(
            lambda: self.receive_budget.released + self.offload.budget.released)
        self._trim_task: asyncio.Task[None] | None = None
        if metrics is not None:
            decode_budget = self.offload.budget
            metrics.watch_limits(lambda: {
                "max_decode_memory": decode_budget.waits,
                "max_client_buffered_bytes": self.receive_budget.pauses,
                "max_frame_size": self.receive_budget.frames_too_large,
            }, lambda: {
                "max_decode_memory": decode_budget.used,
                "max_client_buffered_bytes": self.receive_budget.used,
            })
        if metrics is not None:
            metrics.watch_interceptors(lambda: self.generations.current.produce.interceptors())
        self.dead_letter: KafkaSink | None = (
            dead_letter_sink(config, metrics) if uses_dead_letter(config) else None)
        """Copies refused records to the routes' dead-letter topics (made when a route
        first asks for one; its ``dead_letter_sink`` settings are read then)."""
        self.audit_sink: KafkaSink | None = (
            audit_sink(config, metrics) if uses_audit_topic(config) else None)
        """Sends the audit events to ``audit.topic`` (made when a configuration first sets
        it; its ``audit_sink`` settings are read then)."""
        self.generations = GenerationCell(build_generation(
            config, 1, metrics=metrics, offload=self.offload, topic_names=self.topic_names,
            dead_letter=self.dead_letter, audit_sink=self.audit_sink))
        """The configuration generation in force, and the older ones still in use."""
        first_tls = self.generations.current.client_tls
        tls_failures = None if metrics is None else metrics.client_tls_failures
        self._listener_tls = (
            ListenerTls(first_tls, None if tls_failures is None
                        else lambda reason: tls_failures.labels(reason).inc())
            if first_tls is not None else None)
        self.upstreams = Upstreams(config.upstream_addresses, self.nodes,
                                   upstream_context(config.upstream_tls),
                                   config.upstream_connect_timeout_ms / 1000)
        self.dispatcher = RequestDispatcher(self.nodes)
        self.services = ConnectionServices(
            generations=self.generations, dispatcher=self.dispatcher, upstreams=self.upstreams,
            nodes=self.nodes, metrics=metrics)
        self._health: HealthServer | None = None
        self._sweeper: asyncio.Task[None] | None = None
        self._discovery: asyncio.Task[None] | None = None
        self._reopening: asyncio.Task[None] | None = None
        self._listener_failures: dict[int, str] = {}
        """Node id -> why its listener last failed to open (logged once per reason)."""
        self._retiring: set[asyncio.Task[None]] = set()
        self._servers: dict[int | None, asyncio.Server] = {}
        self.connections: set[ClientConnection] = set()
        self._prefacing: set[FrameStream] = set()
        """Client streams whose PROXY header is awaited (not connections yet)."""
        self.started_at = 0.0
        self._siblings = siblings
        self._loaded_files: dict[str, str] | None = None
        self.reloader: Reloader[Generation] = Reloader(
            config=config, generation=1, load=load or (lambda: self.config),
            build=self._build_in_thread, apply=self._apply, on_result=self._reloaded,
            before_load=self._note_watched_files)
        self._watch: FileWatch | None = None
        if config.reload.watch:
            self._watch = FileWatch(
                lambda: [*watched_paths(self.config, config_file),
                         *self.generation.produce.watched_files],
                partial(self.reload, "watch"),
                interval=config.reload.watch_interval_ms / 1000,
                debounce=config.reload.debounce_ms / 1000)

    # ------------------------------------------------------------------ reload

    async def reload(self, trigger: str) -> ReloadResult:
        """Reload the configuration now (all or nothing); see
        :mod:`kiproxy.proxy.reload.reloader`."""
        return await self.reloader.reload(trigger)

    async def _note_watched_files(self) -> None:
        # What the watched files hold before this reload reads them (hashed on a
        # thread: a plugins dir may hold large Wasm modules). Once applied, the file
        # watch counts changes from there, whatever triggered the reload.
        watch = self._watch
        self._loaded_files = None if watch is None else await asyncio.to_thread(
            watch.snapshot)

    async def _build_in_thread(self, config: ProxyConfig, number: int) -> Generation:
        # Importing plugins, starting isolation workers and compiling Wasm take time;
        # none of it may hold the event loop.
        from kiproxy.interceptors.loader import forget_plugin_modules

        forget_plugin_modules(config.plugins_dir)
        return await asyncio.to_thread(self.build_generation, config, number)

    async def _apply(self, generation: Generation, config: ProxyConfig, trigger: str) -> None:
        self.switch(generation)
        logging.getLogger().setLevel(config.log_level)
        self.offload.encode_cost.budget = config.max_inline_encode_ms / 1000
        if self._watch is not None and self._loaded_files is not None:
            self._watch.applied(self._loaded_files)
        audit = next((w.observer for w in generation.observers.workers
                      if isinstance(w.observer, AuditLog)), None)
        if audit is not None:
            audit.record([{"event": "config_reload", "ts": int(time.time() * 1000),
                           "generation": generation.number, "trigger": trigger,
                           "config_hash": config_hash(config)}])

    def _reloaded(self, result: ReloadResult) -> None:
        if self.metrics is not None:
            self.metrics.config_reloads.labels("ok" if result.ok else "failed").inc()
            if result.ok:
                self.metrics.config_last_reload.set(time.time())

    async def _http_reload(self, query: str) -> tuple[int, dict[str, Any]]:
        result = await self.reload("http")
        answer: dict[str, Any] = result.as_json()
        ok, refused = result.ok, bool(result.restart_required)
        if self._siblings and "scope=local" not in query:
            auth = self._health.guard.authorization() if self._health is not None else None
            others = await asyncio.gather(*(_post_reload(host, port, auth)
                                            for host, port in self._siblings))
            ok = ok and all(o.get("ok") is True for o in others)
            refused = refused or any(o.get("restart_required") for o in others)
            answer = {"ok": ok, "workers": [answer, *others]}
        return (200 if ok else 409 if refused else 500), answer

    def config_view(self) -> dict[str, Any]:
        """The running configuration for ``/config``: redacted, with generation and hash."""
        config = self.config
        return {"generation": self.generation.number, "config_hash": config_hash(config),
                "last_reload": self.reloader.last_success,
                "config": redacted(config.model_dump(mode="json", by_alias=True))}

    @property
    def config(self) -> ProxyConfig:
        """The settings of the current generation."""
        return self.generations.current.config

    @property
    def generation(self) -> Generation:
        """The current configuration generation."""
        return self.generations.current

    def build_generation(self, config: ProxyConfig, number: int) -> Generation:
        """The generation a reload to ``config`` would install, complete, sharing this
        process's parts; raises (having closed what it opened) if anything in it cannot
        be built."""
        # A sink made here is started by switch().
        if self.dead_letter is None and uses_dead_letter(config):
            self.dead_letter = dead_letter_sink(config, self.metrics)
        if self.audit_sink is None and uses_audit_topic(config):
            self.audit_sink = audit_sink(config, self.metrics)
        return build_generation(config, number, metrics=self.metrics, offload=self.offload,
                                topic_names=self.topic_names, previous=self.generations.current,
                                dead_letter=self.dead_letter, audit_sink=self.audit_sink)

    def _sinks(self) -> list[KafkaSink]:
        """The side-copy sinks this process has made."""
        return [sink for sink in (self.dead_letter, self.audit_sink) if sink is not None]

    def switch(self, generation: Generation) -> None:
        """Make ``generation`` current; close the replaced one once no request uses it
        (at most its interceptor timeout plus the shutdown grace later)."""
        old = self.generations.switch(generation)
        for sink in self._sinks():  # a reload may be the first to ask for one
            starting = asyncio.get_running_loop().create_task(sink.start())
            self._retiring.add(starting)
            starting.add_done_callback(self._retiring.discard)
        if self._listener_tls is not None and generation.client_tls is not None:
            self._listener_tls.use(generation.client_tls)
        kept = {id(interceptor) for _, interceptor in generation.produce.interceptors()}
        replaced = [(name, interceptor) for name, interceptor in old.produce.interceptors()
                    if id(interceptor) not in kept]
        if self.metrics is not None:
            self.metrics.config_generation.set(generation.number)
            self.metrics.interceptors_replaced(replaced)
        patience = (old.config.interceptor.timeout_ms + old.config.shutdown_grace_ms) / 1000
        task = asyncio.get_running_loop().create_task(
            self._retire(old, patience, replaced,
                         keep_observers=old.observers is generation.observers))
        self._retiring.add(task)
        task.add_done_callback(self._retiring.discard)

    async def _retire(self, old: Generation, patience: float,
                      replaced: list[tuple[str, Any]], *, keep_observers: bool) -> None:
        try:
            if not await self.generations.retire(old, patience):
                log.warning("configuration generation %d still had %d request(s) after "
                            "%.0f s; closing it anyway", old.number,
                            self.generations.in_use(old), patience)
        finally:  # also when shutdown cuts the wait short
            if self.metrics is not None:  # their counters go on in the next instances'
                self.metrics.interceptors_closed(replaced)
            await close_generation(old, keep_observers=keep_observers)

    def _client_stream(self, node_id: int | None) -> FrameStream:
        mode = self.config.listener.proxy_protocol
        return FrameStream(self.config.max_frame_size, partial(self._accept, node_id=node_id),
                           self.receive_budget,
                           proxy_header="refuse" if mode == "off" else "read")

    # ------------------------------------------------------------------ listeners

    async def start(self) -> None:
        """Open the bootstrap listener."""
        server = await asyncio.get_running_loop().create_server(
            partial(self._client_stream, None),
            self.listen_host, self._listen_port,
            reuse_address=True, reuse_port=self.config.workers > 1 or None,
            ssl=self._listener_tls.front if self._listener_tls is not None else None,
        )
        self._servers[None] = server
        self._listen_port = server.sockets[0].getsockname()[1]
        if self.config.broker_port_start is None and self.config.listen_address[1] == 0:
            self.nodes.broker_port_start = self._listen_port + 1
        self.started_at = time.time()
        log.info("kiproxy %s (upstream %s)", self._listening(server),
                 ", ".join(self.config.upstream))
        if self._watch is not None:
            self._watch.start()
        self._sweeper = asyncio.create_task(self._close_idle())
        for sink in self._sinks():
            await sink.start()
        self._trim_task = asyncio.create_task(self._trimmer.run())
        if self.config.metrics_listen is not None and self.metrics is not None:
            guard = AdminGuard(self.config.admin.token_file, self.metrics.admin_refused)
            self._health = HealthServer(self.metrics, self.readiness, reload=self._http_reload,
                                        config=self.config_view, guard=guard)
            await self._health.start(*self.config.metrics_listen_address)
            log.info("metrics and health checks on http://%s/metrics", self._health.address)
        # Listeners first, then outbound connections: discovery's ephemeral source
        # ports must not take a port this process is about to listen on.
        await self._learn_nodes()
        self._reopening = asyncio.create_task(self._keep_listeners_open())

    async def _learn_nodes(self) -> None:
        """Open the node listeners before clients come back (see :mod:`proxy.discovery`).

        Waits a few seconds at most; if no upstream answers by then, keeps trying in
        the background until one does or a client's Metadata has taught the nodes.
        """
        self._discovery = asyncio.create_task(self._keep_discovering())
        await asyncio.wait({self._discovery}, timeout=_DISCOVERY_WAIT)

    async def _discover_once(self, retry: bool = False) -> bool:
        try:
            count = await discover_nodes(
                self.upstreams, self.nodes, partial(learn_topic_ids, self.topic_names),
                max_response_size=self.config.max_response_size)
        except Exception as exc:  # never fatal: clients' Metadata opens the listeners too
            reason = exc if isinstance(exc, DiscoveryError) else repr(exc)
            # Warn once; a broker that requires SASL before Metadata fails every retry.
            log.log(logging.DEBUG if retry else logging.WARNING,
                    "could not learn the cluster's nodes from the upstream brokers (%s); "
                    "retrying, and node listeners open as clients fetch metadata", reason)
            return False
        unopened = self.nodes.unopened
        opened = ", ".join(f"{n}->{p}" for n, p in sorted(
            (k, v) for k, v in self.listener_ports.items() if k is not None))
        log.log(logging.WARNING if unopened else logging.INFO,
                "learned %d broker node(s) from upstream; %s%s", count,
                f"node listeners {opened}" if opened else "no node listener open",
                "".join(f"; node {n} has none (port {p} could not be opened)"
                        for n, (p, _) in sorted(unopened.items())))
        return True

    async def _keep_discovering(self) -> None:
        delay, retry = 1.0, False
        while not await self._discover_once(retry):
            await asyncio.sleep(delay)
            if self.nodes.known_nodes:
                return
            delay, retry = min(delay * 2, 30.0), True

    async def _keep_listeners_open(self) -> None:
        """Try again, every :data:`LISTENER_RETRY` seconds, the node listeners that could
        not be opened (another process held the port)."""
        while True:
            await asyncio.sleep(LISTENER_RETRY)
            await self.nodes.reopen_failed()

    def listener_problem(self) -> str | None:
        """Why some known broker node has no listener (clients sent to it would find
        nothing), or ``None`` when every one is open."""
        unopened = self.nodes.unopened
        if not unopened:
            return None
        return "; ".join(
            f"node {node_id} has no listener on port {port}: {why}"
            for node_id, (port, why) in sorted(unopened.items())) + (
            f" (retrying every {LISTENER_RETRY:g} s; free the port, or set node_ports or "
            "broker_port_start to free ports)")

    @property
    def metrics_address(self) -> str | None:
        """``host:port`` of the metrics endpoint, when it is open."""
        return self._health.address if self._health is not None else None

    async def readiness(self) -> str | None:
        """``None`` when ready to carry traffic, else why not: the interceptor is not
        loaded, a known broker node has no listener, or no upstream broker accepts a
        connection."""
        generation = self.generation
        if self.config.interceptor.class_name and not (generation.produce.intercepts
                                                       or generation.fetch.hooks):
            return "the interceptor is not loaded"  # on neither side (a fetch-only one: fetch)
        unopened = self.listener_problem()
        if unopened is not None:
            return unopened
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

    def _listening(self, server: asyncio.Server) -> str:
        """What the start-up line says of the bootstrap listener: the address it is bound
        to, with TLS or mTLS, and the bootstrap address clients are given when that is
        another one (``advertised_host``)."""
        host, port = server.sockets[0].getsockname()[:2]
        bound = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
        tls = self.config.tls
        said = f"listening on {bound}"
        if self._listener_tls is not None:
            said += " with mTLS" if tls.client_ca is not None else " with TLS"
        if self.bootstrap_address != bound:
            said += f", bootstrap address {self.bootstrap_address}"
        return said

    @property
    def bootstrap_address(self) -> str:
        """``host:port`` clients should use as ``bootstrap.servers``."""
        return f"{self.nodes.advertised_host}:{self._listen_port}"

    async def _open_node_listener(self, node_id: int, port: int) -> None:
        try:
            server = await asyncio.get_running_loop().create_server(
                partial(self._client_stream, node_id),
                self.listen_host, port,
                reuse_address=True, reuse_port=self.config.workers > 1 or None,
                ssl=self._listener_tls.front if self._listener_tls is not None else None,
            )
        except OSError as exc:
            # Once per reason, not once per try: it is tried again every LISTENER_RETRY s.
            first = self._listener_failures.get(node_id) != str(exc)
            self._listener_failures[node_id] = str(exc)
            log.log(logging.ERROR if first else logging.DEBUG,
                    "cannot open listener port %d for node %d: %s (retrying every %g s, "
                    "not ready until it opens; free the port, or set node_ports or "
                    "broker_port_start to free ports)", port, node_id, exc, LISTENER_RETRY)
            raise
        self._servers[node_id] = server
        if self._listener_failures.pop(node_id, None) is not None:
            log.info("opened listener port %d for node %d", port, node_id)

    @property
    def listener_ports(self) -> dict[int | None, int]:
        """Open listeners: node id (``None`` for bootstrap) -> port."""
        return {k: s.sockets[0].getsockname()[1] for k, s in self._servers.items() if s.sockets}

    async def _close_idle(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            idle = self.config.idle_timeout_ms / 1000  # the current generation's (0: off)
            await asyncio.sleep(min(max(idle / 4, 0.05), 5.0) if idle else 1.0)
            if not idle:
                continue
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

    def _identity(self, client: FrameStream) -> ClientIdentity:
        """What is known of a client as it connects: its address, listener and certificate."""
        peer = client.get_extra_info("peername")
        host, port = (str(peer[0]), int(peer[1])) if peer else ("unknown", 0)
        subject: str | None = None
        sans: tuple[tuple[str, str], ...] = ()
        if self._listener_tls is not None and self.config.tls.client_ca is not None:
            cert = client.get_extra_info("peercert")
            subject = principal_from_peercert(cert)
            sans = tuple((str(k), str(v)) for k, v in (cert or {}).get("subjectAltName", ()))
        return ClientIdentity(client_host=host, client_port=port, peer_host=host,
                              peer_port=port, listener=self.config.listener.name,
                              tls_subject=subject, tls_sans=sans, principal=subject)

    async def _client_behind(self, client: FrameStream,
                             identity: ClientIdentity) -> ClientIdentity | None:
        """The identity once the PROXY header (if the listener reads one) is judged; None
        when the connection is refused (logged once, and closed)."""
        listener = self.config.listener
        if listener.proxy_protocol == "off":
            return identity  # the stream itself refuses a header (proxy_header="refuse")
        self._prefacing.add(client)
        try:
            parsed = await client.read_proxy_header(listener.proxy_protocol_timeout_ms / 1000)
        finally:
            self._prefacing.discard(client)
        decision = accept_proxy_header(
            listener.proxy_protocol, self.generation.proxy_trusted,
            (identity.peer_host, identity.peer_port), parsed)
        if isinstance(decision, Refuse):
            _refusals.warning((listener.name, identity.peer_host, decision.kind),
                              "closing connection on "
                              "listener %s: %s", listener.name, decision.reason,
                              more=MORE_IN_INTERVAL)
            if self.metrics is not None:
                self.metrics.client_errors.inc()
            client.transport.abort()
            return None
        if isinstance(decision, UseHeader):
            host, port = decision.client
            return dataclasses.replace(identity, client_host=host, client_port=port,
                                       via_proxy_protocol=True)
        return identity

    async def _accept(self, client: FrameStream, node_id: int | None) -> None:
        if len(self.connections) >= self.config.max_connections:
            _refusals.warning("max_connections", "refusing client %s: max_connections (%d) "
                              "reached", self._identity(client).client_address,
                              self.config.max_connections, more=MORE_IN_INTERVAL)
            if self.metrics is not None:
                self.metrics.refused_connections.inc()
            client.transport.abort()
            return
        identity = await self._client_behind(client, self._identity(client))
        if identity is None:
            return
        conn = ClientConnection(self.services, client, node_id, identity)
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

    # ------------------------------------------------------------------ shutdown

    async def stop(self, grace: float | None = None) -> None:
        """Stop accepting, let owed responses go out for ``grace`` seconds, then close all."""
        if grace is None:
            grace = self.config.shutdown_grace_ms / 1000
        # Discovery and the listener retry first: either could open a listener after
        # the others are closed.
        for task in (self._discovery, self._reopening):
            if task is not None:
                task.cancel()
        self.nodes.stop_opening()
        for server in self._servers.values():
            server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
        if self._watch is not None:
            await self._watch.stop()
        if self._trim_task is not None:
            self._trim_task.cancel()
        for stream in list(self._prefacing):
            stream.transport.abort()
        for conn in list(self.connections):
            await conn.stop_reading()
        deadline = time.monotonic() + grace
        while any(not c.idle for c in self.connections) and time.monotonic() < deadline:
            await asyncio.sleep(0.02)
        _report_abandoned([c for c in self.connections if not c.idle], grace)
        await asyncio.gather(*(c.close() for c in list(self.connections)),
                             return_exceptions=True)
        for server in self._servers.values():
            with contextlib.suppress(Exception):
                await asyncio.wait_for(server.wait_closed(), 1)
        for task in list(self._retiring):
            task.cancel()
        await asyncio.gather(*self._retiring, return_exceptions=True)
        await close_generation(self.generation)  # the observers offer their last events
        # What is queued, each within its close_timeout_ms, the sinks side by side.
        await asyncio.gather(*(sink.close() for sink in self._sinks()))
        self.offload.close()
        if self._health is not None:
            await self._health.stop()
        log.info("kiproxy stopped")


def _report_abandoned(busy: list[ClientConnection], grace: float) -> None:
    """One WARNING for the requests a shutdown closes unanswered once its grace ran out
    (their producers retry them elsewhere, or report them failed)."""
    if not busy:
        return
    named = ", ".join(f"{c.client_address} (client_id {c.client_id!r}, {c.owed})"
                      for c in busy[:5])
    more = f" and {len(busy) - 5} more" if len(busy) > 5 else ""
    log.warning("shutdown grace of %d ms ran out: closing %d client connection(s) with %d "
                "request(s) unanswered: %s%s", grace * 1000, len(busy),
                sum(c.owed for c in busy), named, more)


async def _post_reload(host: str, port: int, authorization: str | None) -> dict[str, Any]:
    """``POST /reload?scope=local`` to another worker's metrics endpoint; its JSON answer."""
    auth = f"Authorization: {authorization}\r\n" if authorization else ""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), 5)
        writer.write(f"POST /reload?scope=local HTTP/1.0\r\nHost: {host}\r\n{auth}"
                     "Content-Length: 0\r\n\r\n".encode())
        await writer.drain()
        raw = await asyncio.wait_for(reader.read(), 120)
        writer.close()
        answer = json.loads(raw.partition(b"\r\n\r\n")[2] or b"{}")
        return answer if isinstance(answer, dict) else {"ok": False, "message": str(answer)}
    except (OSError, TimeoutError, ValueError) as exc:
        return {"ok": False, "message": f"worker at {host}:{port} did not answer: {exc}"}
