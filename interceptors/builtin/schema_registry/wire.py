"""Where a record says which schema wrote it: Confluent framing and id headers.

Pure functions over bytes, no I/O:

* :func:`confluent_frame` splits a Confluent-framed key or value - magic byte 0,
  then the schema id as a 4-byte big-endian integer - into the id and the rest. An
  id of 0 is refused as framing: it is what Apicurio's serdes with headers disabled
  leave there (magic byte 0, then an 8-byte id), and no registry gives out id 0.
* :func:`message_indexes` reads the Protobuf message-index array that Confluent's
  Protobuf serializers write after the id: a zigzag varint count, then that many
  zigzag varint indexes (the path of nested message types from the file's top
  level); a count of 0 is the common shorthand for ``[0]``, the file's first
  message.
* :func:`header_id` reads an id carried in a record header instead (Apicurio
  serdes' ``apicurio.value.globalId`` / ``contentId`` style), encoded as an
  8-byte big-endian long (``long``), a 4-byte one (``int``) or decimal text
  (``string``).

Each raises :class:`FramingError` with a sentence a producer's developer can act on.
"""

from __future__ import annotations

from typing import Literal

from kiproxy.interceptors.api import Header

__all__ = ["HEADER_ENCODINGS", "FramingError", "HeaderEncoding", "confluent_frame",
           "header_id", "message_indexes"]

HeaderEncoding = Literal["long", "int", "string"]
HEADER_ENCODINGS: tuple[HeaderEncoding, ...] = ("long", "int", "string")

_MAX_INDEXES = 64  # nesting depth no real .proto reaches; bounds the loop on hostile bytes


class FramingError(ValueError):
    """The bytes do not carry a schema id the way the configuration expects."""


def confluent_frame(data: bytes) -> tuple[int, memoryview]:
    """``(schema id, the bytes after the 5-byte frame)``, or :class:`FramingError`."""
    if len(data) < 5 or data[0] != 0:
        if not data:
            got = "empty bytes"
        elif data[0] != 0:
            got = f"first byte 0x{data[0]:02x}"
        else:
            got = f"only {len(data)} bytes"
        raise FramingError(
            "not framed with a schema id: expected magic byte 0 and a 4-byte schema id, as "
            f"Confluent serializers write, got {got}")
    schema_id = int.from_bytes(data[1:5], "big")
    if schema_id == 0:  # no registry gives out id 0
        raise FramingError(
            "schema id 0 after magic byte 0: an Apicurio serde with "
            "apicurio.registry.headers.enabled=false writes an 8-byte id there, which is not "
            "Confluent framing; let it write the id in a header (its default) or set "
            "apicurio.registry.as-confluent=true with apicurio.registry.use-id=contentId")
    return schema_id, memoryview(data)[5:]


def _varint(data: memoryview, pos: int) -> tuple[int, int]:
    shift = result = 0
    while True:
        if pos >= len(data):
            raise FramingError("the Protobuf message-index array is cut short")
        byte = data[pos]
        pos += 1
        result |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return (result >> 1) ^ -(result & 1), pos  # zigzag
        shift += 7
        if shift > 63:
            raise FramingError("a Protobuf message index is not a valid varint")


def message_indexes(body: memoryview) -> tuple[tuple[int, ...], memoryview]:
    """``(message indexes, the Protobuf payload)`` from the bytes after the frame."""
    count, pos = _varint(body, 0)
    if count == 0:
        return (0,), body[pos:]
    if count < 0 or count > _MAX_INDEXES:
        raise FramingError(f"the Protobuf message-index array claims {count} entries")
    indexes = []
    for _ in range(count):
        index, pos = _varint(body, pos)
        if index < 0:
            raise FramingError(f"a Protobuf message index is negative ({index})")
        indexes.append(index)
    return tuple(indexes), body[pos:]


def header_id(headers: tuple[Header, ...], name: str, encoding: HeaderEncoding) -> int:
    """The schema id in the last header called ``name``, or :class:`FramingError`."""
    raw: bytes | None = None
    found = False
    for header in headers:
        if header.key == name:
            raw, found = header.value, True
    if not found or raw is None:
        raise FramingError(f"no schema id header {name!r}")
    if encoding == "string":
        text = raw.decode("ascii", "replace").strip()
        if not text.isdigit():
            raise FramingError(f"header {name!r} is not a decimal schema id: {text[:40]!r}")
        return int(text)
    size = 8 if encoding == "long" else 4
    if len(raw) != size:
        raise FramingError(f"header {name!r} holds {len(raw)} bytes, not a {size}-byte "
                           f"big-endian id ({encoding})")
    return int.from_bytes(raw, "big", signed=True)
