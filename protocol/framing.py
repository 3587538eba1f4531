"""Kafka framing: length-prefixed frames from a byte stream, request and response headers.

Every request and response is ``int32 length`` + payload. A :class:`FrameDecoder`
is fed whatever bytes arrived and hands back whole frames; a :class:`FrameAssembler`
(compiled, in the record codec: every receive of the proxy goes through it) does the
same for a reader that receives straight into buffers it is given
(``asyncio.BufferedProtocol``), so that a large frame is never copied. Neither
allocates for a length above its ``max_frame_size``.

Request header v1 is api_key int16, api_version int16, correlation_id int32 and
client_id (nullable string, int16 length); v2, used by flexible API versions,
adds tagged fields. v0 (only ControlledShutdown v0) has no client_id. Response
header v0 is the correlation id; v1 adds tagged fields, except that ApiVersions
responses always use v0.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from functools import lru_cache

from kiproxy.protocol._codec import FrameAssembler, read_request_header
from kiproxy.protocol.errors import FrameTooLarge, MalformedFrame
from kiproxy.protocol.wire import read_uvarint

__all__ = [
    "API_VERSIONS_KEY",
    "DEFAULT_MAX_FRAME_SIZE",
    "FrameAssembler",
    "FrameDecoder",
    "RequestHeader",
    "encode_frame",
    "encode_request_header",
    "encode_response_header",
    "is_flexible",
    "parse_request_header",
    "parse_response_header",
    "request_header_version",
    "response_header_version",
]

DEFAULT_MAX_FRAME_SIZE = 100 * 1024 * 1024
API_VERSIONS_KEY = 18
_CONTROLLED_SHUTDOWN_KEY = 7
_INT32 = struct.Struct(">i")
_REQUEST_FIXED = struct.Struct(">hhi")
_INT16 = struct.Struct(">h")


def _frame_length(buf: bytes | bytearray, pos: int, max_frame_size: int) -> int:
    """The length prefix at ``pos``, refused if negative or above ``max_frame_size``."""
    (size,) = _INT32.unpack_from(buf, pos)
    if size < 0:
        raise MalformedFrame(f"frame length {size} is negative")
    if size > max_frame_size:
        raise FrameTooLarge(f"frame length {size} exceeds max_frame_size {max_frame_size}")
    return int(size)


class FrameDecoder:
    """Incremental frame decoder: ``feed`` bytes in, take whole frames out.

    Frames are returned without their 4-byte length prefix. A negative length,
    or one above ``max_frame_size``, raises as soon as the prefix is seen, before
    any of the frame is buffered.
    """

    __slots__ = ("_buffer", "max_frame_size")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE) -> None:
        self.max_frame_size = max_frame_size
        self._buffer = bytearray()

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as a frame."""
        return len(self._buffer)

    def feed(self, data: bytes) -> list[bytes]:
        """Add ``data`` and return every frame it completes, in order."""
        buf = self._buffer
        buf += data
        frames = []
        pos = 0
        end = len(buf)
        while end - pos >= 4:
            size = _frame_length(buf, pos, self.max_frame_size)
            if end - pos - 4 < size:
                break
            frames.append(bytes(buf[pos + 4 : pos + 4 + size]))
            pos += 4 + size
        if pos:
            del buf[:pos]
        return frames


def encode_frame(payload: bytes) -> bytes:
    """Prefix ``payload`` with its int32 length."""
    return _INT32.pack(len(payload)) + payload


@lru_cache(maxsize=4096)
def is_flexible(api_key: int, api_version: int) -> bool | None:
    """Whether a request version uses the flexible (compact, tagged) encoding.

    ``None`` when the API key or version is unknown to the schemas we ship.
    """
    from kio.index import KioIndexError, load_request_schema

    try:
        return bool(load_request_schema(api_key, api_version).__flexible__)
    except (KioIndexError, ImportError, AttributeError, ValueError):
        return None


@lru_cache(maxsize=4096)
def _predates_schemas(api_key: int, api_version: int) -> bool:
    """Whether a version is older than every schema we ship of a known, non-flexible API.

    Such versions (Produce v0-v2) predate flexible versions, so their headers are
    v1 (request) and v0 (response) even without a schema.
    """
    from kio.schema.index import api_key_map, schema_name_map

    name = api_key_map.get(api_key)
    if name is None or api_version < 0:
        return False
    oldest = min(schema_name_map[name])
    return api_version < oldest and is_flexible(api_key, oldest) is False


@lru_cache(maxsize=4096)
def request_header_version(api_key: int, api_version: int) -> int | None:
    """0, 1 or 2, or ``None`` for an API version the schemas do not know."""
    if api_key == _CONTROLLED_SHUTDOWN_KEY and api_version == 0:
        return 0
    flexible = is_flexible(api_key, api_version)
    if flexible is None:
        return 1 if _predates_schemas(api_key, api_version) else None
    return 2 if flexible else 1


def response_header_version(api_key: int, api_version: int) -> int | None:
    """0 or 1; ApiVersions always answers with header v0 (KIP-511)."""
    if api_key == API_VERSIONS_KEY:
        return 0
    flexible = is_flexible(api_key, api_version)
    if flexible is None:
        return 0 if _predates_schemas(api_key, api_version) else None
    return 1 if flexible else 0


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestHeader:
    """A parsed request header and where the request body starts."""

    api_key: int
    """Which API (0 Produce, 3 Metadata, 18 ApiVersions, ...)."""
    api_version: int
    """The version of that API the client speaks."""
    correlation_id: int
    """Echoed in the response so the client can match them."""
    client_id: str | None
    """The client's self-chosen id (``client.id``), if any."""
    header_version: int | None
    """0, 1 or 2; ``None`` if the API version is unknown and the body offset is too."""
    body_offset: int | None
    """Byte offset of the request body in the frame, when the header version is known."""


def _skip_tagged_fields(frame: bytes | bytearray, pos: int) -> int:
    end = len(frame)
    if pos < end and frame[pos] == 0:
        return pos + 1  # no tagged fields: what clients send
    count, pos = read_uvarint(frame, pos, end, "tagged field count", MalformedFrame)
    for _ in range(count):
        _tag, pos = read_uvarint(frame, pos, end, "tag", MalformedFrame)
        size, pos = read_uvarint(frame, pos, end, "tagged field size", MalformedFrame)
        if size > len(frame) - pos:
            raise MalformedFrame(f"tagged field of {size} bytes at byte {pos} runs past the frame")
        pos += size
    return pos


def parse_request_header(frame: bytes | bytearray) -> RequestHeader:
    """Parse the header at the start of a request frame (without its length prefix)."""
    # The compiled reader takes what clients send; it leaves the rest to the Python one.
    header = read_request_header(frame, RequestHeader, request_header_version)
    return header if header is not None else _parse_request_header(frame)


def _parse_request_header(frame: bytes | bytearray) -> RequestHeader:
    """:func:`parse_request_header` in Python: every header version, and the errors."""
    if len(frame) < 8:
        raise MalformedFrame(f"request of {len(frame)} bytes is shorter than a request header")
    api_key, api_version, correlation_id = _REQUEST_FIXED.unpack_from(frame, 0)
    version = request_header_version(api_key, api_version)
    if version == 0:
        return RequestHeader(api_key=api_key, api_version=api_version,
                             correlation_id=correlation_id, client_id=None,
                             header_version=0, body_offset=8)
    if len(frame) < 10:
        raise MalformedFrame("request header truncated before client_id")
    (size,) = _INT16.unpack_from(frame, 8)
    pos = 10
    client_id: str | None = None
    if size >= 0:
        if pos + size > len(frame):
            raise MalformedFrame(
                f"client_id length {size} at byte 8 runs past the {len(frame)}-byte frame"
            )
        client_id = frame[pos : pos + size].decode("utf-8", errors="replace")
        pos += size
    elif size != -1:
        raise MalformedFrame(f"client_id length {size} at byte 8 is negative")
    if version == 2:
        pos = _skip_tagged_fields(frame, pos)
    return RequestHeader(api_key=api_key, api_version=api_version,
                         correlation_id=correlation_id, client_id=client_id,
                         header_version=version, body_offset=pos if version is not None else None)


def encode_request_header(
    api_key: int, api_version: int, correlation_id: int, client_id: str | None, version: int
) -> bytes:
    """Encode a request header of the given header version (0, 1 or 2)."""
    out = _REQUEST_FIXED.pack(api_key, api_version, correlation_id)
    if version == 0:
        return out
    if client_id is None:
        out += _INT16.pack(-1)
    else:
        raw = client_id.encode()
        out += _INT16.pack(len(raw)) + raw
    if version == 2:
        out += b"\x00"
    return out


def parse_response_header(frame: bytes, version: int) -> tuple[int, int]:
    """Return ``(correlation_id, body_offset)`` of a response frame with header ``version``."""
    if len(frame) < 4:
        raise MalformedFrame(f"response of {len(frame)} bytes is shorter than a correlation id")
    (correlation_id,) = _INT32.unpack_from(frame, 0)
    pos = 4
    if version >= 1:
        pos = _skip_tagged_fields(frame, pos)
    return correlation_id, pos


def encode_response_header(correlation_id: int, version: int) -> bytes:
    """Encode a response header v0 or v1 (v1 with an empty tagged-field section)."""
    out = _INT32.pack(correlation_id)
    return out + b"\x00" if version >= 1 else out
