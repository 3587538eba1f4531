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
* A malformed or oversized frame from the client closes that client only, with
  one log line naming the client. An upstream that closes or cannot be reached
  closes its client; clients reconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import struct
import time
from collections import deque
from typing import TYPE_CHECKING

from interceptors.observer import RequestInfo, ResponseInfo
from protocol.errors import ProtocolError
from protocol.framing import FrameDecoder, RequestHeader, parse_request_header
from protocol.messages import api_name
from proxy.outcome import Answer, Forward, ProduceDraft
from proxy.sasl import SaslTracker

if TYPE_CHECKING:
    from collections.abc import Callable

    from proxy.server import ProxyServer

log = logging.getLogger("kiproxy.connection")

__all__ = ["ClientConnection"]

_READ_SIZE = 256 * 1024
_INT32 = struct.Struct(">i")


class _UpstreamLost(Exception):
    """The broker connection broke while a request was being written to it."""


class _Slot:
    """A place in the response order, filled when the response is known."""

    __slots__ = ("api", "done", "frame", "info", "produce", "proxy_answer", "t0")

    def __init__(self, api: str = "", t0: float = 0.0, info: RequestInfo | None = None,
                 produce: list[ProduceDraft] | None = None, proxy_answer: bool = False) -> None:
        self.frame: bytes | None = None
        self.done = False
        self.api = api
        self.t0 = t0
        self.info = info
        self.produce = produce
        self.proxy_answer = proxy_answer


class ClientConnection:
    """Carries one client's traffic to its broker and back, in order."""

    def __init__(
        self,
        server: ProxyServer,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        node_id: int | None,
    ) -> None:
        self.server = server
        self.node_id = node_id
        """The broker node this connection stands for; ``None`` for bootstrap."""
        self._reader = reader
        self._writer = writer
        peer = writer.get_extra_info("peername")
        self.client_address = f"{peer[0]}:{peer[1]}" if peer else "unknown"
        """``host:port`` of the client."""
        self.client_id: str | None = None
        """The client id of the latest request."""
        self.principal: str | None = None
        """The authenticated principal, when the proxy knows it."""
        self.sasl = SaslTracker()
        self._up_reader: asyncio.StreamReader | None = None
        self._up_writer: asyncio.StreamWriter | None = None
        self._slots: deque[_Slot] = deque()
        self._pending: deque[tuple[int, _Slot, Callable[[bytes], bytes] | None]] = deque()
        self._room = asyncio.Event()
        self._room.set()
        self._closed = False
        self._upstream_reported = False
        self._draining = False
        self._in_read = False
        self._read_task: asyncio.Task[None] | None = None
        self._up_task: asyncio.Task[None] | None = None
        self.upstream_address: tuple[str, int] | None = None
        self.last_activity = asyncio.get_running_loop().time()
        """Loop time of the last whole request or response (a trickle of bytes is no activity)."""
        limit = server.config.max_buffered_bytes
        writer.transport.set_write_buffer_limits(high=limit, low=limit // 4)

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
        assert self._up_writer is not None
        self._up_writer.transport.set_write_buffer_limits(high=limit, low=limit // 4)
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
                self._up_reader, self._up_writer = await asyncio.wait_for(
                    self.server.open_upstream(*address),
                    timeout=self.server.config.upstream_connect_timeout_ms / 1000,
                )
                self.upstream_address = address
                return
            except (OSError, TimeoutError) as exc:
                last = exc if isinstance(exc, OSError) else OSError(f"timed out to {address}")
        raise last

    @property
    def idle(self) -> bool:
        """No response is owed to the client."""
        return not self._slots

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
        if self._up_writer is not None:
            self._up_writer.close()
            with contextlib.suppress(Exception):
                await self._up_writer.wait_closed()
        await self._close_client()

    async def _close_client(self) -> None:
        self._writer.close()
        with contextlib.suppress(Exception):
            await self._writer.wait_closed()

    # ------------------------------------------------------------------ client side

    async def _read_client(self) -> None:
        decoder = FrameDecoder(self.server.config.max_frame_size)
        loop = asyncio.get_running_loop()
        writer = self._writer
        while not self._closed and not self._draining:
            self._in_read = True
            try:
                # A client that does not read its responses stops being read from
                # once max_buffered_bytes of them wait in the socket buffer.
                await writer.drain()
                data = await self._reader.read(_READ_SIZE)
            except ConnectionError:
                return
            finally:
                self._in_read = False
            if not data:
                return
            try:
                frames = decoder.feed(data)
                if frames:
                    self.last_activity = loop.time()
                for frame in frames:
                    await self._handle_request(frame)
                    if self._closed:
                        return
            except ProtocolError as exc:
                if self.server.metrics is not None:
                    self.server.metrics.client_errors.inc()
                log.warning("closing client %s (client_id %r): %s",
                            self.client_address, self.client_id, exc, extra=self.log_context)
                return
            except _UpstreamLost as exc:
                # The broker connection broke while a request was being forwarded; the
                # upstream reader may not have noticed yet. Same line, same counter.
                self._upstream_failed(f"connection failed: {exc}")
                return
            except ConnectionError:
                return  # the client went away while its answer was being written

    async def _handle_request(self, frame: bytes) -> None:
        t0 = time.monotonic()
        header = parse_request_header(frame)
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
        outcome = await server.handle_request(self, header, frame)
        if self._closed:
            return
        if isinstance(outcome, Answer):
            if outcome.frame is not None:
                slot = _Slot(api, t0, info, outcome.produce, proxy_answer=True)
                self._slots.append(slot)
                self._complete(slot, outcome.frame)
                await self._writer.drain()
            elif info is not None or metrics is not None:
                self._report(_Slot(api, t0, info, outcome.produce, proxy_answer=True), 0)
            return
        self._forward(header, outcome, api, t0, info)
        assert self._up_writer is not None
        try:
            await self._up_writer.drain()
        except ConnectionError as exc:
            raise _UpstreamLost(str(exc) or type(exc).__name__) from exc

    def _forward(self, header: RequestHeader, outcome: Forward, api: str = "",
                 t0: float = 0.0, info: RequestInfo | None = None) -> None:
        if outcome.expect_response:
            slot = _Slot(api, t0, info, outcome.produce)
            self._slots.append(slot)
            self._pending.append((header.correlation_id, slot, outcome.on_response))
        assert self._up_writer is not None
        if self._up_writer.transport.is_closing():
            # writelines() on a closed transport raises RuntimeError under uvloop.
            raise _UpstreamLost("the broker connection is closed")
        self._up_writer.writelines((_INT32.pack(len(outcome.frame)), outcome.frame))
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

    def _complete(self, slot: _Slot, frame: bytes) -> None:
        slot.frame = frame
        slot.done = True
        slots = self._slots
        writer = self._writer
        observed = self.server.observed
        while slots and slots[0].done:
            done = slots.popleft()
            out = done.frame
            assert out is not None
            writer.writelines((_INT32.pack(len(out)), out))
            if observed:
                self._report(done, len(out))
        if len(slots) < self.server.config.max_in_flight:
            self._room.set()

    # ------------------------------------------------------------------ upstream side

    async def _read_upstream(self) -> None:
        assert self._up_reader is not None
        decoder = FrameDecoder(self.server.config.max_response_size)
        reason = "closed the connection"
        try:
            while not self._closed:
                data = await self._up_reader.read(_READ_SIZE)
                if not data:
                    break
                ready = []
                for frame in decoder.feed(data):
                    ready.append(self._match_response(frame))
                if self.server.nodes.unsettled:
                    await self.server.nodes.settle()
                for slot, frame in ready:
                    self._complete(slot, frame)
                await self._writer.drain()
        except ProtocolError as exc:
            reason = f"sent a response the proxy cannot carry: {exc}"
        except (ConnectionError, OSError) as exc:
            reason = f"connection failed: {exc}"
        if not self._closed:
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

    def _match_response(self, frame: bytes) -> tuple[_Slot, bytes]:
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
            frame = on_response(frame)
        return slot, frame

    @property
    def log_context(self) -> dict[str, object]:
        """``extra=`` fields of connection-level log lines."""
        return {"client_address": self.client_address, "client_id": self.client_id,
                "principal": self.principal, "node_id": self.node_id}

    def describe(self, header: RequestHeader) -> str:
        """One-line description of a request, for logs."""
        return (f"{api_name(header.api_key)} v{header.api_version} from {self.client_address} "
                f"(client_id {header.client_id!r})")
