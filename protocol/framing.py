"""Kafka framing: length-prefixed frames from a byte stream, request and response headers.

Every request and response is ``int32 length`` + payload. A :class:`FrameDecoder`
is fed whatever bytes arrived and hands back whole frames; a :class:`FrameAssembler`
does the same for a reader that receives straight into buffers it is given
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

from kiproxy.protocol._codec import read_request_header, receive_buffer
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


class FrameAssembler:
    """Frames assembled in the buffers their bytes are received into.

    For a reader with ``recv_into`` (``asyncio.BufferedProtocol``): it asks
    :meth:`get_buffer` where the next bytes go, receives into that buffer, and
    reports how many arrived to :meth:`buffer_updated`, which returns the frames
    they complete, in order, without their length prefixes.

    Frames under ``large_frame`` bytes share one chunk buffer, many per receive,
    and are handed out as ``bytes`` (one small copy each). A larger frame of up to
    ``part_size`` bytes gets a ``bytearray`` of exactly its size once its length
    prefix has arrived; the rest of it is received straight into that buffer,
    which is handed out as is and never touched again. A frame above
    ``part_size`` is received into buffers made one at a time as its bytes arrive,
    each at most as large as what has arrived so far, then joined once into
    ``bytes``: a length prefix alone makes the assembler allocate ``part_size``
    bytes at most, and a frame's buffers never exceed twice what the client has
    sent (Kafka's broker allocates the whole frame on the prefix; a proxy in front
    of it should not). A negative length, or one above ``max_frame_size``, raises
    in :meth:`buffer_updated` as soon as the prefix is seen, before any
    allocation; the assembler is then unusable, like the stream it came from.
    """

    __slots__ = ("_chunk", "_chunk_size", "_end", "_got", "_large", "_need", "_part",
                 "_part_filled", "_part_view", "_parts", "_start", "_view", "large_frame",
                 "max_frame_size", "part_size")

    def __init__(self, max_frame_size: int = DEFAULT_MAX_FRAME_SIZE, *,
                 chunk_size: int = 64 * 1024, large_frame: int = 16 * 1024,
                 part_size: int = 64 * 1024) -> None:
        if not 0 < large_frame <= chunk_size - 4:
            raise ValueError(f"large_frame {large_frame} must be in 1..chunk_size - 4 "
                             f"({chunk_size - 4})")
        if part_size < chunk_size:
            raise ValueError(f"part_size {part_size} must be at least chunk_size {chunk_size}")
        self.max_frame_size = max_frame_size
        self.large_frame = large_frame
        """Frames of this many bytes or more get a buffer of their own."""
        self.part_size = part_size
        """Frames up to this size get one exact buffer; it is also the most a length
        prefix alone makes the assembler allocate."""
        self._chunk_size = chunk_size
        # Made when bytes arrive and dropped once every byte in it is handed out: an
        # idle connection holds no chunk.
        self._chunk: bytearray | None = None
        self._view = memoryview(b"")
        self._start = 0  # unconsumed bytes are _chunk[_start:_end]
        self._end = 0
        self._large = 0  # length of a large frame whose prefix sits at _chunk[_start:]
        self._parts: list[bytearray] | None = None  # the large frame being received
        self._part = bytearray()
        self._part_view = memoryview(self._part)
        self._part_filled = 0
        self._need = 0
        self._got = 0

    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as a frame (length prefixes included)."""
        if self._parts is not None:
            return 4 + self._got
        return self._end - self._start

    def discard(self) -> None:
        """Drop every buffer held, at once: the stream is gone. (A closed connection's
        objects form reference cycles that only the cyclic collector frees, maybe much
        later; the partial frame it held must not wait for that.)"""
        self._chunk, self._view = None, memoryview(b"")
        self._parts, self._part, self._part_view = None, bytearray(), memoryview(b"")
        self._start = self._end = self._large = self._need = self._got = 0
        self._part_filled = 0

    def _next_part(self) -> memoryview:
        # Double what has arrived, at most: a client must send bytes to make the
        # assembler hold more of them.
        part = receive_buffer(min(self._need - self._got, max(self.part_size, self._got)))
        assert self._parts is not None
        self._parts.append(part)
        self._part, self._part_view, self._part_filled = part, memoryview(part), 0
        return self._part_view

    def get_buffer(self) -> memoryview:
        """Where the next bytes must be received; never empty."""
        if self._parts is not None:
            if self._part_filled == len(self._part):
                return self._next_part()
            return self._part_view[self._part_filled:]
        start, end = self._start, self._end
        if self._large:
            # The buffer is made only now, when the reader is about to fill it: a
            # reader paused with a prefix received holds no more than the chunk.
            self._need, self._large = self._large, 0
            have = end - start - 4
            self._parts, self._got = [], have
            part = receive_buffer(self._need if self._need <= self.part_size else self.part_size)
            part[:have] = self._view[start + 4 : end]
            self._parts.append(part)
            self._part, self._part_view, self._part_filled = part, memoryview(part), have
            self._start = self._end = 0
            self._chunk, self._view = None, memoryview(b"")
            return self._part_view[have:]
        chunk = self._chunk
        if chunk is None:
            chunk = self._chunk = receive_buffer(self._chunk_size)
            self._view = memoryview(chunk)
            self._start = self._end = start = end = 0
        elif len(chunk) - end < len(chunk) // 4:
            # Little room left: move the start of the next frame (smaller than
            # large_frame) to the front.
            chunk[: end - start] = self._view[start:end]
            self._start, self._end = 0, end - start
            end -= start
        return self._view[end:]

    def buffer_updated(self, nbytes: int) -> list[bytes | bytearray]:
        """Count ``nbytes`` received into the last :meth:`get_buffer`; return whole frames."""
        parts = self._parts
        if parts is not None:
            self._part_filled += nbytes
            self._got += nbytes
            if self._got < self._need:
                return []
            frame: bytes | bytearray = parts[0] if len(parts) == 1 else b"".join(parts)
            self._parts, self._part, self._part_view = None, bytearray(), memoryview(b"")
            return [frame]
        chunk, view = self._chunk, self._view
        assert chunk is not None, "buffer_updated() without get_buffer()"
        pos = self._start
        end = self._end = self._end + nbytes
        frames: list[bytes | bytearray] = []
        max_frame_size = self.max_frame_size
        while end - pos >= 4:
            (size,) = _INT32.unpack_from(chunk, pos)
            if size < 0 or size > max_frame_size:
                _frame_length(chunk, pos, max_frame_size)  # raises, naming what was wrong
            if end - pos - 4 < size:
                if size >= self.large_frame:
                    self._large = size
                break
            frames.append(bytes(view[pos + 4 : pos + 4 + size]))
            pos += 4 + size
        self._start = pos
        if pos == end:
            self._chunk, self._view = None, memoryview(b"")
            self._start = self._end = 0
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
