"""One client connection and its upstream broker connection.

Contracts, in the order a newcomer needs them:

* Requests are handled one at a time in arrival order, so what reaches the
  broker keeps the client's order (idempotent producers depend on it). A slow
  interceptor therefore slows only its own client: the proxy stops reading
  that socket and TCP pushes back.
* Many requests may be in flight. Each request that expects an answer takes a
  slot in a FIFO; answers leave strictly in slot order, whether the broker sent
  them or the proxy made them itself (a produce request rejected whole waits
  behind earlier in-flight responses). acks=0 produce requests take no slot.
* An answer with an asynchronous transform (a Fetch answer through the fetch-side
  hooks, :mod:`kiproxy.proxy.fetch.pipeline`) fills its slot when the transform is
  done; the answers behind it wait, so the order holds. A transform that fails
  (not a hook: the hooks' faults become partition errors) closes the connection.
* At most ``max_in_flight`` slots per connection: reads pause when it is
  reached, bounding the memory a connection can hold.
* Bytes buffered from clients are bounded per connection (a frame above
  ``max_frame_size`` closes it; a partial frame holds only what arrived) and per
  process (``max_client_buffered_bytes``: :mod:`kiproxy.proxy.net.buffers` pauses the
  socket of a connection that would pass it). Decoding a large batch runs off the
  loop within ``max_decode_memory`` (:mod:`kiproxy.proxy.produce.offload`); the connection
  waits for it as it waits for its interceptor, so order is unchanged.
* A malformed or oversized frame from the client closes that client only, with
  one log line naming the client. An upstream that closes or cannot be reached
  closes its client; clients reconnect.

* Each request runs under the configuration generation that is current when
  it is read (:mod:`kiproxy.proxy.generation`): a reload never changes the
  interceptor, observers or limits of a request already under way, and never
  closes a connection.
* The connection holds what it needs, never the server: a frozen
  :class:`ConnectionServices` (dispatcher, upstreams, the generation cell, metrics)
  and the client's :class:`~kiproxy.interceptors.identity.ClientIdentity`, a
  frozen value replaced when something about the client is learned (its
  ``client.id``, a SASL exchange decided). SASL bookkeeping is the
  connection's own.

Both sockets are read by a :class:`~kiproxy.proxy.net.frame_stream.FrameStream`. A
frame in its own buffer is a ``bytearray``; it is turned into ``bytes`` before
anything decodes it (kio and the record codec read only ``bytes``; records are
decoded where they lie in the frame), so the only
``bytearray`` a handler sees is a Produce request on a pipeline that neither
intercepts nor tallies, which only scans it for acks and forwards it
(:func:`kiproxy.proxy.dispatch.kept_as_received`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from kiproxy.interceptors.errors import error_name
from kiproxy.interceptors.identity import ClientIdentity
from kiproxy.interceptors.observer import PartitionSummary, RequestInfo, ResponseInfo
from kiproxy.protocol.errors import ProtocolError
from kiproxy.protocol.framing import RequestHeader, parse_request_header
from kiproxy.protocol.messages import api_name
from kiproxy.proxy.brokers.failures import connect_error
from kiproxy.proxy.dispatch import kept_as_received
from kiproxy.proxy.net.frame_stream import Frame, FrameStream
from kiproxy.proxy.net.sasl import SaslRound, SaslTracker, identity_after_sasl
from kiproxy.proxy.produce.disposition import Answer, Forward

if TYPE_CHECKING:
    from kiproxy.proxy.brokers.nodes import NodeRegistry
    from kiproxy.proxy.brokers.upstreams import Upstreams
    from kiproxy.proxy.dispatch import RequestDispatcher
    from kiproxy.proxy.generation import Generation, GenerationCell
    from kiproxy.proxy.observe.metrics import Metrics
    from kiproxy.proxy.routes.table import ClientRoutes, RouteTable

log = logging.getLogger("kiproxy.connection")

__all__ = ["ClientConnection", "ConnectionServices"]

_INT32 = struct.Struct(">i")
_JOIN_BELOW = 16 * 1024
"""Writes below this many bytes are joined into one ``bytes``: uvloop sends a single buffer
straight away, a list of them costs a write context per call. Larger ones are not copied."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ConnectionServices:
    """What a client connection may use: handed to it, shared by all connections."""

    generations: GenerationCell
    """The current configuration generation, read at the start of each request."""
    dispatcher: RequestDispatcher
    """Decides what happens to each request."""
    upstreams: Upstreams
    """Where broker connections go."""
    nodes: NodeRegistry
    """The broker nodes and their proxy listeners (settled before answers leave)."""
    metrics: Metrics | None
    """Prometheus metrics, when ``metrics_listen`` is set."""

class _UpstreamLost(Exception):
    """The broker connection broke while a request was being written to it."""


class _ClientGone(ConnectionResetError):
    """The client closed its connection while answers were owed to it."""


class _Slot:
    """A place in the response order, filled when the response is known."""

    __slots__ = ("api", "done", "frame", "generation", "info", "produce", "proxy_answer", "t0")

    def __init__(self, generation: Generation, api: str = "", t0: float = 0.0,
                 info: RequestInfo | None = None, produce: list[PartitionSummary] | None = None,
                 proxy_answer: bool = False) -> None:
        self.frame: Frame | None = None
        self.done = False
        self.generation = generation
        self.api = api
        self.t0 = t0
        self.info = info
        self.produce = produce
        self.proxy_answer = proxy_answer


class ClientConnection:
    """Carries one client's traffic to its broker and back, in order."""

    def __init__(self, services: ConnectionServices, client: FrameStream, node_id: int | None,
                 identity: ClientIdentity) -> None:
        self._services = services
        self.node_id = node_id
        """The broker node this connection stands for; ``None`` for bootstrap."""
        self._client = client
        self._writer = client.transport
        self.identity = identity
        """Who the client is, as the proxy knows it now (replaced, never changed)."""
        self.sasl = SaslTracker()
        """The connection's SASL bookkeeping."""
        self._routes: tuple[ClientIdentity, RouteTable, ClientRoutes] | None = None
        self._upstream: FrameStream | None = None
        self._slots: deque[_Slot] = deque()
        self._pending: deque[tuple[int, _Slot, Callable[[bytes], bytes] | None,
                                   Callable[[bytes], bytes | Awaitable[bytes]] | None]
                             ] = deque()
        self._transforms: set[asyncio.Task[None]] = set()
        self._room = asyncio.Event()
        self._room.set()
        self._closed = False
        self._upstream_reported = False
        self._handling = False
        self._stopping = False
        self._slot_taken = False
        self._in_read = False
        self._read_task: asyncio.Task[None] | None = None
        self._up_task: asyncio.Task[None] | None = None
        self.upstream_address: tuple[str, int] | None = None
        self._tried = ""
        """The upstream address tried last (named when none could be reached)."""
        self.last_activity = asyncio.get_running_loop().time()
        """Loop time of the last whole request or response (a trickle of bytes is no activity)."""
        limit = services.generations.current.config.max_buffered_bytes
        self._writer.set_write_buffer_limits(high=limit, low=limit // 4)

    @property
    def client_address(self) -> str:
        """``host:port`` of the original client."""
        return self.identity.client_address

    @property
    def client_id(self) -> str | None:
        """The client id of the latest request."""
        return self.identity.client_id

    @property
    def principal(self) -> str | None:
        """The authenticated principal, when the proxy knows it."""
        return self.identity.principal

    def routes(self, table: RouteTable) -> ClientRoutes:
        """The routes of ``table`` that hold for this client, kept until the identity or
        the table (a reload) changes."""
        cached = self._routes
        if cached is not None and cached[0] is self.identity and cached[1] is table:
            return cached[2]
        found = table.for_client(self.identity)
        self._routes = (self.identity, table, found)
        return found

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Connect upstream, then carry traffic until either side closes."""
        try:
            await self._connect_upstream()
        except OSError as exc:
            if self._services.metrics is not None:
                self._services.metrics.upstream_errors.labels("connect").inc()
            upstreams = self._services.upstreams
            upstreams.failures.failed(
                self._tried, connect_error(exc, upstreams.connect_timeout),
                self.client_address, self.log_context)
            await self._close_client()
            return
        limit = self._services.generations.current.config.max_buffered_bytes
        assert self._upstream is not None
        if not self._upstream.transport.is_closing():
            # A broker that closed already (it is shutting down) is seen by the reader.
            self._upstream.transport.set_write_buffer_limits(high=limit, low=limit // 4)
        self._up_task = asyncio.create_task(self._read_upstream())
        self._read_task = asyncio.current_task()
        try:
            await self._read_client()
        except asyncio.CancelledError:
            if not self._stopping:
                raise
        finally:
            if self._stopping:
                await self._wait_flushed()
            await self.close()

    def _target_description(self) -> str:
        return "bootstrap" if self.node_id is None else f"for node {self.node_id}"

    async def _connect_upstream(self) -> None:
        upstreams = self._services.upstreams
        candidates = (
            upstreams.bootstrap_candidates() if self.node_id is None
            else [upstreams.for_node(self.node_id)]
        )
        max_response = self._services.generations.current.config.max_response_size
        last: OSError = OSError("no upstream address known")
        self._tried = self._target_description()
        for address in candidates:
            if address is None:
                continue
            self._tried = f"{address[0]}:{address[1]}"
            try:
                _, upstream = await upstreams.open(
                    *address, partial(FrameStream, max_response))
                self._upstream = upstream
                self.upstream_address = address
                return
            except (OSError, TimeoutError) as exc:
                last = exc  # TimeoutError is an OSError
        raise last

    @property
    def idle(self) -> bool:
        """No response is owed to the client and no request is being handled."""
        return not self._slots and not self._handling

    async def stop_reading(self) -> None:
        """Stop reading new requests; the connection closes once owed responses are sent."""
        self._stopping = True
        if self._in_read and self._read_task is not None:
            self._read_task.cancel()

    async def _wait_flushed(self) -> None:
        while self._slots and not self._closed:
            self._room.clear()
            await self._room.wait()

    async def close(self) -> None:
        """Close both sockets; owed responses are dropped."""
        if self._closed:
            return
        self._closed = True
        self._room.set()
        while self._slots:  # answers that will never leave hold no generation
            self._services.generations.release(self._slots.popleft().generation)
        if self._up_task is not None and self._up_task is not asyncio.current_task():
            self._up_task.cancel()
        for task in tuple(self._transforms):
            if task is not asyncio.current_task():
                task.cancel()
        if self._upstream is not None:
            with contextlib.suppress(Exception):
                await self._upstream.close()
        await self._close_client()

    async def _close_client(self) -> None:
        with contextlib.suppress(Exception):
            await self._client.close()

    # ------------------------------------------------------------------ client side

    async def _read_client(self) -> None:
        client = self._client
        loop = asyncio.get_running_loop()
        while not self._closed and not self._stopping:
            self._in_read = True
            try:
                # A client that does not read its responses stops being read from
                # once max_buffered_bytes of them wait in the socket buffer.
                if not client.drained:
                    await client.drain()
                frames = await client.read()
            except (ConnectionError, OSError, TimeoutError):
                return  # the client went away (reset, TLS error or TLS shutdown timeout)
            except ProtocolError as exc:
                self._bad_client(exc)
                return
            finally:
                self._in_read = False
            if not frames:
                return
            self.last_activity = loop.time()
            try:
                # Taken out of the list one by one: a frame turned into bytes for
                # decoding leaves no second copy alive here while it is handled.
                frames.reverse()
                while frames:
                    rest = self._handle_request(frames.pop())
                    if rest is not None:
                        await rest
                    if self._closed:
                        return
            except ProtocolError as exc:
                self._bad_client(exc)
                return
            except _UpstreamLost as exc:
                # The broker connection broke while a request was being forwarded; the
                # upstream reader may not have noticed yet. Same line, same counter.
                self._upstream_failed(f"connection failed: {exc}")
                return
            except ConnectionError:
                return  # the client went away while its answer was being written

    def _bad_client(self, exc: ProtocolError) -> None:
        if self._services.metrics is not None:
            self._services.metrics.client_errors.inc()
        log.warning("closing client %s (client_id %r): %s",
                    self.client_address, self.client_id, exc, extra=self.log_context)

    def _handle_request(self, frame: Frame) -> Coroutine[Any, Any, None] | None:
        """Handle one request: in this call when nothing in it waits (a pass-through
        Produce request with room in flight, forwarded to a drained upstream); else
        returns the coroutine of the rest (:meth:`_handle_rest`), which the caller awaits
        at once, and which then owns the generation."""
        generations = self._services.generations
        generation = generations.acquire()
        self._slot_taken = False
        rest: Coroutine[Any, Any, None] | None = None
        try:
            header = parse_request_header(frame)
            if type(frame) is not bytes and not kept_as_received(generation, header):
                frame = bytes(frame)
            if header.client_id is not None and header.client_id != self.identity.client_id:
                self.identity = dataclasses.replace(self.identity, client_id=header.client_id)
            metrics = self._services.metrics
            hub = generation.observers
            # Latency is measured only for the metrics and the observers: no clock read otherwise.
            t0 = time.monotonic() if metrics is not None or hub.active else 0.0
            api = ""
            if metrics is not None:
                api = api_name(header.api_key)
                metrics.messages.labels("request", api).inc()
                metrics.bytes.labels("request", api).inc(len(frame))
            info: RequestInfo | None = None
            if hub.active:
                info = RequestInfo(
                    api_key=header.api_key, api_name=api or api_name(header.api_key),
                    api_version=header.api_version, correlation_id=header.correlation_id,
                    client_id=header.client_id, client_address=self.client_address,
                    principal=self.principal, size=len(frame),
                    received_at_ms=int(time.time() * 1000), node_id=self.node_id,
                )
                hub.request(info)
            request = cast(bytes, frame)  # a bytearray is forwarded untouched (kept_as_received)
            forward = (self._services.dispatcher.at_once(self, generation, header, request)
                       if len(self._slots) < generation.config.max_in_flight
                       and not self._closed else None)
            if forward is None:
                rest = self._handle_rest(generation, header, request, api, t0, info)
                return rest
            self._forward(generation, header, forward, api, t0, info)
            assert self._upstream is not None
            if not self._upstream.drained:
                rest = self._drain_upstream()
            return rest
        finally:
            # A slot taken for the answer holds the generation until the answer leaves
            # (or the connection closes); otherwise the request is done with it here.
            if rest is None and not self._slot_taken:
                generations.release(generation)

    async def _handle_rest(self, generation: Generation, header: RequestHeader,
                           request: bytes, api: str, t0: float,
                           info: RequestInfo | None) -> None:
        """What :meth:`_handle_request` could not do at once: wait for room in flight,
        the dispatcher's decision, and the socket it was written to."""
        generations = self._services.generations
        try:
            while len(self._slots) >= generation.config.max_in_flight and not self._closed:
                self._room.clear()
                await self._room.wait()
            self._handling = True  # a request in the interceptor is owed an answer too
            try:
                disposition = await self._services.dispatcher.dispatch(
                    self, generation, header, request)
            finally:
                self._handling = False
            if self._closed:
                return
            if isinstance(disposition, Answer):
                if disposition.frame is not None:
                    slot = _Slot(generation, api, t0, info, disposition.produce, proxy_answer=True)
                    self._slots.append(slot)
                    self._slot_taken = True
                    self._complete(slot, disposition.frame)
                    await self._client.drain()
                elif info is not None or self._services.metrics is not None:
                    self._report(_Slot(generation, api, t0, info, disposition.produce,
                                       proxy_answer=True), 0)
                return
            self._forward(generation, header, disposition, api, t0, info)
            assert self._upstream is not None
            if not self._upstream.drained:
                await self._drain_upstream()
        finally:
            if not self._slot_taken:
                generations.release(generation)

    async def _drain_upstream(self) -> None:
        assert self._upstream is not None
        try:
            await self._upstream.drain()
        except ConnectionError as exc:
            raise _UpstreamLost(str(exc) or type(exc).__name__) from exc

    def _forward(self, generation: Generation, header: RequestHeader, disposition: Forward,
                 api: str = "", t0: float = 0.0, info: RequestInfo | None = None) -> None:
        if disposition.expect_response:
            slot = _Slot(generation, api, t0, info, disposition.produce)
            self._slots.append(slot)
            self._slot_taken = True
            self._pending.append((header.correlation_id, slot, disposition.on_response,
                                  disposition.transform))
        assert self._upstream is not None
        up = self._upstream.transport
        if up.is_closing():
            # writelines() on a closed transport raises RuntimeError under uvloop.
            raise _UpstreamLost("the broker connection is closed")
        frame = disposition.frame
        size = len(frame)
        if size < _JOIN_BELOW:
            up.write(_INT32.pack(size) + frame)
        else:
            up.writelines((_INT32.pack(size), frame))
        if not disposition.expect_response and (info is not None
                                                or self._services.metrics is not None):
            self._report(_Slot(generation, api, t0, info, disposition.produce), 0)

    def _report(self, slot: _Slot, size: int) -> None:
        """Count a response and tell the observers (``size`` 0: none was sent)."""
        metrics = self._services.metrics
        if metrics is not None:
            if size:
                metrics.messages.labels("response", slot.api).inc()
                metrics.bytes.labels("response", slot.api).inc(size)
            metrics.request_latency.labels(slot.api).observe(time.monotonic() - slot.t0)
            if slot.produce:
                for d in slot.produce:
                    metrics.produce_batches.labels(d.topic, d.outcome).inc(d.batches)
                    metrics.produce_records.labels(d.topic, d.outcome).inc(d.records)
                    metrics.produce_bytes.labels(d.topic, d.outcome).inc(d.bytes)
                    if d.route is not None:
                        metrics.route_batches.labels(d.route, d.outcome).inc(d.batches)
                        metrics.route_records.labels(d.route, d.outcome).inc(d.records)
                        if d.outcome == "rejected":
                            metrics.route_rejections.labels(
                                d.route, error_name(d.error_code)).inc()
        if slot.info is not None:
            slot.generation.observers.response(ResponseInfo(
                request=slot.info, size=size,
                latency_ms=(time.monotonic() - slot.t0) * 1000,
                answered_by_proxy=slot.proxy_answer,
                produce=tuple(slot.produce or ()),
            ))

    def _complete(self, slot: _Slot, frame: Frame) -> None:
        slot.frame = frame
        slot.done = True
        self._send_ready()

    def _send_ready(self) -> None:
        """Write every response now at the head of the order, in one write.

        Raises :class:`_ClientGone` (a ``ConnectionError``) when the client has
        closed its connection: its answers have nowhere to go, and the callers
        close the connection as for any client that leaves.
        """
        slots = self._slots
        if not slots or not slots[0].done:
            return
        if self._writer.is_closing():
            # uvloop raises RuntimeError on a write to a closed transport; asyncio
            # drops it. Either way this is a client that left, not a proxy failure.
            log.debug("client %s (client_id %r) went away before %d answer(s) could be "
                      "sent; closing", self.client_address, self.client_id,
                      sum(1 for s in slots if s.done), extra=self.log_context)
            raise _ClientGone("the client closed the connection")
        out: list[Frame] = []
        total = 0
        while slots and slots[0].done:
            done = slots.popleft()
            self._services.generations.release(done.generation)
            frame = done.frame
            assert frame is not None
            size = len(frame)
            out.append(_INT32.pack(size))
            out.append(frame)
            total += size
            done.frame = None
            if done.generation.produce.tallies:
                self._report(done, size)
        if total < _JOIN_BELOW:
            self._writer.write(b"".join(out))
        else:
            self._writer.writelines(out)
        if len(slots) < self._services.generations.current.config.max_in_flight:
            self._room.set()

    # ------------------------------------------------------------------ upstream side

    async def _read_upstream(self) -> None:
        upstream = self._upstream
        assert upstream is not None
        reason: str | None = "closed the connection"
        try:
            while not self._closed:
                frames = await upstream.read()
                if not frames:
                    break
                ready = []
                for frame in frames:
                    matched = self._match_response(frame)
                    if matched is not None:
                        ready.append(matched)
                nodes = self._services.nodes
                if nodes.unsettled:
                    await nodes.settle()
                for slot, frame in ready:
                    slot.frame = frame
                    slot.done = True
                # _deliver() without its coroutine when the client's socket takes it all.
                try:
                    self._send_ready()
                    gone = not self._client.drained and not await self._deliver()
                except (ConnectionError, OSError, TimeoutError):
                    gone = True
                if gone:
                    reason = None  # the client went away, not the broker: close quietly
                    break
        except ProtocolError as exc:
            reason = f"sent a response the proxy cannot carry: {exc}"
        except (ConnectionError, OSError) as exc:
            reason = f"connection failed: {exc}"
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # never leave the client waiting on a dead reader
            log.exception("answer from %s to client %s could not be handled; closing it",
                          self._upstream_name(), self.client_address, extra=self.log_context)
            reason = f"sent a response the proxy failed on: {exc!r}"
        if not self._closed:
            if reason is not None:
                self._upstream_failed(reason)
            if self._read_task is not None:
                self._read_task.cancel()
            await self.close()

    def _upstream_failed(self, reason: str) -> None:
        """Count and log a lost broker connection once; the caller closes the client."""
        if self._closed or self._upstream_reported:
            return
        self._upstream_reported = True
        broken = reason != "closed the connection" or bool(self._slots)
        if broken and self._services.metrics is not None:
            self._services.metrics.upstream_errors.labels("broken").inc()
        log.log(logging.WARNING if broken else logging.INFO,
                "upstream %s %s; closing client %s (client_id %r)",
                self._upstream_name(), reason, self.client_address, self.client_id,
                extra=self.log_context)

    def _upstream_name(self) -> str:
        if self.upstream_address is None:
            return "broker"
        return f"broker {self.upstream_address[0]}:{self.upstream_address[1]}"

    def _match_response(self, frame: Frame) -> tuple[_Slot, Frame] | None:
        if len(frame) < 4:
            raise ProtocolError(f"response of {len(frame)} bytes has no correlation id")
        (correlation_id,) = _INT32.unpack_from(frame, 0)
        if not self._pending:
            raise ProtocolError(f"response with correlation id {correlation_id} "
                                "answers no request")
        expected, slot, on_response, transform = self._pending.popleft()
        if correlation_id != expected:
            raise ProtocolError(f"response correlation id {correlation_id} where "
                                f"{expected} was next")
        if transform is not None:
            changed = transform(frame if type(frame) is bytes else bytes(frame))
            if not isinstance(changed, (bytes, bytearray)):
                # Awaited: the slot is filled when it is done.
                task = asyncio.get_running_loop().create_task(
                    self._transform(slot, changed, on_response))
                self._transforms.add(task)
                task.add_done_callback(self._transforms.discard)
                return None
            frame = changed
        if on_response is not None:
            # Rewriters decode with kio, which reads only immutable buffers.
            return slot, on_response(frame if type(frame) is bytes else bytes(frame))
        return slot, frame

    async def _transform(self, slot: _Slot, transformed: Awaitable[bytes],
                         then: Callable[[bytes], bytes] | None) -> None:
        """Fill ``slot`` with what ``transformed`` gives (then ``then`` makes of it), and
        send what is ready; a transform that fails closes the connection as an answer
        the proxy cannot carry does."""
        try:
            out = await transformed
            if then is not None:
                out = then(out)
            nodes = self._services.nodes
            if nodes.unsettled:
                await nodes.settle()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if self._closed:
                return
            if isinstance(exc, ProtocolError):
                reason = f"sent a response the proxy cannot carry: {exc}"
            else:
                log.exception("answer from %s to client %s could not be handled; closing it",
                              self._upstream_name(), self.client_address,
                              extra=self.log_context)
                reason = f"sent a response the proxy failed on: {exc!r}"
            self._upstream_failed(reason)
            await self.close()
            return
        if self._closed:
            return
        slot.frame = out
        slot.done = True
        if not await self._deliver():
            await self.close()  # the client went away

    async def _deliver(self) -> bool:
        """Send the answers now ready and wait until the client's socket drains; False
        when the client has gone away."""
        try:
            self._send_ready()
            if not self._client.drained:
                await self._client.drain()
        except (ConnectionError, OSError, TimeoutError):
            return False
        return True

    # ------------------------------------------------------------------ SASL

    def sasl_answered(self, sasl_round: SaslRound | None, version: int, flexible: bool,
                      frame: bytes) -> bytes:
        """Learn (or forget) the principal from a SaslAuthenticate answer (see
        :func:`~kiproxy.proxy.net.sasl.identity_after_sasl`); pass the answer on unchanged."""
        self.identity = identity_after_sasl(self.identity, self.sasl, sasl_round, version,
                                            flexible, frame, self.log_context)
        return frame

    @property
    def log_context(self) -> dict[str, object]:
        """``extra=`` fields of connection-level log lines."""
        return {"client_address": self.client_address, "client_id": self.client_id,
                "principal": self.principal, "node_id": self.node_id}
