"""One Produce request through a whole proxy connection and its answer back, in process.

:func:`round_trips` starts, on the running event loop, a stand-in broker (it
answers each Produce request with a canned acknowledgement under the request's
correlation id), a :class:`~kiproxy.proxy.server.ProxyServer`'s client path
listening on a loopback port (its bootstrap listener, no discovery) and one
client connection to it; it returns a coroutine function that sends ``n``
Produce requests of one 100-byte record, each after the answer to the one
before. Everything the proxy does per request runs as it does in ``kiproxy
run``: the client socket's framing, the dispatcher, the produce pipeline's
pass-through, the upstream write, the answer's matching and rewriting and the
write back to the client; what the stand-ins add is the same for every tree.

:mod:`bench.instructions` counts its instructions (case ``round trip``): the
user-space part of a request's cost, which is where a Python proxy spends
most of it (the system calls are the same as haproxy's, one read and one
write each way).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Awaitable, Callable
from typing import Any

__all__ = ["produce_frames", "round_trips"]

_INT32 = struct.Struct(">i")


def produce_frames(version: int = 11) -> tuple[bytes, bytes]:
    """A Produce request (acks 1, one partition, one 100-byte record) and its answer,
    both without length prefix; flexible versions (9+) only."""
    import datetime

    from kio.schema.produce.v9.request import (
        PartitionProduceData,
        ProduceRequest,
        TopicProduceData,
    )
    from kio.schema.types import TopicName
    from kio.static.primitive import Records, i16, i32, i32Timedelta

    from kiproxy.protocol.compression import Compression
    from kiproxy.protocol.framing import encode_request_header
    from kiproxy.protocol.messages import serialize
    from kiproxy.protocol.records import Record, build_batch

    batch = build_batch([Record(key=None, value=b"v" * 100, timestamp=1_700_000_000_000)],
                        compression=Compression.NONE)
    request = ProduceRequest(transactional_id=None, acks=i16(1),
                             timeout=i32Timedelta.parse(datetime.timedelta(seconds=30)),
                             topic_data=(
        TopicProduceData(name=TopicName("bench"), partition_data=(
            PartitionProduceData(index=i32(0), records=Records(batch)),)),))
    # Produce v9-v11 requests are the same bytes; the answer differs (node_endpoints, v10+).
    frame = encode_request_header(0, version, 1, "bench", 2) + serialize(request)
    answer = (b"\x00" + b"\x02" + bytes([len(b"bench") + 1]) + b"bench" + b"\x02"
              + struct.pack(">ihqqq", 0, 0, 1000, -1, 0) + b"\x01\x00\x00"
              + b"\x00" + struct.pack(">i", 0) + b"\x00")
    return frame, answer


class _Broker(asyncio.Protocol):
    """Answers every frame with ``answer`` under the frame's correlation id."""

    def __init__(self, answer: bytes) -> None:
        self._answer = answer
        self._buffer = b""
        self._transport: asyncio.Transport | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self._transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        buf = self._buffer + data
        while len(buf) >= 4:
            (size,) = _INT32.unpack_from(buf, 0)
            if len(buf) < 4 + size:
                break
            correlation = buf[8:12]
            assert self._transport is not None
            self._transport.write(_INT32.pack(4 + len(self._answer)) + correlation
                                  + self._answer)
            buf = buf[4 + size:]
        self._buffer = buf


class _Client(asyncio.Protocol):
    """Wakes ``answered`` once a whole answer has arrived."""

    def __init__(self) -> None:
        self.answered: asyncio.Future[None] | None = None
        self._buffer = b""

    def data_received(self, data: bytes) -> None:
        buf = self._buffer + data
        if len(buf) >= 4 and len(buf) >= 4 + _INT32.unpack_from(buf, 0)[0]:
            buf = b""
            if self.answered is not None and not self.answered.done():
                self.answered.set_result(None)
        self._buffer = buf


async def round_trips(version: int = 11,
                      settings: dict[str, Any] | None = None
                      ) -> Callable[[int], Awaitable[None]]:
    """Start the stand-in broker, the proxy and a client; return ``send(n)`` (see the
    module docstring). ``settings`` are more :class:`ProxyConfig` fields."""
    from functools import partial

    from kiproxy.proxy.config.model import ProxyConfig
    from kiproxy.proxy.server import ProxyServer

    loop = asyncio.get_running_loop()
    request, answer = produce_frames(version)
    broker = await loop.create_server(partial(_Broker, answer), "127.0.0.1", 0)
    port = broker.sockets[0].getsockname()[1]
    server = ProxyServer(ProxyConfig(upstream=[f"127.0.0.1:{port}"], **(settings or {})))
    listener = await loop.create_server(partial(server._client_stream, None), "127.0.0.1", 0)
    transport, client = await loop.create_connection(
        _Client, "127.0.0.1", listener.sockets[0].getsockname()[1])
    prefixed = _INT32.pack(len(request)) + request

    async def send(n: int) -> None:
        for _ in range(n):
            client.answered = loop.create_future()
            transport.write(prefixed)
            await client.answered

    send.keep = (broker, listener, server, transport)  # type: ignore[attr-defined]
    return send
