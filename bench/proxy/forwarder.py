"""The ``uvloop`` scenario's hop: the least a Python event-loop TCP proxy does.

Contract: ``python -m bench.proxy.forwarder LISTEN_PORT UPSTREAM_PORT`` listens on
127.0.0.1:LISTEN_PORT and joins each accepted connection to a new connection to
127.0.0.1:UPSTREAM_PORT, copying bytes both ways as they arrive, with no Kafka
awareness: uvloop, one thread, ``asyncio.Protocol.data_received`` handing each receive to
the other socket's ``write``, reading paused while the other socket's write buffer is
above its high-water mark. It prints ``ready`` once listening and runs until killed.

kiproxy's passthrough does strictly more than this per byte and per request (frames,
headers, answer matching), so the ratio of its CPU per GB to this hop's says how far it
is from the floor of its runtime, as haproxy's says how far it is from a C proxy's.
"""

from __future__ import annotations

import asyncio
import sys
from typing import cast

import uvloop


class _Side(asyncio.Protocol):
    """One socket of a joined pair: what it receives is written to its peer."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.peer: _Side | None = None
        self._early: list[bytes] = []  # received before the peer connected

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass

    def data_received(self, data: bytes) -> None:
        peer = self.peer
        if peer is None or peer.transport is None:
            self._early.append(data)
            return
        peer.transport.write(data)

    def joined(self, peer: _Side) -> None:
        """Join to ``peer`` (connected) and write it what arrived before."""
        self.peer = peer
        assert peer.transport is not None
        for data in self._early:
            peer.transport.write(data)
        self._early.clear()

    def connection_lost(self, exc: Exception | None) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.close()

    def pause_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.pause_reading()

    def resume_writing(self) -> None:
        if self.peer is not None and self.peer.transport is not None:
            self.peer.transport.resume_reading()


async def serve(listen_port: int, upstream_port: int) -> None:
    """Accept and join connections until cancelled."""
    loop = asyncio.get_running_loop()
    joins: set[asyncio.Task[None]] = set()

    async def join(client: _Side) -> None:
        try:
            _, upstream = await loop.create_connection(_Side, "127.0.0.1", upstream_port)
        except OSError:
            if client.transport is not None:
                client.transport.close()
            return
        upstream.joined(client)
        client.joined(upstream)

    def accepted() -> _Side:
        client = _Side()
        task = loop.create_task(join(client))
        joins.add(task)
        task.add_done_callback(joins.discard)
        return client

    server = await loop.create_server(accepted, "127.0.0.1", listen_port)
    print("ready", flush=True)
    async with server:
        await server.serve_forever()


def main(argv: list[str]) -> None:
    listen_port, upstream_port = (int(a) for a in argv)
    uvloop.run(serve(listen_port, upstream_port))


if __name__ == "__main__":
    main(sys.argv[1:])
