"""One socket as a stream of whole Kafka frames: the asyncio shell of a FrameAssembler.

Contract: a :class:`FrameStream` is an ``asyncio.BufferedProtocol`` around
:class:`kiproxy.protocol.framing.FrameAssembler`, used for both the client and
the broker side of a connection. A client's frame of 16 KiB up to
:data:`CLIENT_WHOLE_UP_TO` (1 MiB) is received straight into a ``bytes`` object of its
own size, allocated on its length prefix, and handed over as it is; a larger one into
buffers that grow with the bytes that arrive (never with the length a frame claims),
joined once into ``bytes``. A broker's stream (``whole_frames``) gets every large
frame's buffer whole as soon as its length prefix arrives, as Kafka's clients
allocate a response, and hands that buffer over with no join: the broker is the
cluster the proxy serves, and its answers are bounded by ``max_response_size``.
The socket is read only while its owner waits in :meth:`FrameStream.read`, so
while the owner handles what it got, TCP pushes back. An owner may also set
:attr:`FrameStream.on_frames`: frames that arrive while it waits are then handed to
that function first, in the receive callback, and the owner wakes only for what the
function leaves it (see there). With a receive budget
(client sockets), the bytes of a partial frame count against the process-wide
:class:`~kiproxy.proxy.net.buffers.ReceiveBudget`, which may hold the socket back.

Pausing is decided late, without giving that up: frames that reach an owner
already waiting for them wake it, and whether to pause the socket is decided
by a callback queued behind that wake-up, which the loop runs before it polls
its sockets again. An owner that handled the frames and came back to
:meth:`FrameStream.read` in the same step (a request only forwarded, a response
only passed on) then finds the socket still being read: no pause and resume,
two system calls and a trip through the event loop's watchers, per frame. An
owner still busy finds it paused before another byte is received. A receive
that filled the whole buffer pauses at once (the transport would otherwise
receive again before the owner runs).

PROXY protocol: a client stream may start with a pre-framing phase in which
the first bytes go to :func:`kiproxy.protocol.proxy_header.parse_proxy_header`
(from the start, each time more arrive) until it answers something other than
``Incomplete``; the bytes after the header (all of them, when there is none)
then go to the assembler as if just received. With ``proxy_header="read"``
the owner waits for that answer in :meth:`FrameStream.read_proxy_header` before
it reads any frame and decides what to do with it; with ``"refuse"`` (a
listener with ``proxy_protocol: off``) the owner never waits, and a PROXY
header, well-formed or not, fails the stream with a
:class:`~kiproxy.protocol.proxy_header.ProxyHeaderError` naming the setting.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import deque
from collections.abc import Callable, Coroutine
from typing import TYPE_CHECKING, Any, Literal, cast

from kiproxy.protocol.errors import FrameTooLarge, ProtocolError
from kiproxy.protocol.framing import FrameAssembler
from kiproxy.protocol.proxy_header import (
    Incomplete,
    Local,
    ParsedProxyHeader,
    ProxyHeader,
    ProxyHeaderError,
    parse_proxy_header,
)
from kiproxy.proxy.net.proxy_protocol import Refuse, accept_proxy_header

if TYPE_CHECKING:
    from kiproxy.proxy.net.buffers import ReceiveBudget

__all__ = ["CLIENT_WHOLE_UP_TO", "CLOSE_TIMEOUT", "Frame", "FramePieces", "FrameStream",
           "ProxyHeaderMode"]

ProxyHeaderMode = Literal["read", "refuse"]
"""How a client stream treats a PROXY header (see the module docstring)."""

_WHOLE_FROM = 64 * 1024
"""The assembler's smallest ``part_size`` (its chunk size)."""

CLIENT_WHOLE_UP_TO = 1024 * 1024
"""A client's frame up to this size gets its whole buffer on its length prefix.

Kafka's producers send requests of at most ``max.request.size`` (1 MiB by default), so
almost every Produce request is received into the one ``bytes`` object handed on: no
join (a copy of every byte, a tenth of the proxy's CPU per GB) and no receive per
growing part. The allocation claims address space, not memory: the pages of a buffer
are faulted in as bytes are received into them, so a client that sends a prefix and
stalls makes the process hold at most this much address space and a few pages, and
the bytes it did send count against :class:`~kiproxy.proxy.net.buffers.ReceiveBudget`
as before. A longer frame grows from buffers of this size."""

_PREFACE_CHUNK = 2048
"""Bytes received at a time while the PROXY header is looked for."""

CLOSE_TIMEOUT = 2.0
"""Seconds a closing socket may take to flush before it is aborted."""

Frame = bytes
"""A frame without its length prefix (see the assembler: a large one is received straight
into the ``bytes`` object handed out)."""

FramePieces = list[bytes | memoryview]
"""A frame without its length prefix as pieces, in order, to be written without joining
them (a Fetch answer whose hooked partitions were spliced)."""


class FrameStream(asyncio.BufferedProtocol):
    """One socket as a stream of whole frames; the asyncio shell of a FrameAssembler.

    The socket is read only while its owner waits in :meth:`read`: frames that
    arrive are kept for the owner and reading pauses until it asks again, so
    while a request (or a batch of responses) is handled nothing more is read and
    TCP pushes back. :meth:`drain` waits while the write buffer is above its
    high-water mark, as ``StreamWriter.drain`` does. With a ``budget`` (client
    sockets), the bytes of a partial frame count against the process-wide
    :class:`~kiproxy.proxy.net.buffers.ReceiveBudget`, which may hold the socket back.
    """

    def __init__(self, max_frame_size: int,
                 on_open: Callable[[FrameStream], Coroutine[None, None, None]] | None = None,
                 budget: ReceiveBudget | None = None, *,
                 proxy_header: ProxyHeaderMode | None = None,
                 whole_frames: bool = False) -> None:
        self._assembler = (FrameAssembler(max_frame_size, part_size=max(max_frame_size,
                                                                        _WHOLE_FROM))
                           if whole_frames
                           else FrameAssembler(max_frame_size, part_size=CLIENT_WHOLE_UP_TO))
        self._proxy_mode = proxy_header
        self._preface: bytearray | None = None if proxy_header is None else bytearray()
        self._preface_buffer: bytearray | None = None
        self.proxy_header: ParsedProxyHeader | ProxyHeaderError | None = None
        """What the PROXY header phase found (None until it ended, or without one)."""
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
        self._pause_check = False  # _pause_unless_waiting is queued
        self.on_frames: Callable[[list[Frame]], bool] | None = None
        """Set by the owner: called with the frames that arrive while the owner waits in
        :meth:`read` (none kept for it), before it is woken. It takes from the front of
        the list the frames it handles; it answers True when it took them all and the
        owner may go on waiting (the socket is still read), False to wake the owner,
        whose :meth:`read` returns what is left - ``[]`` when it left none, for the
        owner to tell from the end of the stream by what the function left it. It
        must not raise: what the owner should raise, it keeps for the owner."""
        self._handed = False  # on_frames woke the owner: read() returns even with no frame
        self._offered = 0  # length of the buffer the last get_buffer() handed out
        self._waiter: asyncio.Future[None] | None = None
        self._drain_waiters: deque[asyncio.Future[None]] = deque()
        # Kept: asyncio.get_running_loop() costs a getpid() system call on Python 3.11.
        self._loop = asyncio.get_running_loop()
        self._closed: asyncio.Future[None] = self._loop.create_future()

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
            self._task = self._loop.create_task(self._on_open(self))

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._preface is not None:
            if self._preface_buffer is None:
                self._preface_buffer = bytearray(_PREFACE_CHUNK)
            return memoryview(self._preface_buffer)
        buffer = self._assembler.get_buffer()
        self._offered = len(buffer)
        return buffer

    def buffer_updated(self, nbytes: int) -> None:
        if self._error is not None:
            return  # the stream failed (reading is paused): what still arrives is dropped
        if self._preface is not None:
            assert self._preface_buffer is not None
            self._preface += self._preface_buffer[:nbytes]
            self._look_for_proxy_header()
            return
        try:
            frames = self._assembler.buffer_updated(nbytes)
        except ProtocolError as exc:
            self._fail(exc)
            return
        self._received(frames, nbytes == self._offered)

    def _fail(self, exc: ProtocolError) -> None:
        if self._budget is not None and isinstance(exc, FrameTooLarge):
            self._budget.refused_frame()
        self._error = exc
        self._pause()
        self._wake()

    def _received(self, frames: list[Frame], filled: bool = True) -> None:
        if self._budget is not None:
            held = self._assembler.buffered
            if held or self._budget_held:
                self._budget_held = held
                self._budget.update(self, held)
        if frames:
            waiter = self._waiter
            handler = self.on_frames
            if handler is not None and waiter is not None and not waiter.done() \
                    and not self._frames:
                # Handled in this callback: no wake-up of the owner, no pause.
                if handler(frames):
                    return
                self._handed = True  # the owner is woken, as for frames
            self._frames.extend(frames)
            if filled or waiter is None or waiter.done():
                self._pause()
                self._wake()
                return
            waiter.set_result(None)  # _wake(), the waiter known to be waiting
            if not self._pause_check:
                # Queued behind the owner's wake-up: it runs after the owner's step and
                # before the loop polls the socket again.
                self._pause_check = True
                self._loop.call_soon(self._pause_unless_waiting)

    def _pause_unless_waiting(self) -> None:
        """Pause the socket unless the owner, woken for frames, is waiting for more."""
        self._pause_check = False
        waiter = self._waiter
        if waiter is None or waiter.done():
            self._pause()

    def _look_for_proxy_header(self) -> None:
        """The pre-framing phase: judge the bytes so far; once decided, hand the rest on."""
        data = self._preface
        assert data is not None
        parsed: ParsedProxyHeader | ProxyHeaderError
        try:
            parsed = parse_proxy_header(data)
        except ProxyHeaderError as exc:
            parsed = exc
        if isinstance(parsed, Incomplete):
            return
        self._preface = self._preface_buffer = None
        self.proxy_header = parsed
        if self._proxy_mode == "refuse":
            peer = self.get_extra_info("peername")
            decision = accept_proxy_header("off", (), (str(peer[0]), int(peer[1])) if peer
                                           else ("unknown", 0), parsed)
            if isinstance(decision, Refuse):
                self._fail(ProxyHeaderError(decision.reason))
                return
        if isinstance(parsed, ProxyHeaderError):
            self._wake()  # the owner judges it (read_proxy_header)
            return
        rest = memoryview(data)[parsed.length if isinstance(parsed, ProxyHeader | Local)
                                else 0:]
        frames: list[Frame] = []
        try:
            while rest:
                buffer = self._assembler.get_buffer()
                n = min(len(buffer), len(rest))
                buffer[:n] = rest[:n]
                rest = rest[n:]
                frames.extend(self._assembler.buffer_updated(n))
        except ProtocolError as exc:
            self._fail(exc)
            return
        self._received(frames)
        self._wake()

    async def read_proxy_header(self, timeout: float) -> ParsedProxyHeader | ProxyHeaderError:
        """The PROXY header phase's answer (``proxy_header="read"``), waiting at most
        ``timeout`` seconds; ``Incomplete`` when it ran out or the client closed first."""
        deadline = self._loop.time() + timeout
        while self.proxy_header is None:
            if self._error is not None or self._eof:
                return Incomplete(0)
            self._resume()
            waiter = self._waiter = self._loop.create_future()
            try:
                await asyncio.wait_for(waiter, deadline - self._loop.time())
            except TimeoutError:
                return Incomplete(0)
            finally:
                self._waiter = None
        return self.proxy_header

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
        """The frames received since the last call, waiting for one; ``[]`` at end of stream
        (or when :attr:`on_frames` woke the owner and left it no frame).

        Raises the :class:`ProtocolError` of a bad length prefix, or the error that
        broke the connection.
        """
        while True:
            if self._frames or self._handed:
                self._handed = False
                frames, self._frames = self._frames, []
                return frames
            if self._error is not None:
                raise self._error
            if self._eof:
                return []
            if not self._reading:  # usually still reading (see the module docstring)
                self._resume()
            waiter = self._waiter = self._loop.create_future()
            try:
                await waiter
            finally:
                self._waiter = None

    @property
    def drained(self) -> bool:
        """Whether :meth:`drain` would return at once (the usual case): a caller that
        checks this first spares a coroutine per write."""
        transport = self._transport
        return (not self._write_paused and not self._lost and transport is not None
                and not transport.is_closing() and not isinstance(self._error, OSError))

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
        waiter = self._loop.create_future()
        self._drain_waiters.append(waiter)
        await waiter

    async def close(self, timeout: float = CLOSE_TIMEOUT) -> None:
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
