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


async def test_a_client_frame_up_to_1_mib_is_received_into_one_buffer_of_its_size() -> None:
    # Kafka's producers send requests of up to max.request.size (1 MiB by default): such
    # a frame gets its whole buffer on its length prefix and is handed over as that
    # buffer, no join; a larger one starts with a buffer of the same 1 MiB.
    from kiproxy.proxy.net.frame_stream import CLIENT_WHOLE_UP_TO

    for size, first in ((CLIENT_WHOLE_UP_TO, CLIENT_WHOLE_UP_TO),
                        (3 * CLIENT_WHOLE_UP_TO, CLIENT_WHOLE_UP_TO)):
        stream = FrameStream(4 * CLIENT_WHOLE_UP_TO)
        payload = bytes(range(256)) * (size // 256)
        wire = _framed(payload)
        buffer = stream.get_buffer(-1)
        buffer[:1000] = wire[:1000]
        stream.buffer_updated(1000)
        buffer = stream.get_buffer(-1)
        assert len(buffer) == first - 996
        sent = 1000
        while sent < len(wire):
            n = min(len(buffer), len(wire) - sent)
            buffer[:n] = wire[sent:sent + n]
            sent += n
            stream.buffer_updated(n)
            if sent < len(wire):
                buffer = stream.get_buffer(-1)
        assert await asyncio.wait_for(stream.read(), 1) == [payload]
