"""FrameStream over a real socket pair: nothing is read while its owner is busy, and an
owner's ``take`` callback gets frames where they arrive, or leaves them to read()."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import pytest

from kiproxy.proxy.net.frame_stream import Frame, FrameStream


def _framed(payload: bytes) -> bytes:
    return struct.pack(">i", len(payload)) + payload


@asynccontextmanager
async def _connected(take: Callable[[list[Frame]], bool] | None = None,
                     ) -> AsyncIterator[tuple[FrameStream, asyncio.BaseTransport, socket.socket]]:
    ours, peer = socket.socketpair()
    stream = FrameStream(1 << 20, take=take)
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


async def test_take_gets_frames_while_the_owner_waits_and_may_leave_them_to_read() -> None:
    taken: list[Frame] = []
    accept = True

    def take(frames: list[Frame]) -> bool:
        if accept:
            taken.extend(frames)
        return accept

    async with _connected(take) as (stream, _, peer):
        reader = asyncio.create_task(stream.read())
        await asyncio.sleep(0)
        peer.sendall(_framed(b"taken"))
        await asyncio.sleep(0.05)
        assert taken == [b"taken"] and not reader.done()  # the owner goes on waiting
        accept = False
        peer.sendall(_framed(b"left to read"))
        assert await asyncio.wait_for(reader, 1) == [b"left to read"]


async def test_an_error_take_hands_over_is_raised_by_read() -> None:
    stream_box: list[FrameStream] = []

    def take(frames: list[Frame]) -> bool:
        stream_box[0].fail(ValueError(f"cannot pass on {bytes(frames[0])!r}"))
        return True

    async with _connected(take) as (stream, _, peer):
        stream_box.append(stream)
        reader = asyncio.create_task(stream.read())
        await asyncio.sleep(0)
        peer.sendall(_framed(b"bad"))
        with pytest.raises(ValueError, match="cannot pass on b'bad'"):
            await asyncio.wait_for(reader, 1)
