"""FrameStream over a real socket pair: nothing is read while its owner is busy, and an
owner that reads again at once gets every frame, in order."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from kiproxy.proxy.net.frame_stream import Frame, FrameStream


def _framed(payload: bytes) -> bytes:
    return struct.pack(">i", len(payload)) + payload


@asynccontextmanager
async def _connected() -> AsyncIterator[tuple[FrameStream, asyncio.BaseTransport,
                                               socket.socket]]:
    ours, peer = socket.socketpair()
    stream = FrameStream(1 << 20)
    transport, _ = await asyncio.get_running_loop().connect_accepted_socket(
        lambda: stream, ours)
    try:
        yield stream, transport, peer
    finally:
        transport.close()
        peer.close()


async def test_a_busy_owner_gets_no_more_bytes_until_it_reads_again() -> None:
    async with _connected() as (stream, transport, peer):
        peer.sendall(_framed(b"one"))
        assert await asyncio.wait_for(stream.read(), 1) == [b"one"]
        # The owner is busy with "one" (not in read()): "two" stays in the socket.
        peer.sendall(_framed(b"two"))
        await asyncio.sleep(0.05)
        assert not transport.is_reading()  # type: ignore[attr-defined]
        assert await asyncio.wait_for(stream.read(), 1) == [b"two"]


async def test_an_owner_that_reads_again_at_once_gets_every_frame_in_order() -> None:
    async with _connected() as (stream, _, peer):
        got: list[Frame] = []

        async def owner() -> None:
            while len(got) < 50:
                got.extend(await stream.read())

        task = asyncio.create_task(owner())
        for i in range(50):
            peer.sendall(_framed(b"frame %d" % i))
            await asyncio.sleep(0)
        await asyncio.wait_for(task, 2)
        assert got == [b"frame %d" % i for i in range(50)]
