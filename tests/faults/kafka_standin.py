"""A TCP stand-in for a Kafka broker on loopback that forwards, hangs, trickles, closes or
garbles, switched at run time.

:class:`FaultyFront` listens on a loopback port and treats each connection as its current
mode says:

* ``forward`` - pass bytes both ways to ``target`` (a real broker);
* ``trickle`` - forward, but the broker's answers go back ``trickle_bytes`` at a time
  every ``trickle_delay`` seconds (a slow broker);
* ``hang`` - accept and read, never answer (a broker that wedged);
* ``close`` - accept and close at once (a broker that refuses the connection);
* ``garble`` - answer every request with a frame of random bytes.

:meth:`FaultyFront.set_mode` applies to new connections and closes the open ones, so a
client reconnects into the new mode. For a client to use the front for every request,
the broker must advertise the front's address: :func:`broker_behind` starts a Tansu
listening on a port of its own and advertising the front's (the launcher of
``kiproxy dev``, :class:`kiproxy_dev.tansu.EmbeddedBroker`).

The server runs on an event loop of its own in a daemon thread; nothing here imports
the proxy.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Literal

from kiproxy_dev.tansu import EmbeddedBroker, free_port

Mode = Literal["forward", "trickle", "hang", "close", "garble"]

__all__ = ["FaultyFront", "Mode", "TansuBehind", "broker_behind", "free_port"]


class FaultyFront:
    """A loopback TCP server in front of ``target`` (``host:port``); see the module."""

    def __init__(self, target: str | None = None, *, mode: Mode = "forward",
                 port: int | None = None, trickle_bytes: int = 16,
                 trickle_delay: float = 0.5) -> None:
        self.target = target
        self.mode: Mode = mode
        self.port = port or free_port()
        self.trickle_bytes = trickle_bytes
        self.trickle_delay = trickle_delay
        self.connections = 0
        """Connections accepted so far."""
        self._loop = asyncio.new_event_loop()
        self._writers: set[asyncio.StreamWriter] = set()
        self._server: asyncio.Server | None = None
        self._thread = threading.Thread(target=self._loop.run_forever, name="faulty-front",
                                        daemon=True)

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT`` of the front."""
        return f"127.0.0.1:{self.port}"

    def start(self) -> FaultyFront:
        """Listen (returns self)."""
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._listen(), self._loop).result(10)
        return self

    def stop(self) -> None:
        """Close the listener and every connection, and end the thread."""
        async def close() -> None:
            if self._server is not None:
                self._server.close()
            for writer in list(self._writers):
                writer.transport.abort()

        asyncio.run_coroutine_threadsafe(close(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def set_mode(self, mode: Mode) -> None:
        """Serve new connections in ``mode``; close the open ones."""
        self.mode = mode

        async def drop() -> None:
            for writer in list(self._writers):
                writer.transport.abort()

        asyncio.run_coroutine_threadsafe(drop(), self._loop).result(10)

    def __enter__(self) -> FaultyFront:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ serving

    async def _listen(self) -> None:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port,
                                                  reuse_address=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        self._writers.add(writer)
        mode = self.mode
        try:
            if mode == "close":
                return
            if mode == "hang":
                while await reader.read(65536):
                    pass
                return
            if mode == "garble":
                await self._garble(reader, writer)
                return
            await self._forward(reader, writer, trickle=mode == "trickle")
        except (ConnectionError, OSError, asyncio.IncompleteReadError):
            pass
        finally:
            self._writers.discard(writer)
            writer.transport.abort()

    @staticmethod
    async def _garble(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while True:
            size = int.from_bytes(await reader.readexactly(4), "big")
            await reader.readexactly(size)
            junk = os.urandom(24)
            writer.write(len(junk).to_bytes(4, "big") + junk)
            await writer.drain()

    async def _forward(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, *,
                       trickle: bool) -> None:
        assert self.target is not None, "forward and trickle need a target"
        host, _, port = self.target.rpartition(":")
        up_reader, up_writer = await asyncio.open_connection(host, int(port))
        self._writers.add(up_writer)

        async def pump(src: asyncio.StreamReader, dst: asyncio.StreamWriter,
                       slow: bool) -> None:
            while data := await src.read(65536):
                if not slow:
                    dst.write(data)
                    await dst.drain()
                    continue
                for i in range(0, len(data), self.trickle_bytes):
                    dst.write(data[i:i + self.trickle_bytes])
                    await dst.drain()
                    await asyncio.sleep(self.trickle_delay)

        try:
            tasks = [asyncio.ensure_future(pump(reader, up_writer, False)),
                     asyncio.ensure_future(pump(up_reader, writer, trickle))]
            _, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
            for task in pending:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        finally:
            self._writers.discard(up_writer)
            up_writer.transport.abort()


class TansuBehind(EmbeddedBroker):
    """A Tansu broker (memory storage) listening on ``port`` and advertising ``advertised``
    (a front's address), so that every client request goes through the front."""

    def __init__(self, advertised: str, *, port: int | None = None,
                 log_path: Path | None = None) -> None:
        super().__init__(port, log_path=log_path, advertised=advertised)

    @property
    def address(self) -> str:
        """``127.0.0.1:PORT`` the broker listens on (reach it there, not through a front)."""
        return self.bootstrap


@contextlib.contextmanager
def broker_behind(front: FaultyFront, log_path: Path | None = None) -> Iterator[TansuBehind]:
    """A started :class:`TansuBehind` advertising ``front`` and set as its target."""
    broker = TansuBehind(front.address, log_path=log_path)
    front.target = broker.address
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()
