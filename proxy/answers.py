"""The answer side of a client connection: what the client is owed, and in which order.

Contracts:

* Each request that expects an answer takes a slot (:class:`AnswerSlot`) in a FIFO;
  answers leave strictly in slot order, whether the broker sent them or the proxy made
  them itself (a produce request rejected whole waits behind earlier in-flight
  responses). acks=0 produce requests take no slot.
* The broker answers in request order: each answer is matched by correlation id to
  the oldest request still waiting for one. An answer that matches none, or one out of
  that order, is an answer the proxy cannot carry: the connection closes. One
  exception: a broker that answers an acks=0 Produce request (Kafka never does; some
  Kafka-compatible brokers do) has that answer dropped, since its client expects none:
  the correlation ids of the last :data:`UNANSWERED_KEPT` acks=0 requests are kept for
  this.
* An answer with an asynchronous transform (a Fetch answer through the fetch-side
  hooks, :mod:`kiproxy.proxy.fetch.pipeline`) fills its slot when the transform is
  done; the answers behind it wait, so the order holds. A transform that fails
  (not a hook: the hooks' faults become partition errors) closes the connection. A
  transform runs on the answer its rewriter (broker addresses) made, and may give it
  back as pieces (:data:`~kiproxy.proxy.net.frame_stream.FramePieces`), which are
  written as they are, never joined.
* A slot holds its request's configuration generation until its answer leaves, or
  until the connection closes, which drops the answers still owed.
* The answers at the head of the order leave in one write. Once fewer than
  ``max_in_flight`` slots remain, the request side may read again.
* An upstream that closes, or sends an answer the proxy cannot carry, closes its
  client, with one log line and one count. A client that leaves while answers are
  owed to it is closed quietly: that is ordinary.

:class:`AnswerSide` is the base class of
:class:`~kiproxy.proxy.connection.ClientConnection`, not an object the connection
holds: the request side and the answer side share the two streams, the slots and the
client's identity (every log line names the client), and the per-request path reaches
them with no lookup more than one class would need. The :class:`ConnectionServices`
both sides use are declared here, with the base that takes them;
:mod:`kiproxy.proxy.connection` names them too.
"""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import logging
import struct
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiproxy.interceptors.errors import error_name
from kiproxy.interceptors.identity import ClientIdentity
from kiproxy.interceptors.observer import PartitionSummary, RequestInfo, ResponseInfo
from kiproxy.protocol.errors import ProtocolError
from kiproxy.protocol.log_limit import MORE_IN_INTERVAL, RateLimitedLog
from kiproxy.proxy.net.frame_stream import Frame, FramePieces, FrameStream
from kiproxy.proxy.net.sasl import SaslTracker

if TYPE_CHECKING:
    from kiproxy.proxy.brokers.nodes import NodeRegistry
    from kiproxy.proxy.brokers.upstreams import Upstreams
    from kiproxy.proxy.dispatch import RequestDispatcher
    from kiproxy.proxy.generation import Generation, GenerationCell
    from kiproxy.proxy.observe.metrics import Metrics

log = logging.getLogger("kiproxy.connection")
_failures = RateLimitedLog(log)
"""Answers the proxy failed on (a fault of its own): one traceback per fault (its type and
where it was raised) per interval, however many clients meet it."""


def _where(exc: BaseException) -> tuple[str, str, int]:
    """A fault's type and the file and line it was raised at: what tells two apart."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_next is not None:
        tb = tb.tb_next
    if tb is None:
        return type(exc).__name__, "", 0
    return type(exc).__name__, tb.tb_frame.f_code.co_filename, tb.tb_lineno

__all__ = ["JOIN_BELOW", "UNANSWERED_KEPT", "AnswerSide", "AnswerSlot", "ConnectionServices"]

_INT32 = struct.Struct(">i")
JOIN_BELOW = 16 * 1024
"""Writes below this many bytes are joined into one ``bytes``: uvloop sends a single buffer
straight away, a list of them costs a write context per call. Larger ones are not copied."""
UNANSWERED_KEPT = 1024
"""acks=0 Produce requests per connection whose correlation ids are kept, so that a broker's
answer to one is dropped rather than taken for an answer out of order."""


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


class _ClientGone(ConnectionResetError):
    """The client closed its connection while answers were owed to it."""


class AnswerSlot:
    """A place in the answer order, filled when the answer is known."""

    __slots__ = ("api", "done", "frame", "generation", "info", "produce", "proxy_answer", "t0")

    def __init__(self, generation: Generation, api: str = "", t0: float = 0.0,
                 info: RequestInfo | None = None, produce: list[PartitionSummary] | None = None,
                 proxy_answer: bool = False) -> None:
        self.frame: Frame | FramePieces | None = None
        self.done = False
        self.generation = generation
        self.api = api
        self.t0 = t0
        self.info = info
        self.produce = produce
        self.proxy_answer = proxy_answer


class AnswerSide:
    """The answers one client is owed, the broker connection most of them come on, and
    the client's socket they leave by, in order."""

    def __init__(self, services: ConnectionServices, client: FrameStream, node_id: int | None,
                 identity: ClientIdentity) -> None:
        self._services = services
        self.node_id = node_id
        """The broker node this connection stands for; ``None`` for bootstrap."""
        self._client = client
        self._writer = client.transport
        self.identity = identity
        """Who the client is, as the proxy knows it now (replaced, never changed)."""
        self._upstream: FrameStream | None = None
        self.upstream_address: tuple[str, int] | None = None
        self._slots: deque[AnswerSlot] = deque()
        self._pending: deque[tuple[int, AnswerSlot, Callable[[bytes], bytes] | None,
                                   Callable[[bytes], bytes | Awaitable[Frame | FramePieces]]
                                   | None]] = deque()
        self._unanswered: deque[int] = deque(maxlen=UNANSWERED_KEPT)
        """Correlation ids of the latest acks=0 requests forwarded, oldest first."""
        self._transforms: set[asyncio.Task[None]] = set()
        self._room = asyncio.Event()
        self._room.set()
        self.sasl = SaslTracker()
        """The connection's SASL bookkeeping (a failed login's close is expected)."""
        self._closed = False
        self._upstream_reported = False
        self._read_task: asyncio.Task[None] | None = None
        """The task reading the client's requests: cancelled when the broker side ends."""
        self._up_task: asyncio.Task[None] | None = None
        # What _answers_arrived, in the upstream's receive callback, leaves _read_upstream:
        self._answer_fault: Exception | None = None  # matching failed: raised there
        self._answers_owed: list[tuple[AnswerSlot, Frame]] = []  # matched: a node to settle
        self._client_left = False  # the client's socket failed: closed quietly there
        self._delivery_owed = False  # sent, the client's socket is full: drained there
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

    @property
    def log_context(self) -> dict[str, object]:
        """``extra=`` fields of connection-level log lines."""
        return {"client_address": self.client_address, "client_id": self.client_id,
                "principal": self.principal, "node_id": self.node_id}

    # ------------------------------------------------------------------ closing

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
        self._answers_owed = []
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

    # ------------------------------------------------------------------ to the client

    def _report(self, slot: AnswerSlot, size: int) -> None:
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

    def _complete(self, slot: AnswerSlot, frame: Frame) -> None:
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
        out: list[bytes | memoryview] = []
        total = 0
        while slots and slots[0].done:
            done = slots.popleft()
            self._services.generations.release(done.generation)
            frame = done.frame
            assert frame is not None
            if isinstance(frame, list):  # FramePieces: written as they are
                size = sum(map(len, frame))
                out.append(_INT32.pack(size))
                out.extend(frame)
            else:
                size = len(frame)
                out.append(_INT32.pack(size))
                out.append(frame)
            total += size
            done.frame = None
            if done.generation.produce.tallies:
                self._report(done, size)
        if total < JOIN_BELOW:
            self._writer.write(b"".join(out))
        else:
            self._writer.writelines(out)
        if len(slots) < self._services.generations.current.config.max_in_flight:
            self._room.set()

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

    # ------------------------------------------------------------------ from the broker

    def _answers_arrived(self, frames: list[Frame]) -> bool:
        """The broker stream's :attr:`~kiproxy.proxy.net.frame_stream.FrameStream.on_frames`:
        answers matched and sent in the receive callback when nothing needs waiting for
        (no node to settle, the client's socket takes what it is given), so that the
        common answer costs no wake-up of :meth:`_read_upstream`; anything else is left
        to it as it stands (see the attributes it reads)."""
        if self._closed or not self._client.drained:
            return False
        try:
            ready = self._matched(frames)
        except Exception as exc:  # raised by _read_upstream, as if it had matched them
            self._answer_fault = exc
            frames.clear()
            return False
        frames.clear()
        if not ready:  # acks=0 answers dropped, or answers whose transform fills them
            return True
        if self._services.nodes.unsettled:
            # A node (perhaps one these answers name) has its listener still opening: no
            # answer leaves before it is open (clients connect to the addresses given).
            self._answers_owed = ready
            return False
        _fill(ready)
        try:
            self._send_ready()
        except (ConnectionError, OSError, TimeoutError):
            self._client_left = True
            return False
        except Exception as exc:  # raised by _read_upstream, as if it had sent them
            self._answer_fault = exc
            return False
        if self._client.drained:
            return True
        self._delivery_owed = True
        return False

    def _matched(self, frames: list[Frame]) -> list[tuple[AnswerSlot, Frame]]:
        ready = []
        for frame in frames:
            matched = self._match_response(frame)
            if matched is not None:
                ready.append(matched)
        return ready

    async def _read_upstream(self) -> None:
        upstream = self._upstream
        assert upstream is not None
        upstream.on_frames = self._answers_arrived
        reason: str | None = "closed the connection"
        try:
            while not self._closed:
                frames = await upstream.read()
                fault, self._answer_fault = self._answer_fault, None
                if fault is not None:
                    raise fault
                if self._client_left:
                    reason = None  # the client went away, not the broker: close quietly
                    break
                ready, self._answers_owed = self._answers_owed, []
                if frames:
                    ready += self._matched(frames)
                elif not ready and not self._delivery_owed:
                    break  # the end of the stream
                self._delivery_owed = False
                nodes = self._services.nodes
                if nodes.unsettled:
                    await nodes.settle()
                _fill(ready)
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
        owed = len(self._slots)
        broken = reason != "closed the connection" or owed > 0  # a WARNING, saying so
        if broken and self._services.metrics is not None:
            self._services.metrics.upstream_errors.labels("broken").inc()
        # A broker closes the connection of a failed SASL login, which was logged (once
        # per client and interval) already: a client retrying would repeat this line.
        quiet = logging.DEBUG if self.sasl.failed else logging.INFO
        upstream = self._upstream_name()
        line = ("upstream %s %s; closing client %s (client_id %r)%s", upstream, reason,
                self.client_address, self.client_id,
                f", {owed} of its requests unanswered" if owed else "")
        if broken:  # one line per broker and reason per interval: clients reconnect at once
            self._services.upstreams.lost.warning((upstream, reason), *line,
                                                  more=MORE_IN_INTERVAL, extra=self.log_context)
        else:
            log.log(quiet, *line, extra=self.log_context)

    def _upstream_name(self) -> str:
        if self.upstream_address is None:
            return "broker"
        return f"broker {self.upstream_address[0]}:{self.upstream_address[1]}"

    def _match_response(self, frame: Frame) -> tuple[AnswerSlot, Frame] | None:
        if len(frame) < 4:
            raise ProtocolError(f"response of {len(frame)} bytes has no correlation id")
        (correlation_id,) = _INT32.unpack_from(frame, 0)
        if not self._pending:
            if self._answers_acks_zero(correlation_id):
                return None
            raise ProtocolError(f"response with correlation id {correlation_id} "
                                "answers no request")
        waiting = self._pending.popleft()
        expected, slot, on_response, transform = waiting
        if correlation_id != expected:
            if self._answers_acks_zero(correlation_id):
                self._pending.appendleft(waiting)  # still waiting for its answer
                return None
            raise ProtocolError(f"response correlation id {correlation_id} where "
                                f"{expected} was next")
        if transform is not None:
            if on_response is not None:  # first: the transform may answer pieces
                frame = on_response(frame)
            changed = transform(frame)
            if not isinstance(changed, (bytes, bytearray)):
                # Awaited: the slot is filled when it is done.
                task = asyncio.get_running_loop().create_task(self._transform(slot, changed))
                self._transforms.add(task)
                task.add_done_callback(self._transforms.discard)
                if inspect.iscoroutine(changed):
                    # A task cancelled before its first step (the connection closed) never
                    # awaits it: closed here, it is not reported as never awaited.
                    unawaited = changed
                    task.add_done_callback(lambda _: unawaited.close())
                return None
            return slot, changed
        if on_response is not None:
            # Rewriters decode with kio, which reads only immutable buffers.
            return slot, on_response(frame)
        return slot, frame

    def _answers_acks_zero(self, correlation_id: int) -> bool:
        """Whether ``correlation_id`` is that of a kept acks=0 request (the answer is then
        dropped); the acks=0 requests before it are forgotten, as answered or never to be."""
        unanswered = self._unanswered
        if correlation_id not in unanswered:
            return False
        while unanswered.popleft() != correlation_id:
            pass
        log.debug("broker %s answered acks=0 request %d of client %s; dropped (its client "
                  "expects no answer)", self._upstream_name(), correlation_id,
                  self.client_address, extra=self.log_context)
        return True

    async def _transform(self, slot: AnswerSlot,
                         transformed: Awaitable[Frame | FramePieces]) -> None:
        """Fill ``slot`` with what ``transformed`` gives, and send what is ready; a
        transform that fails closes the connection as an answer the proxy cannot carry
        does."""
        try:
            out = await transformed
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
            else:  # the proxy's own fault: its traceback, once per kind per interval
                _failures.log(logging.ERROR, _where(exc),
                              "answer from %s to client %s could not be handled; closing it",
                              self._upstream_name(), self.client_address,
                              more=" ({count} more since the last line)", exc_info=exc,
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


def _fill(ready: list[tuple[AnswerSlot, Frame]]) -> None:
    """Each slot of ``ready`` filled with its answer."""
    for slot, frame in ready:
        slot.frame = frame
        slot.done = True
