"""One client connection and its upstream broker connection: the request side.

Contracts, in the order a newcomer needs them (those of the answers, from the broker
back to the client, are in :mod:`kiproxy.proxy.answers`):

* Requests are handled one at a time in arrival order, so what reaches the
  broker keeps the client's order (idempotent producers depend on it). A slow
  interceptor therefore slows only its own client: the proxy stops reading
  that socket and TCP pushes back.
* Many requests may be in flight. Each request that expects an answer takes a
  slot in the answer order (:class:`~kiproxy.proxy.answers.AnswerSlot`); acks=0
  produce requests take none.
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

Both sockets are read by a :class:`~kiproxy.proxy.net.frame_stream.FrameStream`, whose
frames are ``bytes``, received where they are handed out (kio and the record codec read
``bytes``; records are decoded where they lie in the frame).

* Requests that need no waiting (with room in flight, a pass-through Produce request
  or one forwarded as opaque bytes: :meth:`~kiproxy.proxy.dispatch.RequestDispatcher.at_once`)
  are handled in the client socket's receive callback (its ``on_frames``), and answers
  in the broker socket's, so the common request and answer wake no task. The first
  request that must wait, and every frame after it, is left to the connection's reader
  task, which finishes it before it reads on: the order above holds either way.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import struct
import time
from collections.abc import Coroutine
from functools import partial
from typing import TYPE_CHECKING, Any, NamedTuple

from kiproxy.interceptors.identity import ClientIdentity
from kiproxy.interceptors.observer import RequestInfo
from kiproxy.protocol.errors import ProtocolError
from kiproxy.protocol.framing import RequestHeader, parse_request_header
from kiproxy.protocol.log_limit import MORE_IN_INTERVAL, RateLimitedLog
from kiproxy.protocol.messages import api_name
from kiproxy.proxy.answers import JOIN_BELOW, AnswerSide, AnswerSlot, ConnectionServices
from kiproxy.proxy.brokers.failures import connect_error
from kiproxy.proxy.net.frame_stream import Frame, FrameStream
from kiproxy.proxy.net.sasl import SaslRound, identity_after_sasl
from kiproxy.proxy.produce.disposition import Answer, Forward

if TYPE_CHECKING:
    from kiproxy.proxy.generation import Generation
    from kiproxy.proxy.routes.table import ClientRoutes, RouteTable

log = logging.getLogger("kiproxy.connection")
_closings = RateLimitedLog(log)
"""Clients closed for a request the proxy cannot carry: the same refusal from one host
is written once per interval, with how many were held back."""

__all__ = ["ClientConnection", "ConnectionServices"]

_INT32 = struct.Struct(">i")


class _UpstreamLost(Exception):
    """The broker connection broke while a request was being written to it."""


class _Rest(NamedTuple):
    """What is left of a request that must wait for something (:meth:`_handle_request`)."""

    work: Coroutine[Any, Any, None]
    """Awaited at once by the reader of requests, before any later request."""
    generation: Generation | None
    """The configuration generation ``work`` releases when done; released by whoever
    drops ``work`` unstarted (the connection closing first)."""


class ClientConnection(AnswerSide):
    """Carries one client's traffic to its broker and back, in order."""

    def __init__(self, services: ConnectionServices, client: FrameStream, node_id: int | None,
                 identity: ClientIdentity) -> None:
        super().__init__(services, client, node_id, identity)
        self._routes: tuple[ClientIdentity, RouteTable, ClientRoutes] | None = None
        self._handling = False
        self._stopping = False
        self._slot_taken = False
        self._in_read = False
        # What _requests_arrived, in the client's receive callback, leaves _read_client:
        self._rest: _Rest | None = None  # awaited there before the frames left
        self._raised: Exception | None = None  # raised there, as if it had handled them
        self._tried = ""
        """The upstream address tried last (named when none could be reached)."""
        self._loop = asyncio.get_running_loop()
        self.last_activity = self._loop.time()
        """Loop time of the last whole request or response (a trickle of bytes is no activity)."""

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
                self._tried, connect_error(exc, upstreams.connect_timeout, upstreams.tls),
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
                    *address, partial(FrameStream, max_response, whole_frames=True))
                self._upstream = upstream
                self.upstream_address = address
                return
            except (OSError, TimeoutError) as exc:
                last = exc  # TimeoutError is an OSError
        raise last

    @property
    def owed(self) -> int:
        """Requests of the client not answered yet (sent on, or still being handled)."""
        return len(self._slots) + int(self._handling or self._rest is not None)

    @property
    def idle(self) -> bool:
        """No response is owed to the client and no request is being handled."""
        return not self.owed

    async def stop_reading(self) -> None:
        """Stop reading new requests; the connection closes once owed responses are sent."""
        self._stopping = True
        # A request already begun in the receive callback is finished first, and one
        # that raised there is reported, as the reader does when nothing stops.
        if (self._in_read and self._read_task is not None and self._rest is None
                and self._raised is None):
            self._read_task.cancel()

    # ------------------------------------------------------------------ client side

    def _requests_arrived(self, frames: list[Frame]) -> bool:
        """The client stream's :attr:`~kiproxy.proxy.net.frame_stream.FrameStream.on_frames`:
        requests handled in the receive callback, in order, while each is done at once
        (:meth:`_handle_request`), so that the common request costs no wake-up of
        :meth:`_read_client`; the first that must wait, what a request raised and the
        frames after them are left to it."""
        if self._closed or self._stopping or not self._client.drained:
            return False
        self.last_activity = self._loop.time()
        frames.reverse()  # taken from the end; what is left is put back in order
        try:
            while frames:
                try:
                    rest = self._handle_request(frames.pop())
                except Exception as exc:
                    self._raised = exc
                    return False
                if rest is not None:
                    self._rest = rest
                    return False
                if self._closed:
                    return False
            return True
        finally:
            frames.reverse()

    async def _read_client(self) -> None:
        client = self._client
        client.on_frames = self._requests_arrived
        try:
            await self._read_requests(client)
        finally:
            rest = self._rest
            if rest is not None:  # begun in the receive callback, never to be finished
                self._rest = None
                rest.work.close()
                if rest.generation is not None:
                    self._services.generations.release(rest.generation)

    async def _read_requests(self, client: FrameStream) -> None:
        loop = self._loop
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
            rest, self._rest = self._rest, None
            raised, self._raised = self._raised, None
            if not frames and rest is None and raised is None:
                return
            self.last_activity = loop.time()
            try:
                if raised is not None:
                    raise raised
                if rest is not None:
                    await rest.work
                    if self._closed:
                        return
                # Taken out of the list one by one: a frame turned into bytes for
                # decoding leaves no second copy alive here while it is handled.
                frames.reverse()
                while frames:
                    rest = self._handle_request(frames.pop())
                    if rest is not None:
                        await rest.work
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
            except OSError:
                if self._client.drained:
                    raise  # not the client's socket: reported as any other failure
                return  # the client went away (reset, timed out) while its answer was written

    def _bad_client(self, exc: ProtocolError) -> None:
        if self._services.metrics is not None:
            self._services.metrics.client_errors.inc()
        # A client retrying the same refused request (a frame over max_frame_size) on
        # every reconnect: the same line from one host is written once per interval.
        _closings.warning((self.identity.client_host, str(exc)),
                          "closing client %s (client_id %r): %s", self.client_address,
                          self.client_id, exc, more=MORE_IN_INTERVAL, extra=self.log_context)

    def _handle_request(self, frame: Frame) -> _Rest | None:
        """Handle one request: in this call when nothing in it waits (with room in flight,
        what the dispatcher decides at once, forwarded to a drained upstream); else
        returns the rest (:meth:`_handle_rest`), which the caller awaits at once, and
        which then owns the generation."""
        generations = self._services.generations
        generation = generations.acquire()
        self._slot_taken = False
        rest: _Rest | None = None
        try:
            header = parse_request_header(frame)
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
            request = frame
            forward = (self._services.dispatcher.at_once(self, generation, header, request)
                       if len(self._slots) < generation.config.max_in_flight
                       and not self._closed else None)
            if forward is None:
                rest = _Rest(self._handle_rest(generation, header, request, api, t0, info),
                             generation)
                return rest
            self._forward(generation, header, forward, api, t0, info)
            assert self._upstream is not None
            if not self._upstream.drained:
                rest = _Rest(self._drain_upstream(), None)
            return rest
        finally:
            # A slot taken for the answer holds the generation until the answer leaves
            # (or the connection closes); otherwise the request is done with it here,
            # unless the rest is the request's own (waiting for upstream room is not).
            if (rest is None or rest.generation is None) and not self._slot_taken:
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
                    slot = AnswerSlot(generation, api, t0, info, disposition.produce,
                                      proxy_answer=True)
                    self._slots.append(slot)
                    self._slot_taken = True
                    self._complete(slot, disposition.frame)
                    await self._client.drain()
                elif info is not None or self._services.metrics is not None:
                    self._report(AnswerSlot(generation, api, t0, info, disposition.produce,
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
        except OSError as exc:  # reset, but also timed out or unreachable (ETIMEDOUT, ...)
            raise _UpstreamLost(str(exc) or type(exc).__name__) from exc

    def _forward(self, generation: Generation, header: RequestHeader, disposition: Forward,
                 api: str = "", t0: float = 0.0, info: RequestInfo | None = None) -> None:
        if disposition.expect_response:
            slot = AnswerSlot(generation, api, t0, info, disposition.produce)
            self._slots.append(slot)
            self._slot_taken = True
            self._pending.append((header.correlation_id, slot, disposition.on_response,
                                  disposition.transform))
        else:
            self._unanswered.append(header.correlation_id)
        assert self._upstream is not None
        up = self._upstream.transport
        if up.is_closing():
            # writelines() on a closed transport raises RuntimeError under uvloop.
            raise _UpstreamLost("the broker connection is closed")
        frame = disposition.frame
        size = len(frame)
        if size < JOIN_BELOW:
            up.write(_INT32.pack(size) + frame)
        else:
            up.writelines((_INT32.pack(size), frame))
        if not disposition.expect_response and (info is not None
                                                or self._services.metrics is not None):
            self._report(AnswerSlot(generation, api, t0, info, disposition.produce), 0)

    # ------------------------------------------------------------------ SASL

    def sasl_answered(self, sasl_round: SaslRound | None, version: int, flexible: bool,
                      frame: bytes) -> bytes:
        """Learn (or forget) the principal from a SaslAuthenticate answer (see
        :func:`~kiproxy.proxy.net.sasl.identity_after_sasl`); pass the answer on unchanged."""
        self.identity = identity_after_sasl(self.identity, self.sasl, sasl_round, version,
                                            flexible, frame, self.log_context)
        return frame
