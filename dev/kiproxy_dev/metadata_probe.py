"""Just enough of the Kafka protocol to see a cluster: one Metadata v1 request and its answer.

``probe_metadata(port)`` connects to a broker on 127.0.0.1, sends a Metadata v1
request (header v1, a few bytes built with ``struct``) and returns the live
brokers, the controller id and the partition leaders of the topics asked for.
It is the readiness check of ``kafka_cluster``: a JVM that listens is not yet a
broker that answers. Standard library only.
"""

from __future__ import annotations

import socket
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

__all__ = ["MetadataView", "probe_metadata"]

HOST = "127.0.0.1"


@dataclass(frozen=True, slots=True, kw_only=True)
class MetadataView:
    """What one broker's Metadata (v1) response says about the cluster."""

    brokers: Mapping[int, int]
    """Live brokers: node id -> port."""
    controller_id: int
    """The node id the broker names as controller; -1 when it knows none."""
    leaders: Mapping[tuple[str, int], int]
    """(topic, partition) -> leader node id (-1 when leaderless), for the topics asked for."""


class _Reader:
    """Big-endian reads over one response body; a short body raises ``struct.error``."""

    def __init__(self, data: bytes) -> None:
        self._data = data
        self._pos = 0

    def _take(self, fmt: str) -> int:
        (value,) = struct.unpack_from(fmt, self._data, self._pos)
        self._pos += struct.calcsize(fmt)
        return int(value)

    def i8(self) -> int:
        return self._take(">b")

    def i16(self) -> int:
        return self._take(">h")

    def i32(self) -> int:
        return self._take(">i")

    def string(self) -> str:
        n = self.i16()
        if n < 0:
            return ""
        if self._pos + n > len(self._data):
            raise struct.error("string runs past the end of the response")
        raw = self._data[self._pos : self._pos + n]
        self._pos += n
        return raw.decode()


def _metadata_request(topics: Sequence[str] | None, correlation_id: int) -> bytes:
    # Header v1: api_key 3 (Metadata), api_version 1, correlation id, client id.
    client_id = b"kiproxy-kafka-cluster"
    body = struct.pack(">hhih", 3, 1, correlation_id, len(client_id)) + client_id
    if topics is None:
        body += struct.pack(">i", -1)  # v1: a null array asks for all topics
    else:
        body += struct.pack(">i", len(topics))
        for t in topics:
            name = t.encode()
            body += struct.pack(">h", len(name)) + name
    return struct.pack(">i", len(body)) + body


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    chunks = bytearray()
    while len(chunks) < n:
        chunk = sock.recv(n - len(chunks))
        if not chunk:
            raise ConnectionError("the broker closed the connection")
        chunks += chunk
    return bytes(chunks)


def probe_metadata(port: int, topics: Sequence[str] = (), timeout: float = 2.0) -> MetadataView:
    """Ask the broker on 127.0.0.1:``port`` for Metadata v1; ``OSError`` when it cannot answer."""
    with socket.create_connection((HOST, port), timeout=timeout) as sock:
        sock.sendall(_metadata_request(topics, correlation_id=1))
        (size,) = struct.unpack(">i", _recv_exactly(sock, 4))
        if not 4 <= size <= 16 << 20:
            raise ConnectionError(f"implausible Metadata response size {size}")
        r = _Reader(_recv_exactly(sock, size))
    try:
        if r.i32() != 1:
            raise ConnectionError("the Metadata response has the wrong correlation id")
        brokers: dict[int, int] = {}
        for _ in range(r.i32()):
            node_id, _host, port_, _rack = r.i32(), r.string(), r.i32(), r.string()
            brokers[node_id] = port_
        controller_id = r.i32()
        leaders: dict[tuple[str, int], int] = {}
        for _ in range(r.i32()):
            _error, name, _internal = r.i16(), r.string(), r.i8()
            for _ in range(r.i32()):
                _perror, index, leader = r.i16(), r.i32(), r.i32()
                for _ in range(r.i32()):  # replica nodes
                    r.i32()
                for _ in range(r.i32()):  # in-sync replica nodes
                    r.i32()
                leaders[(name, index)] = leader
    except struct.error as e:
        raise ConnectionError(f"malformed Metadata response: {e}") from None
    return MetadataView(brokers=brokers, controller_id=controller_id, leaders=leaders)
