from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

_H = TypeVar("_H")

class Header:
    """One record header (KIP-82): a UTF-8 key and a nullable byte value."""

    @property
    def key(self) -> str: ...
    @property
    def value(self) -> bytes | None: ...
    def __init__(self, key: str, value: bytes | bytearray | memoryview | None) -> None: ...
    def __iter__(self) -> Iterator[str | bytes | None]: ...
    def __hash__(self) -> int: ...

HeaderLike = Header | tuple[str, bytes | None]

class Record:
    """One Kafka record: key, value, headers, timestamp (ms) and offset delta."""

    @property
    def key(self) -> bytes | None: ...
    @property
    def value(self) -> bytes | None: ...
    @property
    def headers(self) -> tuple[Header, ...]: ...
    @property
    def timestamp(self) -> int: ...
    @property
    def offset_delta(self) -> int: ...
    def __init__(
        self,
        *,
        key: bytes | bytearray | memoryview | None = None,
        value: bytes | bytearray | memoryview | None = None,
        headers: Iterable[HeaderLike] = (),
        timestamp: int = 0,
        offset_delta: int = 0,
    ) -> None: ...
    def with_key(self, key: bytes | bytearray | memoryview | None) -> Record: ...
    def with_value(self, value: bytes | bytearray | memoryview | None) -> Record: ...
    def with_headers(self, headers: Iterable[HeaderLike]) -> Record: ...
    def with_header(self, key: str, value: bytes | None) -> Record: ...
    def with_timestamp(self, timestamp: int) -> Record: ...
    def with_offset_delta(self, offset_delta: int) -> Record: ...
    def header_values(self, key: str) -> list[bytes | None]: ...
    def __hash__(self) -> int: ...

def decode_records(
    data: bytes, start: int, end: int, count: int, base_timestamp: int, origin: int = 0
) -> tuple[Record, ...]: ...
def produce_answer_untagged(frame: bytes, version: int) -> bool: ...
def read_request_header(
    frame: bytes | bytearray,
    header_type: type[_H],
    header_version_of: Callable[[int, int], int | None],
) -> _H | None: ...
class FrameAssembler:
    """Frames assembled in the buffers their bytes are received into (see the codec)."""

    max_frame_size: int
    large_frame: int
    """Frames of this many bytes or more get a buffer of their own."""
    part_size: int
    """Frames up to this size get one exact buffer; it is also the most a length
    prefix alone makes the assembler allocate."""
    def __init__(
        self,
        max_frame_size: int = ...,
        *,
        chunk_size: int = ...,
        large_frame: int = ...,
        part_size: int = ...,
    ) -> None: ...
    @property
    def buffered(self) -> int:
        """Bytes received but not yet returned as a frame (length prefixes included)."""
    def discard(self) -> None:
        """Drop every buffer held, at once: the stream is gone."""
    def get_buffer(self) -> memoryview:
        """Where the next bytes must be received; never empty."""
    def buffer_updated(self, nbytes: int) -> list[bytes | bytearray]:
        """Count ``nbytes`` received into the last get_buffer(); return whole frames."""

def encode_records(
    records: tuple[Record, ...], base_timestamp: int, renumber: bool
) -> tuple[bytes, int | None]: ...
def records_size(records: tuple[Record, ...]) -> int: ...
def upper_values(records: tuple[Record, ...], keys: bool = False) -> tuple[Record, ...]: ...
def receive_buffer(size: int) -> bytearray: ...
def seal_values(
    records: tuple[Record, ...], encrypt: object, aad: bytes, marker: Header, nonces: bytes,
    nonce_bytes: int
) -> tuple[Record, ...]: ...
def open_values(
    records: tuple[Record, ...], marker_key: str, descriptor: bytes, decrypt: object,
    aad: bytes, nonce_bytes: int, tag_bytes: int
) -> tuple[Record, ...] | None: ...
