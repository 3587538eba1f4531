"""A bare socket that speaks Kafka frames through kiproxy's protocol helpers.

For tests that must send exactly the bytes they mean (pipelined requests, an
unknown version, a corrupt batch, acks=0) and read each answer as it comes,
where a real client would hide or refuse it. Frames are built with
:mod:`kiproxy.protocol` and kio's message classes; answers are parsed the same
way. Reads block up to the client's timeout; a closed connection raises
``ConnectionError`` saying how much of a frame had arrived.
"""

from __future__ import annotations

import datetime
import socket
import struct
import typing
from typing import Any

from kiproxy.protocol.framing import (
    encode_frame,
    encode_request_header,
    parse_response_header,
    request_header_version,
    response_header_version,
)
from kiproxy.protocol.messages import ApiKey, parse_response, request_type, serialize

__all__ = ["RawClient"]

MAX_RESPONSE = 64 << 20
"""A response length beyond this is taken for a broken stream, not allocated."""


class RawClient:
    """One connection to ``host:port``; a context manager that closes it."""

    def __init__(self, address: str, timeout: float = 15) -> None:
        host, port = address.rsplit(":", 1)
        self.sock = socket.create_connection((host, int(port)), timeout=timeout)

    def __enter__(self) -> RawClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """Close the connection."""
        self.sock.close()

    @property
    def local_address(self) -> str:
        """``host:port`` of our end, as the proxy's log names the client."""
        host, port = self.sock.getsockname()[:2]
        return f"{host}:{port}"

    @staticmethod
    def frame(api_key: int, version: int, correlation_id: int, message: Any,
              client_id: str = "kiproxy-test") -> bytes:
        """A whole request frame (length prefix, header for the version, ``message``)."""
        header_version = request_header_version(api_key, version)
        assert header_version is not None
        header = encode_request_header(api_key, version, correlation_id, client_id,
                                       header_version)
        return encode_frame(header + serialize(message))

    @staticmethod
    def produce(version: int, parts: list[tuple[str, bytes]], *, acks: int = -1,
                correlation_id: int = 1) -> bytes:
        """A Produce request frame: ``parts`` are (topic, records bytes) for partition 0."""
        from kio.schema.types import TopicName
        from kio.static.primitive import i16, i32, i32Timedelta

        cls = request_type(ApiKey.PRODUCE, version)
        topic_cls = typing.get_args(typing.get_type_hints(cls)["topic_data"])[0]
        part_cls = typing.get_args(typing.get_type_hints(topic_cls)["partition_data"])[0]
        message = cls(
            transactional_id=None, acks=i16(acks),
            timeout=i32Timedelta.parse(datetime.timedelta(seconds=10)),
            topic_data=tuple(
                topic_cls(name=TopicName(topic),
                          partition_data=(part_cls(index=i32(0), records=records),))
                for topic, records in parts),
        )
        return RawClient.frame(ApiKey.PRODUCE, version, correlation_id, message,
                               "kiproxy-raw-test")

    @staticmethod
    def parse(api_key: int, version: int, frame: bytes) -> tuple[int, Any]:
        """(correlation id, response message) of a response frame to ``api_key``."""
        header_version = response_header_version(api_key, version)
        assert header_version is not None
        correlation_id, offset = parse_response_header(frame, header_version)
        return correlation_id, parse_response(api_key, version, frame, offset)

    def send(self, data: bytes) -> None:
        """Send ``data`` whole (one frame, several, or a deliberate fragment)."""
        self.sock.sendall(data)

    def recv_frame(self) -> bytes:
        """The next response frame, without its length prefix."""
        (size,) = struct.unpack(">i", self._exact(4))
        assert 0 <= size < MAX_RESPONSE, f"response length {size}"
        return self._exact(size)

    def request(self, api_key: int, version: int, message: Any, correlation_id: int = 7) -> Any:
        """Send one request and return its parsed answer (checking the correlation id)."""
        self.send(self.frame(api_key, version, correlation_id, message))
        got, response = self.parse(api_key, version, self.recv_frame())
        assert got == correlation_id
        return response

    def read_produce(self, version: int) -> tuple[int, Any]:
        """(correlation id, ProduceResponse) of the next answer."""
        return self.parse(ApiKey.PRODUCE, version, self.recv_frame())

    def _exact(self, n: int) -> bytes:
        out = bytearray()
        while len(out) < n:
            chunk = self.sock.recv(n - len(out))
            if not chunk:
                raise ConnectionError(f"connection closed after {len(out)} of {n} bytes")
            out += chunk
        return bytes(out)
