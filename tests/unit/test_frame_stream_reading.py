"""FrameStream over a real socket pair: nothing is read while its owner is busy, and an
owner that reads again at once gets every frame, in order; with ``on_frames``, frames the
handler takes never wake the owner, and what it leaves reaches the owner in order."""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import AsyncIterator, Callable
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


# ------------------------------------------------------------------ on_frames


async def _owner_waiting(stream: FrameStream) -> asyncio.Task[list[Frame]]:
    task = asyncio.create_task(stream.read())
    await asyncio.sleep(0)  # the owner now waits in read()
    return task


async def _until(condition: Callable[[], bool]) -> None:
    for _ in range(200):
        if condition():
            return
        await asyncio.sleep(0.005)
    raise AssertionError("not reached")


async def test_frames_the_handler_takes_never_wake_the_owner() -> None:
    async with _connected() as (stream, transport, peer):
        taken: list[Frame] = []

        def take_all(frames: list[Frame]) -> bool:
            taken.extend(frames)
            frames.clear()
            return True

        stream.on_frames = take_all
        owner = await _owner_waiting(stream)
        for i in range(5):
            peer.sendall(_framed(b"frame %d" % i))
        await _until(lambda: len(taken) == 5)
        assert taken == [b"frame %d" % i for i in range(5)]
        assert not owner.done()  # never woken
        assert transport.is_reading()  # type: ignore[attr-defined]
        peer.sendall(_framed(b"last"))
        await _until(lambda: len(taken) == 6)
        owner.cancel()


async def test_what_the_handler_leaves_reaches_the_owner_in_order() -> None:
    async with _connected() as (stream, _, peer):
        taken: list[Frame] = []

        def take_one(frames: list[Frame]) -> bool:
            taken.append(frames.pop(0))
            return not frames

        stream.on_frames = take_one
        owner = await _owner_waiting(stream)
        peer.sendall(_framed(b"a") + _framed(b"b") + _framed(b"c"))
        assert await asyncio.wait_for(owner, 1) == [b"b", b"c"]
        assert taken == [b"a"]
        # The owner busy (not in read()): nothing reaches the handler.
        peer.sendall(_framed(b"d"))
        await asyncio.sleep(0.05)
        assert taken == [b"a"]
        owner = await _owner_waiting(stream)  # waiting again: the handler gets it
        await _until(lambda: taken == [b"a", b"d"])
        assert not owner.done()
        owner.cancel()


async def test_a_handler_that_leaves_no_frame_still_wakes_the_owner() -> None:
    async with _connected() as (stream, _, peer):
        def keep_for_the_owner(frames: list[Frame]) -> bool:
            frames.clear()  # handled, with something left for the owner to do
            return False

        stream.on_frames = keep_for_the_owner
        owner = await _owner_waiting(stream)
        peer.sendall(_framed(b"x"))
        assert await asyncio.wait_for(owner, 1) == []  # woken, the stream still open
        stream.on_frames = None
        peer.sendall(_framed(b"y"))
        assert await asyncio.wait_for(stream.read(), 1) == [b"y"]
        peer.shutdown(socket.SHUT_WR)
        assert await asyncio.wait_for(stream.read(), 1) == []  # the end of the stream
