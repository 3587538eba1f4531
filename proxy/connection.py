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
* At most ``max_in_flight`` slots per connection: reads pause when it is
  reached, bounding the memory a connection can hold.
* Bytes buffered from clients are bounded per connection (a frame above
  ``max_frame_size`` closes it; a partial frame holds only what arrived) and per
  process (``max_client_buffered_bytes``: :mod:`kiproxy.proxy.memory` pauses the
  socket of a connection that would pass it). Decoding a large batch runs off the
  loop within ``max_decode_memory`` (:mod:`kiproxy.proxy.offload`); the connection
  waits for it as it waits for its interceptor, so order is unchanged.
* A malformed or oversized frame from the client closes that client only, with
  one log line naming the client. An upstream that closes or cannot be reached
  closes its client; clients reconnect.

Both sockets are read by a :class:`FrameStream` (an ``asyncio.BufferedProtocol``
around :class:`kiproxy.protocol.framing.FrameAssembler`): a frame of 16-64 KiB is
received straight into a buffer of its own size and forwarded from it, a larger
one into buffers that grow with the bytes that arrive, joined once into ``bytes``.
A frame in its own buffer is a ``bytearray``; it is turned into ``bytes`` before anything
decodes it with kio (which reads only immutable buffers), so the only
``bytearray`` a handler sees is a Produce request on a pipeline that neither
intercepts nor observes, which only scans it for acks and forwards it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections import deque
from functools import partial
from typing import TYPE_CHECKING, Any, cast

from kiproxy.interceptors.observer import RequestInfo, ResponseInfo
from kiproxy.protocol.errors import FrameTooLarge, ProtocolError
from kiproxy.protocol.framing import FrameAssembler, RequestHeader, parse_request_header
from kiproxy.protocol.messages import ApiKey, api_name
from kiproxy.proxy.outcome import Answer, Forward, ProduceDraft
from kiproxy.proxy.sasl import SaslTracker

if TYPE_CHECKING:
    from collections.abc import Callable, Coroutine

    from kiproxy.proxy.memory import ReceiveBudget
    from kiproxy.proxy.server import ProxyServer

log = logging.getLogger("kiproxy.connection")

__all__ = ["ClientConnection", "FrameStream"]

_INT32 = struct.Struct(">i")
_CLOSE_TIMEOUT = 2.0
"""Seconds a closing socket may take to flush before it is aborted."""

Frame = bytes | bytearray
"""A frame without its length prefix; large ones are received into a ``bytearray``."""


class FrameStream(asyncio.BufferedProtocol):
    """One socket as a stream of whole frames; the asyncio shell of a FrameAssembler.

    The socket is read only while its owner waits in :meth:`read`: frames that
    arrive are kept for the owner and reading pauses until it asks again, so
    while a request (or a batch of responses) is handled nothing more is read and
    TCP pushes back. :meth:`drain` waits while the write buffer is above its
    high-water mark, as ``StreamWriter.drain`` does. With a ``budget`` (client
    sockets), the bytes of a partial frame count against the process-wide
    :class:`~kiproxy.proxy.memory.ReceiveBudget`, which may hold the socket back.
    """

    def __init__(self, max_frame_size: int,
                 on_open: Callable[[FrameStream], Coroutine[None, None, None]] | None = None,
                 budget: ReceiveBudget | None = None) -> None:
        self._assembler = FrameAssembler(max_frame_size)
        self._on_open = on_open
        self._budget = budget
        self._budget_held = 0
        self._held_back = False
        self._task: asyncio.Task[None] | None = None
        self._transport: asyncio.Transport | None = None
        self._frames: list[Frame] = []
        self._error: BaseException | None = None
        self._eof = False
        self._lost = False
        self._reading = True
        self._write_paused = False
        self._waiter: asyncio.Future[None] | None = None
        self._drain_waiters: deque[asyncio.Future[None]] = deque()
        self._closed: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    @property
    def transport(self) -> asyncio.Transport:
        """The socket's transport (set once connected)."""
        assert self._transport is not None
        return self._transport

    def get_extra_info(self, name: str) -> Any:
        """The transport's ``get_extra_info`` (``peername``, ``peercert``, ...)."""
        return self.transport.get_extra_info(name)

    # -------------------------------------------------------------- asyncio callbacks

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = cast(asyncio.Transport, transport)
        if self._on_open is not None:
            self._task = asyncio.get_running_loop().create_task(self._on_open(self))

    def get_buffer(self, sizehint: int) -> memoryview:
        return self._assembler.get_buffer()

    def buffer_updated(self, nbytes: int) -> None:
        try:
            frames = self._assembler.buffer_updated(nbytes)
        except ProtocolError as exc:
            if self._budget is not None and isinstance(exc, FrameTooLarge):
                self._budget.refused_frame()
            self._error = exc
            self._pause()
            self._wake()
            return
        held = self._assembler.buffered
        if self._budget is not None and (held or self._budget_held):
            self._budget_held = held
            self._budget.update(self, held)
        if frames:
            self._frames.extend(frames)
            self._pause()
            self._wake()

    def eof_received(self) -> bool:
        self._eof = True
        self._wake()
        # Keep a plain socket half open, as StreamReaderProtocol does (the owner
        # closes it); over TLS the answer is ignored and asyncio warns about True.
        return self.transport.get_extra_info("sslcontext") is None

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        self._assembler.discard()
        if self._budget is not None:
            self._budget.forget(self)
            self._budget_held = 0
        if exc is None:
            self._eof = True
        elif self._error is None:
            self._error = exc
        self._wake()
        while self._drain_waiters:
            waiter = self._drain_waiters.popleft()
            if not waiter.done():
                if exc is None:
                    waiter.set_result(None)
                else:
                    waiter.set_exception(exc)
        if not self._closed.done():
            self._closed.set_result(None)

    def pause_writing(self) -> None:
        self._write_paused = True

    def resume_writing(self) -> None:
        self._write_paused = False
        while self._drain_waiters:
            waiter = self._drain_waiters.popleft()
            if not waiter.done():
                waiter.set_result(None)

    # -------------------------------------------------------------- the owner's side

    async def read(self) -> list[Frame]:
        """The frames received since the last call, waiting for one; ``[]`` at end of stream.

        Raises the :class:`ProtocolError` of a bad length prefix, or the error that
        broke the connection.
        """
        while True:
            if self._frames:
                frames, self._frames = self._frames, []
                return frames
            if self._error is not None:
                raise self._error
            if self._eof:
                return []
            self._resume()
            waiter = self._waiter = asyncio.get_running_loop().create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    async def drain(self) -> None:
        """Wait until the write buffer is below its low-water mark."""
        if isinstance(self._error, OSError):
            raise self._error  # what broke the connection, as StreamWriter.drain raises it
        if self.transport.is_closing():
            # Let connection_lost run first, as StreamWriter.drain does.
            await asyncio.sleep(0)
        if self._lost:
            raise ConnectionResetError("Connection lost")
        if not self._write_paused:
            return
        waiter = asyncio.get_running_loop().create_future()
        self._drain_waiters.append(waiter)
        await waiter

    async def close(self, timeout: float = _CLOSE_TIMEOUT) -> None:
        """Close the socket (after what is buffered is sent) and wait until it is closed;
        after ``timeout`` seconds abort it (a peer that does not read its answers, or a
        TLS peer that never answers close_notify, would otherwise hold it open)."""
        if self._transport is None:
            return
        self._transport.close()
        try:
            await asyncio.wait_for(asyncio.shield(self._closed), timeout)
        except TimeoutError:
            self._transport.abort()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._closed), timeout)

    def _pause(self) -> None:
        if self._reading and self._transport is not None and not self._lost:
            self._reading = False
            self._transport.pause_reading()

    def hold_back(self) -> None:
        """Stop reading the socket until :meth:`let_go` (the receive budget is spent)."""
        self._held_back = True
        self._pause()

    def let_go(self) -> None:
        """Read the socket again, if the owner is waiting for frames."""
        self._held_back = False
        if self._waiter is not None:
            self._resume()

    def _resume(self) -> None:
        if self._held_back:
            return
        if not self._reading and self._transport is not None and not self._lost:
            self._reading = True
            self._transport.resume_reading()

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)


class _UpstreamLost(Exception):
    """The broker connection broke while a request was being written to it."""


class _Slot:
    """A place in the response order, filled when the response is known."""

    __slots__ = ("api", "done", "frame", "info", "produce", "proxy_answer", "t0")

    def __init__(self, api: str = "", t0: float = 0.0, info: RequestInfo | None = None,
                 produce: list[ProduceDraft] | None = None, proxy_answer: bool = False) -> None:
        self.frame: Frame | None = None
        self.done = False
        self.api = api
        self.t0 = t0
        self.info = info
        self.produce = produce
        self.proxy_answer = proxy_answer


class ClientConnection:
    """Carries one client's traffic to its broker and back, in order."""

    def __init__(self, server: ProxyServer, client: FrameStream, node_id: int | None) -> None:
        self.server = server
        self.node_id = node_id
        """The broker node this connection stands for; ``None`` for bootstrap."""
        self._client = client
        self._writer = client.transport
        peer = client.get_extra_info("peername")
        self.client_address = f"{peer[0]}:{peer[1]}" if peer else "unknown"
        """``host:port`` of the client."""
        self.client_id: str | None = None
        """The client id of the latest request."""
        self.principal: str | None = None
        """The authenticated principal, when the proxy knows it."""
        self.sasl = SaslTracker()
        self._upstream: FrameStream | None = None
        self._slots: deque[_Slot] = deque()
        self._pending: deque[tuple[int, _Slot, Callable[[bytes], bytes] | None]] = deque()
        self._room = asyncio.Event()
        self._room.set()
        self._closed = False
        self._upstream_reported = False
        self._handling = False
        self._draining = False
        self._in_read = False
        self._read_task: asyncio.Task[None] | None = None
        self._up_task: asyncio.Task[None] | None = None
        self.upstream_address: tuple[str, int] | None = None
        self.last_activity = asyncio.get_running_loop().time()
        """Loop time of the last whole request or response (a trickle of bytes is no activity)."""
        limit = server.config.max_buffered_bytes
        self._writer.set_write_buffer_limits(high=limit, low=limit // 4)

    # ------------------------------------------------------------------ lifecycle

    async def run(self) -> None:
        """Connect upstream, then carry traffic until either side closes."""
        try:
            await self._connect_upstream()
        except OSError as exc:
            if self.server.metrics is not None:
                self.server.metrics.upstream_errors.labels("connect").inc()
            log.warning("client %s: upstream %s unreachable (%s); closing the client",
                        self.client_address, self._target_description(), exc,
                        extra=self.log_context)
            await self._close_client()
            return
        limit = self.server.config.max_buffered_bytes
        assert self._upstream is not None
        self._upstream.transport.set_write_buffer_limits(high=limit, low=limit // 4)
        self._up_task = asyncio.create_task(self._read_upstream())
        self._read_task = asyncio.current_task()
        try:
            await self._read_client()
        except asyncio.CancelledError:
            if not self._draining:
                raise
        finally:
            if self._draining:
                await self._wait_flushed()
            await self.close()

    def _target_description(self) -> str:
        return "bootstrap" if self.node_id is None else f"for node {self.node_id}"

    async def _connect_upstream(self) -> None:
        candidates = (
            self.server.bootstrap_upstreams() if self.node_id is None
            else [self.server.upstream_for_node(self.node_id)]
        )
        last: OSError = OSError("no upstream address known")
        for address in candidates:
            if address is None:
                continue
            try:
                _, upstream = await asyncio.wait_for(
                    self.server.open_upstream(
                        *address, partial(FrameStream, self.server.config.max_response_size)),
                    timeout=self.server.config.upstream_connect_timeout_ms / 1000,
                )
                self._upstream = upstream
                self.upstream_address = address
                return
            except (OSError, TimeoutError) as exc:
                last = exc if isinstance(exc, OSError) else OSError(f"timed out to {address}")
        raise last

    @property
    def idle(self) -> bool:
        """No response is owed to the client and no request is being handled."""
        return not self._slots and not self._handling

    async def drain(self) -> None:
        """Stop reading new requests; the connection closes once owed responses are sent."""
        self._draining = True
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
        if self._up_task is not None and self._up_task is not asyncio.current_task():
            self._up_task.cancel()
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
        while not self._closed and not self._draining:
            self._in_read = True
            try:
                # A client that does not read its responses stops being read from
                # once max_buffered_bytes of them wait in the socket buffer.
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
                    await self._handle_request(frames.pop())
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
        if self.server.metrics is not None:
            self.server.metrics.client_errors.inc()
        log.warning("closing client %s (client_id %r): %s",
                    self.client_address, self.client_id, exc, extra=self.log_context)

    def _decoded_as_is(self, header: RequestHeader) -> bool:
        """Whether a large request may reach the handler as the ``bytearray`` it arrived in.

        Only Produce on a pipeline that neither intercepts nor observes: it scans
        the frame for acks and forwards it. Anything else may be decoded by kio.
        """
        produce = self.server.produce
        return (header.api_key == ApiKey.PRODUCE and produce.interceptor is None
                and not produce.observed)

    async def _handle_request(self, frame: Frame) -> None:
        t0 = time.monotonic()
        header = parse_request_header(frame)
        if type(frame) is not bytes and not self._decoded_as_is(header):
            frame = bytes(frame)
        if header.client_id is not None:
            self.client_id = header.client_id
        server = self.server
        metrics = server.metrics
        api = ""
        if metrics is not None:
            api = api_name(header.api_key)
            metrics.messages.labels("request", api).inc()
            metrics.bytes.labels("request", api).inc(len(frame))
        info: RequestInfo | None = None
        hub = server.observers
        if hub.active:
            info = RequestInfo(
                api_key=header.api_key, api_name=api or api_name(header.api_key),
                api_version=header.api_version, correlation_id=header.correlation_id,
                client_id=header.client_id, client_address=self.client_address,
                principal=self.principal, size=len(frame),
                received_at_ms=int(time.time() * 1000), node_id=self.node_id,
            )
            hub.request(info)
        while len(self._slots) >= server.config.max_in_flight and not self._closed:
            self._room.clear()
            await self._room.wait()
        # A bytearray here is forwarded untouched (see _decoded_as_is).
        self._handling = True  # a request in the interceptor is owed an answer too
        try:
            outcome = await server.handle_request(self, header, cast(bytes, frame))
        finally:
            self._handling = False
        if self._closed:
            return
        if isinstance(outcome, Answer):
            if outcome.frame is not None:
                slot = _Slot(api, t0, info, outcome.produce, proxy_answer=True)
                self._slots.append(slot)
                self._complete(slot, outcome.frame)
                await self._client.drain()
            elif info is not None or metrics is not None:
                self._report(_Slot(api, t0, info, outcome.produce, proxy_answer=True), 0)
            return
        self._forward(header, outcome, api, t0, info)
        assert self._upstream is not None
        try:
            await self._upstream.drain()
        except ConnectionError as exc:
            raise _UpstreamLost(str(exc) or type(exc).__name__) from exc

    def _forward(self, header: RequestHeader, outcome: Forward, api: str = "",
                 t0: float = 0.0, info: RequestInfo | None = None) -> None:
        if outcome.expect_response:
            slot = _Slot(api, t0, info, outcome.produce)
            self._slots.append(slot)
            self._pending.append((header.correlation_id, slot, outcome.on_response))
        assert self._upstream is not None
        up = self._upstream.transport
        if up.is_closing():
            # writelines() on a closed transport raises RuntimeError under uvloop.
            raise _UpstreamLost("the broker connection is closed")
        up.writelines((_INT32.pack(len(outcome.frame)), outcome.frame))
        if not outcome.expect_response and (info is not None or self.server.metrics is not None):
            self._report(_Slot(api, t0, info, outcome.produce), 0)

    def _report(self, slot: _Slot, size: int) -> None:
        """Count a response and tell the observers (``size`` 0: none was sent)."""
        metrics = self.server.metrics
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
        if slot.info is not None:
            self.server.observers.response(ResponseInfo(
                request=slot.info, size=size,
                latency_ms=(time.monotonic() - slot.t0) * 1000,
                answered_by_proxy=slot.proxy_answer,
                produce=tuple(d.freeze() for d in slot.produce or ()),
            ))

    def _complete(self, slot: _Slot, frame: Frame) -> None:
        slot.frame = frame
        slot.done = True
        self._send_ready()

    def _send_ready(self) -> None:
        """Write every response now at the head of the order, in one ``writelines``."""
        slots = self._slots
        if not slots or not slots[0].done:
            return
        observed = self.server.observed
        out: list[Frame] = []
        while slots and slots[0].done:
            done = slots.popleft()
            frame = done.frame
            assert frame is not None
            out.append(_INT32.pack(len(frame)))
            out.append(frame)
            done.frame = None
            if observed:
                self._report(done, len(frame))
        self._writer.writelines(out)
        if len(slots) < self.server.config.max_in_flight:
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
                ready = [self._match_response(frame) for frame in frames]
                if self.server.nodes.unsettled:
                    await self.server.nodes.settle()
                for slot, frame in ready:
                    slot.frame = frame
                    slot.done = True
                self._send_ready()
                try:
                    await self._client.drain()
                except (ConnectionError, OSError, TimeoutError):
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
        if broken and self.server.metrics is not None:
            self.server.metrics.upstream_errors.labels("broken").inc()
        log.log(logging.WARNING if broken else logging.INFO,
                "upstream %s %s; closing client %s (client_id %r)",
                self._upstream_name(), reason, self.client_address, self.client_id,
                extra=self.log_context)

    def _upstream_name(self) -> str:
        if self.upstream_address is None:
            return "broker"
        return f"broker {self.upstream_address[0]}:{self.upstream_address[1]}"

    def _match_response(self, frame: Frame) -> tuple[_Slot, Frame]:
        if len(frame) < 4:
            raise ProtocolError(f"response of {len(frame)} bytes has no correlation id")
        (correlation_id,) = _INT32.unpack_from(frame, 0)
        if not self._pending:
            raise ProtocolError(f"response with correlation id {correlation_id} "
                                "answers no request")
        expected, slot, on_response = self._pending.popleft()
        if correlation_id != expected:
            raise ProtocolError(f"response correlation id {correlation_id} where "
                                f"{expected} was next")
        if on_response is not None:
            # Rewriters decode with kio, which reads only immutable buffers.
            return slot, on_response(frame if type(frame) is bytes else bytes(frame))
        return slot, frame

    @property
    def log_context(self) -> dict[str, object]:
        """``extra=`` fields of connection-level log lines."""
        return {"client_address": self.client_address, "client_id": self.client_id,
                "principal": self.principal, "node_id": self.node_id}
