"""Kafka frames over bare sockets, for clients that misbehave on purpose."""

from __future__ import annotations

import contextlib
import socket
import struct
import time
import typing
from typing import Any

from kiproxy.protocol.framing import encode_frame, encode_request_header, request_header_version
from kiproxy.protocol.messages import ApiKey, request_type, serialize

__all__ = [
    "api_versions_frame",
    "closed_by_peer",
    "connect",
    "local_address",
    "metadata_frame",
    "recv_frame",
    "request_frame",
    "send_quietly",
]

_INT32 = struct.Struct(">i")


def connect(address: str, *, rcvbuf: int | None = None, timeout: float = 10) -> socket.socket:
    """A blocking TCP connection to ``host:port`` (``rcvbuf`` set before connecting)."""
    host, port = address.rsplit(":", 1)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    if rcvbuf is not None:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
    sock.settimeout(timeout)
    sock.connect((host, int(port)))
    return sock


def local_address(sock: socket.socket) -> str:
    """``host:port`` of our end, as the proxy's log names the client."""
    host, port = sock.getsockname()[:2]
    return f"{host}:{port}"


def request_frame(api_key: int, version: int, correlation_id: int, message: Any,
                  client_id: str = "hardening") -> bytes:
    """A whole request frame, length prefix included."""
    header_version = request_header_version(api_key, version)
    assert header_version is not None
    header = encode_request_header(api_key, version, correlation_id, client_id, header_version)
    return encode_frame(header + serialize(message))


def api_versions_frame(correlation_id: int, version: int = 3,
                       client_id: str = "hardening") -> bytes:
    """An ApiVersions request frame."""
    cls = request_type(ApiKey.API_VERSIONS, version)
    message = (cls(client_software_name="hardening", client_software_version="1.0")
               if version >= 3 else cls())
    return request_frame(ApiKey.API_VERSIONS, version, correlation_id, message, client_id)


def metadata_frame(correlation_id: int, version: int = 12, client_id: str = "hardening",
                   topics: list[str] | None = None) -> bytes:
    """A Metadata request frame asking for ``topics`` (default: every topic)."""
    cls = request_type(ApiKey.METADATA, version)
    kwargs: dict[str, Any] = {"topics": None}
    if topics is not None:
        hint = typing.get_type_hints(cls)["topics"]
        if typing.get_origin(hint) is not tuple:  # tuple[...] | None
            hint = next(a for a in typing.get_args(hint) if a is not type(None))
        topic_cls = typing.get_args(hint)[0]
        fields = set(typing.get_type_hints(topic_cls))
        kwargs["topics"] = tuple(
            topic_cls(name=t, **({"topic_id": None} if "topic_id" in fields else {}))
            for t in topics)
    if version >= 4:
        kwargs["allow_auto_topic_creation"] = False
    if 8 <= version <= 10:
        kwargs["include_cluster_authorized_operations"] = False
    if version >= 8:
        kwargs["include_topic_authorized_operations"] = False
    return request_frame(ApiKey.METADATA, version, correlation_id, cls(**kwargs), client_id)


def _exact(sock: socket.socket, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise ConnectionError(f"connection closed after {len(out)} of {n} bytes")
        out += chunk
    return bytes(out)


def recv_frame(sock: socket.socket) -> bytes:
    """One response frame, without its length prefix."""
    (size,) = _INT32.unpack(_exact(sock, 4))
    assert 0 <= size < 64 * 2**20, f"response length {size}"
    return _exact(sock, size)


def closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """Whether the peer closes (or resets) ``sock`` within ``timeout`` seconds;
    whatever it sends before closing is read and dropped."""
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return False
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return True
        except TimeoutError:
            return False
        except OSError:
            return True


def send_quietly(sock: socket.socket, data: bytes) -> bool:
    """``sendall`` that reports a connection the peer already closed instead of raising."""
    with contextlib.suppress(OSError):
        sock.sendall(data)
        return True
    return False
