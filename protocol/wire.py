"""Kafka's wire primitives, read with bounds checks: the unsigned varint and a byte reader
(and the unsigned varint written, for the splices that rewrite a length).

Every decoder in :mod:`protocol` reads varints and small big-endian integers
through this module, so that a truncated or oversized field fails the same way
everywhere: the caller names the field (``what``) and the error type (a
:class:`~kiproxy.protocol.errors.ProtocolError` subclass, or a decoder's own
internal error), and the message names the field and the byte position.

Contract: pure functions over ``bytes``/``bytearray``; a read never looks at
or past ``end``; nothing here allocates more than the value it returns.
Imports nothing of ours but :mod:`kiproxy.protocol.errors`.
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from kiproxy.protocol.errors import MalformedMessage

__all__ = ["BadVarint", "ByteReader", "ErrorFactory", "read_records_field", "read_uvarint",
           "short_read", "uvarint"]

ErrorFactory = Callable[[str], Exception]
"""What a read raises for bad input: called with the message (an exception class fits)."""

_I16 = struct.Struct(">h")
_I32 = struct.Struct(">i")
_I64 = struct.Struct(">q")


def read_uvarint(data: bytes | bytearray, pos: int, end: int, what: str,
                 error: ErrorFactory = MalformedMessage) -> tuple[int, int]:
    """The unsigned 32-bit varint at ``pos`` and the position after it.

    Reads no byte at or after ``end``. A varint cut short by ``end``, longer than
    five bytes or above 2**32 - 1 raises ``error(message)``; the message names
    ``what`` and the varint's first byte.
    """
    if pos < end:
        b = data[pos]
        if b < 0x80:  # one byte: the common case (lengths, counts, no tagged fields)
            return b, pos + 1
    start = pos
    result = shift = 0
    while True:
        if pos >= end:
            raise error(f"{what} varint truncated at byte {start}")
        b = data[pos]
        pos += 1
        if shift == 28 and b & 0xF0:
            raise error(f"{what} varint at byte {start} overflows 32 bits")
        result |= (b & 0x7F) << shift
        if not b & 0x80:
            return result, pos
        shift += 7


class BadVarint(MalformedMessage):
    """A varint that runs past the frame or overflows, raised deep inside a one-pass
    message reader; the reader's entry point re-raises it naming the message."""


def short_read(context: str, what: str, pos: int, end: int) -> MalformedMessage:
    """The error of a field that runs past the frame (``context``: ``Produce request v9``)."""
    return MalformedMessage(f"{context} does not parse: {what} at byte {pos} runs past "
                            f"the {end}-byte frame")


def read_records_field(data: bytes | bytearray, pos: int, end: int, flexible: bool,
                       context: str, what: str = "records") -> tuple[int, int, int]:
    """The nullable ``records`` field at ``pos`` (a compact one when ``flexible``): its
    size (-1 for null), where its bytes start and one past where they end.

    Raises :class:`BadVarint` for a bad compact length, and :func:`short_read` or a
    ``does not parse`` :class:`MalformedMessage` naming ``context`` for a length that
    runs past ``end`` or is below -1. ``what`` names the bytes in the short-read error
    (``{size}`` is replaced by the size).
    """
    records_at = pos
    if flexible:
        size, pos = read_uvarint(data, pos, end, "records length", BadVarint)
        size -= 1
    else:
        if pos + 4 > end:
            raise short_read(context, "records length", pos, end)
        (size,) = _I32.unpack_from(data, pos)
        pos += 4
    start = pos
    if size > 0:
        if pos + size > end:
            raise short_read(context, what.format(size=size), pos, end)
        pos += size
    elif size < -1:
        raise MalformedMessage(f"{context} does not parse: records length {size} at byte "
                               f"{records_at}")
    return size, start, pos


class ByteReader:
    """Big-endian, bounds-checked reads from ``data[pos:end]``, advancing :attr:`pos`.

    A read past ``end`` raises ``error(context + "<what> truncated at byte <pos>")``,
    where ``context`` says which message is being read (for example
    ``"Produce v0-v2 request: "``).
    """

    __slots__ = ("_context", "_error", "data", "end", "pos")

    def __init__(self, data: bytes, pos: int = 0, end: int | None = None, *,
                 error: ErrorFactory = MalformedMessage, context: str = "") -> None:
        self.data = data
        """The bytes being read."""
        self.pos = pos
        """The position of the next read."""
        self.end = len(data) if end is None else end
        """One past the last byte this reader may read."""
        self._error = error
        self._context = context

    def take(self, n: int, what: str) -> bytes:
        """The next ``n`` bytes (``what`` names them in the error)."""
        if n < 0 or self.pos + n > self.end:
            raise self._error(f"{self._context}{what} truncated at byte {self.pos}")
        out = self.data[self.pos:self.pos + n]
        self.pos += n
        return out

    def skip(self, n: int, what: str) -> None:
        """Step over the next ``n`` bytes without copying them."""
        if n < 0 or self.pos + n > self.end:
            raise self._error(f"{self._context}{what} truncated at byte {self.pos}")
        self.pos += n

    def i16(self, what: str) -> int:
        """The next signed 16-bit integer."""
        return int(_I16.unpack(self.take(2, what))[0])

    def i32(self, what: str) -> int:
        """The next signed 32-bit integer."""
        return int(_I32.unpack(self.take(4, what))[0])

    def i64(self, what: str) -> int:
        """The next signed 64-bit integer."""
        return int(_I64.unpack(self.take(8, what))[0])

    def uvarint(self, what: str) -> int:
        """The next unsigned 32-bit varint."""
        value, self.pos = read_uvarint(self.data, self.pos, self.end, what,
                                       self._error_for(what))
        return value

    def _error_for(self, what: str) -> ErrorFactory:
        context, error = self._context, self._error
        return lambda message: error(context + message)


def uvarint(value: int) -> bytes:
    """``value`` (>= 0) as Kafka's unsigned varint: 7 bits a byte, low bits first."""
    out = bytearray()
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)
