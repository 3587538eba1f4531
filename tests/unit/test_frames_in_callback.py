"""Requests and answers handled in the sockets' receive callbacks, over socket pairs.

A request that must wait is left to the connection's reader, and one the reader never
gets to (the connection closed first) gives its configuration generation back and leaves
no coroutine that Python reports as never awaited. Answers matched there reach the
client; an answer that matches no request closes the connection with the same warning
as before, and a client that left is closed quietly."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import socket
import struct
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
from hardening.raw_kafka import closed_by_peer, recv_frame

from kiproxy.interceptors.identity import ClientIdentity
from kiproxy.protocol.framing import encode_request_header
from kiproxy.protocol.log_limit import RateLimitedLog
from kiproxy.protocol.messages import ApiKey
from kiproxy.proxy.config.model import ProxyConfig
from kiproxy.proxy.connection import ClientConnection
from kiproxy.proxy.net.frame_stream import FrameStream
from kiproxy.proxy.server import ProxyServer

PRODUCE_V9 = b"\x00\x00\x01\x00\x00\x03\xe8\x01\x00"
"""A Produce v9 body: no transactional id, acks 1, timeout 1000 ms, no topics."""


def _framed(payload: bytes) -> bytes:
    return struct.pack(">i", len(payload)) + payload


async def _produce_forwarded(client: socket.socket, broker: socket.socket,
                             correlation_id: int) -> None:
    """The client sends a Produce request; the broker receives it."""
    client.sendall(_framed(encode_request_header(ApiKey.PRODUCE, 9, correlation_id, "unit", 2)
                           + PRODUCE_V9))
    frame = await asyncio.to_thread(recv_frame, broker)
    assert struct.unpack_from(">i", frame, 4)[0] == correlation_id


def _count_returns(stream: FrameStream, name: str, returns: dict[str, int]) -> None:
    """Count in ``returns[name]`` the times ``stream.read()`` returns to its owner."""
    read = stream.read

    async def counted() -> list[bytes]:
        frames = await read()
        returns[name] += 1
        return frames

    stream.read = counted  # type: ignore[method-assign]


@asynccontextmanager
async def _connection(server: ProxyServer | None = None, port: int = 1
                      ) -> AsyncIterator[tuple[ClientConnection, socket.socket,
                                               socket.socket, dict[str, int]]]:
    """A connection (of ``server``'s, else a new one's; from client port ``port``) whose
    client and broker are the far ends of two socket pairs, its reader and its answer
    reader running; the last item counts the times each of them was woken with frames
    (``client``, ``broker``)."""
    loop = asyncio.get_running_loop()
    server = server or ProxyServer(ProxyConfig(upstream=["127.0.0.1:9"]))
    client_ours, client = socket.socketpair()
    broker_ours, broker = socket.socketpair()
    for s in (client, broker):
        s.settimeout(5)
    client_stream, upstream = FrameStream(1 << 20), FrameStream(1 << 20, whole_frames=True)
    transports = [(await loop.connect_accepted_socket(lambda: client_stream, client_ours))[0],
                  (await loop.connect_accepted_socket(lambda: upstream, broker_ours))[0]]
    conn = ClientConnection(server.services, client_stream, None,
                            ClientIdentity(client_host="127.0.0.1", client_port=port))
    returns = {"client": 0, "broker": 0}
    _count_returns(client_stream, "client", returns)
    _count_returns(upstream, "broker", returns)
    conn._upstream = upstream
    conn._up_task = asyncio.create_task(conn._read_upstream())
    conn._read_task = asyncio.create_task(conn._read_client())
    try:
        yield conn, client, broker, returns
    finally:
        await conn.close()
        for t in transports:
            t.close()
        client.close()
        broker.close()


async def test_answers_matched_in_the_callback_reach_the_client_in_order() -> None:
    async with _connection() as (_, client, broker, returns):
        for cid in (5, 6):
            await _produce_forwarded(client, broker, cid)
        answers = [struct.pack(">i", cid) + b"\x00answer %d" % cid for cid in (5, 6)]
        broker.sendall(b"".join(map(_framed, answers)))
        assert [await asyncio.to_thread(recv_frame, client) for _ in range(2)] == answers
        # Forwarded and answered in the receive callbacks: no task was woken.
        assert returns == {"client": 0, "broker": 0}


async def _answer_names_a_slow_node(
        conn: ClientConnection, client: socket.socket, broker: socket.socket,
        transform: Callable[[bytes], Awaitable[bytes]] | None = None) -> list[int]:
    """Forward a Produce request (correlation id 5) whose answer's rewriter names node 1,
    as a Metadata answer's does, and whose listener takes 0.3 s to open; the node ids
    whose listener opened are appended to the list returned."""
    nodes = conn._services.nodes
    opened: list[int] = []

    async def open_slowly(node_id: int, port: int) -> None:
        await asyncio.sleep(0.3)
        opened.append(node_id)

    nodes._open_listener = open_slowly  # type: ignore[method-assign]
    await _produce_forwarded(client, broker, 5)
    cid, slot, _, _ = conn._pending[0]

    def names_a_node(frame: bytes) -> bytes:
        nodes.seen(1, "127.0.0.1", 9)
        return frame

    conn._pending[0] = (cid, slot, names_a_node, transform)
    return opened


async def test_an_answer_naming_a_new_node_leaves_once_its_listener_is_open() -> None:
    """A client connects to the broker addresses an answer gives it: the proxy's listener
    for a node the answer names first must be open by then."""
    async with _connection() as (conn, client, broker, _):
        opened = await _answer_names_a_slow_node(conn, client, broker)
        answer = struct.pack(">i", 5) + b"\x00answer"
        broker.sendall(_framed(answer))
        assert await asyncio.to_thread(recv_frame, client) == answer
        assert opened == [1]  # it left once the listener was open, not before


async def test_an_answer_a_transform_fills_after_naming_a_new_node_keeps_the_connection(
        caplog: pytest.LogCaptureFixture) -> None:
    """A Fetch answer through a fetch-side hook: its rewriter names a new node and its
    transform fills the slot later. Nothing is left for the reader, which must not take
    that for the broker closing; the answer leaves once the listener is open."""
    caplog.set_level(logging.INFO, "kiproxy")

    async def hooked(frame: bytes) -> bytes:
        await asyncio.sleep(0)
        return frame + b" hooked"

    async with _connection() as (conn, client, broker, _):
        opened = await _answer_names_a_slow_node(conn, client, broker, hooked)
        answer = struct.pack(">i", 5) + b"\x00answer"
        broker.sendall(_framed(answer))
        assert await asyncio.to_thread(recv_frame, client) == answer + b" hooked"
        assert opened == [1]
        assert conn._up_task is not None and not conn._up_task.done()
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


async def test_answers_the_proxy_fails_on_log_one_traceback_per_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    """A fault of the proxy's own on an answer closes that client's connection; a client
    that reconnects and meets it again does not write another traceback within the
    interval (one such client wrote over a thousand a second)."""
    from kiproxy.proxy import answers

    caplog.set_level(logging.INFO, "kiproxy")
    answers._failures._windows.clear()

    async def broken(frame: bytes) -> bytes:
        raise AttributeError("a fault of the proxy's own")

    async def elsewhere(frame: bytes) -> bytes:
        raise AttributeError("another fault of the same type")

    for transform in (broken, broken, broken, elsewhere):
        async with _connection() as (conn, client, broker, _):
            await _produce_forwarded(client, broker, 5)
            cid, slot, rewrite, _ = conn._pending[0]
            conn._pending[0] = (cid, slot, rewrite, transform)
            broker.sendall(_framed(struct.pack(">i", 5) + b"\x00answer"))
            assert await asyncio.to_thread(closed_by_peer, client, 5)
    errors = [r for r in caplog.records if r.levelno == logging.ERROR]
    # one traceback per fault: the first of the three alike, and the one raised elsewhere
    assert len(errors) == 2 and all(e.exc_info is not None for e in errors), caplog.text
    closed = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(closed) == 4 and all("failed on: AttributeError" in m for m in closed), closed


async def test_an_answer_to_no_request_closes_the_connection_with_one_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "kiproxy")
    async with _connection() as (conn, client, broker, _):
        await _produce_forwarded(client, broker, 5)
        broker.sendall(_framed(struct.pack(">i", 99) + b"\x00answer"))
        assert await asyncio.to_thread(closed_by_peer, client, 5)
        assert conn._up_task is not None
        await asyncio.wait_for(asyncio.shield(conn._up_task), 5)
    warnings_ = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings_) == 1, warnings_
    assert ("sent a response the proxy cannot carry: response correlation id 99 where 5 "
            "was next; closing client 127.0.0.1:1") in warnings_[0]


async def test_an_answer_for_a_client_that_left_closes_the_connection_quietly(
        caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, "kiproxy")
    async with _connection() as (conn, client, broker, _):
        await _produce_forwarded(client, broker, 5)
        client.close()
        await asyncio.sleep(0.05)
        broker.sendall(_framed(struct.pack(">i", 5) + b"\x00answer"))
        assert conn._up_task is not None
        await asyncio.wait_for(asyncio.shield(conn._up_task), 5)
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING], caplog.text


async def test_a_request_begun_in_the_callback_and_never_finished_gives_its_generation_back(
        ) -> None:
    server = ProxyServer(ProxyConfig(upstream=["127.0.0.1:9"]))
    ours, peer = socket.socketpair()
    stream = FrameStream(1 << 20)
    transport, _ = await asyncio.get_running_loop().connect_accepted_socket(
        lambda: stream, ours)
    conn = ClientConnection(server.services, stream, None,
                            ClientIdentity(client_host="127.0.0.1", client_port=1))
    reader = asyncio.create_task(conn._read_client())
    await asyncio.sleep(0)  # the reader waits for frames
    generation = server.generations.current
    api_versions = encode_request_header(ApiKey.API_VERSIONS, 3, 7, "unit", 2) + b"\x00\x00\x00"
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            # ApiVersions is dispatched by the reader (its answer is cut): left to it,
            # holding the generation it was read under.
            assert conn._requests_arrived([api_versions]) is False
            assert server.generations.in_use(generation) == 1
            assert not conn.idle
            reader.cancel()  # the connection closes before the reader ran it
            with contextlib.suppress(asyncio.CancelledError):
                await reader
            gc.collect()
        assert server.generations.in_use(generation) == 0
        assert conn.idle
        assert not [w for w in caught if "never awaited" in str(w.message)], [
            str(w.message) for w in caught]
    finally:
        transport.close()
        peer.close()


async def test_an_acks_0_request_waiting_for_broker_room_holds_no_generation() -> None:
    """acks=0: no answer slot; the request is done with its generation once forwarded,
    even when the broker's socket is full and the reader waits for it to drain."""
    async with _connection() as (conn, client, broker, _):
        assert conn._upstream is not None
        conn._upstream.transport.set_write_buffer_limits(high=1024)
        generations = conn._services.generations
        generation = generations.current
        acks_0 = b"\x00\x00\x00\x00\x00\x03\xe8\x01\x00" + b"\x00" * (512 * 1024)
        sending = asyncio.create_task(asyncio.to_thread(client.sendall, _framed(
            encode_request_header(ApiKey.PRODUCE, 9, 5, "unit", 2) + acks_0)))
        for _ in range(200):
            if not conn._upstream.drained:
                break
            await asyncio.sleep(0.005)
        assert not conn._upstream.drained  # the broker reads nothing yet
        assert generations.in_use(generation) == 0
        assert len(await asyncio.to_thread(recv_frame, broker)) > 512 * 1024
        await sending


async def test_a_broker_socket_that_times_out_while_a_request_waits_is_one_warning(
        caplog: pytest.LogCaptureFixture) -> None:
    """A request forwarded to a full broker socket waits for room; the socket then fails
    with an error that is not a ConnectionError (ETIMEDOUT): the reader ends with the
    usual one-line upstream warning (its caller then closes the client), and nothing
    escapes it."""
    async with _connection() as (conn, client, broker, _):
        upstream = conn._upstream
        assert upstream is not None

        async def timed_out() -> None:
            raise TimeoutError(110, "Connection timed out")

        upstream._write_paused = True  # the request waits for room after it is written
        upstream.drain = timed_out  # type: ignore[method-assign]
        with caplog.at_level(logging.WARNING, logger="kiproxy.connection"):
            await _produce_forwarded(client, broker, 7)
            read_task = conn._read_task
            assert read_task is not None
            await asyncio.wait_for(read_task, 5)  # raises what escaped the reader
        assert "upstream broker connection failed: [Errno 110] Connection timed out; " \
               "closing client" in caplog.text


async def test_a_client_socket_that_times_out_under_the_proxys_own_answer_is_a_quiet_close(
        caplog: pytest.LogCaptureFixture) -> None:
    """The proxy answers a Produce v2 request itself (old message format); the client's
    socket then fails with an error that is not a reset (ETIMEDOUT) while that answer is
    written: the reader ends as for a client that left, and nothing escapes it."""
    async with _connection() as (conn, client, _, _):
        client_stream = conn._client

        async def timed_out() -> None:
            client_stream._error = error  # what the socket's failure leaves on its stream
            raise error

        error = TimeoutError(110, "Connection timed out")
        client_stream.drain = timed_out  # type: ignore[method-assign]
        v2 = b"\x00\x01\x00\x00\x03\xe8\x00\x00\x00\x00"  # acks 1, timeout 1000, no topics
        client.sendall(_framed(encode_request_header(ApiKey.PRODUCE, 2, 9, "unit", 1) + v2))
        read_task = conn._read_task
        assert read_task is not None
        await asyncio.wait_for(read_task, 5)  # raises what escaped the reader
        assert "Traceback" not in caplog.text


async def test_a_bad_request_met_in_the_callback_is_still_reported_when_reading_stops(
        caplog: pytest.LogCaptureFixture) -> None:
    """The proxy stops reading (a shutdown) after a request that could not be read was
    met in the receive callback but before the reader ran: the client is still told off
    in the log, as it is when nothing stops."""
    caplog.set_level(logging.INFO, "kiproxy")
    async with _connection() as (conn, _, _, _):
        await asyncio.sleep(0)  # the reader waits for frames
        stream = conn._client
        stream._received([b"\x00\x12"])  # as the transport hands a frame: no header in it
        assert conn._raised is not None
        await conn.stop_reading()
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.wait_for(asyncio.shield(conn._read_task), 5)
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and warned[0].startswith("closing client"), warned


async def test_a_broker_closing_with_requests_owed_says_how_many(
        caplog: pytest.LogCaptureFixture) -> None:
    """Closed with requests unanswered, a broker connection is a WARNING that says how many
    (an INFO without, the same words otherwise): the two levels of one broker's failure
    read differently."""
    caplog.set_level(logging.INFO, "kiproxy")
    async with _connection() as (_, client, broker, _returns):
        await _produce_forwarded(client, broker, 5)
        await _produce_forwarded(client, broker, 6)
        broker.shutdown(socket.SHUT_RDWR)
        assert await asyncio.to_thread(closed_by_peer, client, 5)
    lines = [(r.levelno, r.getMessage()) for r in caplog.records
             if "closed the connection" in r.getMessage()]
    assert lines == [(logging.WARNING, "upstream broker closed the connection; closing "
                      "client 127.0.0.1:1 (client_id 'unit'), 2 of its requests "
                      "unanswered")], caplog.text


async def test_a_broker_closing_every_connection_costs_a_line_per_interval(
        caplog: pytest.LogCaptureFixture) -> None:
    """Clients reconnecting at once to a broker that closes each connection with answers
    owed: the first is a WARNING, the others are counted in one line once the interval
    has passed (not a line per reconnect)."""
    caplog.set_level(logging.INFO, "kiproxy")
    server = ProxyServer(ProxyConfig(upstream=["127.0.0.1:9"]))
    upstreams = server.services.upstreams
    upstreams.lost = RateLimitedLog(upstreams.lost.logger, 0.1, clock=lambda: 0.0)
    for port in (1, 2, 3):
        async with _connection(server, port) as (_, client, broker, _returns):
            await _produce_forwarded(client, broker, 5)
            broker.shutdown(socket.SHUT_RDWR)
            assert await asyncio.to_thread(closed_by_peer, client, 5)
    await asyncio.sleep(0.3)  # past the summary's time
    lines = [(r.levelno, r.getMessage()) for r in caplog.records
             if "closed the connection" in r.getMessage()]
    assert lines == [
        (logging.WARNING, "upstream broker closed the connection; closing client "
         "127.0.0.1:1 (client_id 'unit'), 1 of its requests unanswered"),
        (logging.WARNING, "2 more like it in the last 0.1 s not logged; the last: upstream "
         "broker closed the connection; closing client 127.0.0.1:3 (client_id 'unit'), 1 of "
         "its requests unanswered")], caplog.text
