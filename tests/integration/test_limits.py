"""Connection limits: max_connections and idle_timeout_ms, with raw Kafka requests."""

from __future__ import annotations

import socket
import struct
import time

from conftest import launch_proxy

from kiproxy_dev.tansu import EmbeddedBroker


def _api_versions(correlation_id: int) -> bytes:
    body = struct.pack(">hhi", 18, 0, correlation_id) + struct.pack(">h", 4) + b"test"
    return struct.pack(">i", len(body)) + body


def _ask(sock: socket.socket, correlation_id: int) -> int:
    """Send ApiVersions v0; return the correlation id of the answer."""
    sock.sendall(_api_versions(correlation_id))
    size = struct.unpack(">i", _recv(sock, 4))[0]
    return int(struct.unpack(">i", _recv(sock, size)[:4])[0])


def _recv(sock: socket.socket, n: int) -> bytes:
    out = b""
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError("closed")
        out += chunk
    return out


def _closed(sock: socket.socket, timeout: float = 5) -> bool:
    sock.settimeout(timeout)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def test_connections_beyond_max_connections_are_closed(broker: EmbeddedBroker) -> None:
    proxy = launch_proxy(broker.bootstrap, "--max-connections", "3")
    host, port = proxy.bootstrap.rsplit(":", 1)
    try:
        held = [socket.create_connection((host, int(port)), 5) for _ in range(3)]
        for i, s in enumerate(held):
            assert _ask(s, i) == i
        extra = socket.create_connection((host, int(port)), 5)
        assert _closed(extra)
        held.pop().close()
        deadline = time.monotonic() + 5
        while True:  # the freed slot is usable once the proxy saw the close
            again = socket.create_connection((host, int(port)), 5)
            try:
                assert _ask(again, 99) == 99
                break
            except (ConnectionError, OSError):
                again.close()
                assert time.monotonic() < deadline
                time.sleep(0.05)
        proxy.wait_for_line("max_connections (3) reached")
        for s in [*held, extra, again]:
            s.close()
    finally:
        assert proxy.stop() == 0


def test_idle_connections_are_closed(broker: EmbeddedBroker) -> None:
    proxy = launch_proxy(broker.bootstrap, "--idle-timeout-ms", "1000")
    host, port = proxy.bootstrap.rsplit(":", 1)
    try:
        idle = socket.create_connection((host, int(port)), 5)
        assert _ask(idle, 1) == 1
        busy = socket.create_connection((host, int(port)), 5)
        assert _ask(busy, 1) == 1
        # A trickle of bytes that never completes a request is no activity either.
        trickle = socket.create_connection((host, int(port)), 5)
        trickle.sendall(b"\x00\x00")
        # The busy client talks every ~0.1 s (a tenth of the timeout) until the proxy
        # has closed the other two, however long the sweep takes to come round.
        deadline = time.monotonic() + 60
        asked = 1
        while not all(_closed(s, 0.05) for s in (idle, trickle)):
            asked += 1
            assert _ask(busy, asked) == asked
            assert time.monotonic() < deadline, "the idle connections are still open"
        assert _ask(busy, asked + 1) == asked + 1  # and it survives the sweep
        proxy.wait_for_line("closing idle client")
        for s in (idle, busy, trickle):
            s.close()
    finally:
        assert proxy.stop() == 0
