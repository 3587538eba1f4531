"""A TCP relay that forwards bytes and, on demand, cuts every connection it carries.

Used by the fault tests to stand between kiproxy (or a client) and the broker.
The relay runs its own asyncio loop on a daemon thread, so the test thread stays
free for the Kafka clients. :meth:`FaultRelay.cut` aborts every live connection
on both sides with a TCP RST (``SO_LINGER`` 0), at whatever point of a frame the
bytes happen to be; :meth:`FaultRelay.start_faults` does that at random moments
until :meth:`FaultRelay.stop_faults`.
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import struct
import threading
import time
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

from kiproxy.protocol.errors import ProtocolError
from kiproxy.protocol.framing import FrameDecoder

__all__ = ["FaultRelay", "RelayStats", "wait_until"]

_LINGER_RST = struct.pack("ii", 1, 0)
_HIGH_WATER = 1 << 20
T = TypeVar("T")


@dataclass
class RelayStats:
    """What the relay did, for the test's report."""

    accepted: int = 0
    """Connections accepted from the relay's clients."""
    cuts: int = 0
    """Times every live connection was cut."""
    connections_cut: int = 0
    """Connection pairs aborted by the cuts."""
    bytes_forwarded: int = 0
    """Bytes carried, both directions."""


def _rst(transport: asyncio.BaseTransport | None) -> None:
    """Abort ``transport`` so that the peer sees a reset, not an orderly close."""
    if transport is None or transport.is_closing():
        return
    sock = transport.get_extra_info("socket")
    if sock is not None:
        with contextlib.suppress(OSError):
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, _LINGER_RST)
    transport.abort()  # type: ignore[attr-defined]


class _Side(asyncio.Protocol):
    """One socket of a relayed pair; whatever it reads goes to the other side."""

    def __init__(self, relay: FaultRelay, pair: _Pair, tap: Callable[[bytes], None] | None = None,
                 delay: float = 0.0) -> None:
        self.relay = relay
        self.pair = pair
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self._early: list[bytes] = []
        self._tap = tap
        self._frames = FrameDecoder(2**31 - 1) if tap is not None else None
        self._delay = delay
        self._delayed: deque[tuple[float, bytes]] = deque()
        self._timer: asyncio.TimerHandle | None = None
        self._eof_pending = False

    def _send(self, data: bytes) -> None:
        """Pass ``data`` to the other side, ``delay`` seconds later if there is one."""
        assert self.peer is not None and self.peer.transport is not None
        self.relay.stats.bytes_forwarded += len(data)
        if not self._delay:
            self.peer.transport.write(data)
            return
        loop = asyncio.get_running_loop()
        self._delayed.append((loop.time() + self._delay, data))
        if self._timer is None:
            self._timer = loop.call_at(self._delayed[0][0], self._release)

    def _release(self) -> None:
        self._timer = None
        if self.pair.closed or self.peer is None or self.peer.transport is None:
            self._delayed.clear()  # cut: whatever was on its way is lost
            return
        loop = asyncio.get_running_loop()
        while self._delayed and self._delayed[0][0] <= loop.time():
            self.peer.transport.write(self._delayed.popleft()[1])
        if self._delayed:
            self._timer = loop.call_at(self._delayed[0][0], self._release)
        elif self._eof_pending:
            self._pass_eof()

    def _watch(self, data: bytes) -> None:
        if self._frames is None or self._tap is None:
            return
        try:
            for frame in self._frames.feed(data):
                self._tap(frame)
        except ProtocolError:
            self._frames = None  # not Kafka framing: stop looking

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        self.transport = transport
        transport.set_write_buffer_limits(high=_HIGH_WATER)

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None or peer.transport is None:
            self._early.append(data)  # the upstream side is still connecting
            return
        self._send(data)
        self._watch(data)

    def flush_early(self) -> None:
        """Send what arrived before the other side was connected."""
        assert self.peer is not None and self.peer.transport is not None
        for data in self._early:
            self._send(data)
            self._watch(data)
        self._early.clear()

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            with contextlib.suppress(RuntimeError):
                self.peer.transport.resume_reading()

    def eof_received(self) -> bool:
        if self._delayed:
            self._eof_pending = True  # after what is still on its way
        else:
            self._pass_eof()
        return True

    def _pass_eof(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            with contextlib.suppress(OSError, RuntimeError):
                self.peer.transport.write_eof()

    def connection_lost(self, exc: Exception | None) -> None:
        self.pair.close()


class _Pair:
    """A client-side socket and the upstream socket the relay opened for it."""

    def __init__(self, relay: FaultRelay) -> None:
        self.relay = relay
        self.client = _Side(relay, self, tap=relay.on_request)
        self.upstream = _Side(relay, self, delay=relay.response_delay)
        self.client.peer = self.upstream
        self.upstream.peer = self.client
        self.closed = False

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.relay._pairs.discard(self)
        for side in (self.client, self.upstream):
            if side.transport is not None and not side.transport.is_closing():
                side.transport.close()

    def reset(self) -> None:
        self.closed = True
        self.relay._pairs.discard(self)
        _rst(self.client.transport)
        _rst(self.upstream.transport)


class FaultRelay:
    """Forwards ``127.0.0.1:port`` to ``target``; cuts connections when told to.

    ``on_request`` (if given) sees every whole request frame forwarded to the
    target (without its length prefix), on the relay's thread. ``response_delay``
    holds what the target sends back for that many seconds (a network's round
    trip), which widens the window in which a cut loses an answer to a request
    the target already carried out.
    """

    def __init__(self, target: tuple[str, int], port: int = 0, *, seed: int | None = None,
                 on_request: Callable[[bytes], None] | None = None,
                 response_delay: float = 0.0) -> None:
        self.target = target
        self.on_request = on_request
        self.response_delay = response_delay
        self.port = port
        self.stats = RelayStats()
        self.random = random.Random(seed)
        self._pairs: set[_Pair] = set()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name=f"fault-relay-{target[1]}")
        self._server: asyncio.Server | None = None
        self._faults: asyncio.Task[None] | None = None

    @property
    def address(self) -> str:
        """``host:port`` of the relay."""
        return f"127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> FaultRelay:
        """Listen (on a free port unless one was given) and start relaying."""
        self._thread.start()
        self._call(self._listen())
        return self

    def close(self) -> None:
        """Stop listening, reset every connection and stop the relay's thread."""
        if not self._thread.is_alive():
            return
        with contextlib.suppress(Exception):
            self._call(self._shutdown())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    def __enter__(self) -> FaultRelay:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ faults

    def cut(self) -> int:
        """Reset every live connection now; return how many pairs were cut."""
        return self._call(self._cut())

    def start_faults(self, min_interval: float, max_interval: float) -> None:
        """Cut every connection at random intervals in ``[min_interval, max_interval]`` s."""
        self._call(self._start_faults(min_interval, max_interval))

    def stop_faults(self) -> None:
        """No more cuts; connections from now on stay up."""
        self._call(self._stop_faults())

    @property
    def live_connections(self) -> int:
        """Relayed connection pairs open right now."""
        return len(self._pairs)

    # ------------------------------------------------------------------ on the loop

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(15)

    async def _listen(self) -> None:
        self._server = await self._loop.create_server(
            self._accepted, "127.0.0.1", self.port, reuse_address=True)
        self.port = self._server.sockets[0].getsockname()[1]

    def _accepted(self) -> asyncio.Protocol:
        pair = _Pair(self)
        self._pairs.add(pair)
        self.stats.accepted += 1
        self._loop.create_task(self._connect_upstream(pair))
        return pair.client

    async def _connect_upstream(self, pair: _Pair) -> None:
        try:
            await self._loop.create_connection(lambda: pair.upstream, *self.target)
        except OSError:
            _rst(pair.client.transport)
            pair.close()
            return
        if pair.closed:
            _rst(pair.upstream.transport)
            return
        pair.client.flush_early()

    async def _cut(self) -> int:
        pairs = list(self._pairs)
        for pair in pairs:
            pair.reset()
        self.stats.cuts += 1
        self.stats.connections_cut += len(pairs)
        return len(pairs)

    async def _start_faults(self, lo: float, hi: float) -> None:
        await self._stop_faults()
        self._faults = self._loop.create_task(self._inject(lo, hi))

    async def _stop_faults(self) -> None:
        task, self._faults = self._faults, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task

    async def _inject(self, lo: float, hi: float) -> None:
        while True:
            await asyncio.sleep(self.random.uniform(lo, hi))
            await self._cut()

    async def _shutdown(self) -> None:
        await self._stop_faults()
        if self._server is not None:
            self._server.close()
        await self._cut()


def wait_until(predicate: Callable[[], object], timeout: float, interval: float = 0.05) -> bool:
    """Poll ``predicate()`` until it is true or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return False
