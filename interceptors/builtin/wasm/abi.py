"""The Wasm interceptor's ABI codec: batches to the bytes a module reads, results back.

Pure functions, no wasmtime: :func:`encode_input` writes what the host puts in
the module's memory for one call (one record with ABI v1, the whole batch
with v2, as JSON or the binary encoding), and :func:`decode_result` reads the
module's answer: a status byte (:data:`STATUS_OK` then the record or batch,
:data:`STATUS_REJECT` then a UTF-8 reason, :data:`STATUS_UNCHANGED`) and
returns the records, the rejection reason (a str) or None for unchanged. A
result that does not follow the ABI raises :class:`Malformed` with what was
wrong. The README has the full description of both encodings.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from kiproxy.interceptors import Header, Record
from kiproxy.interceptors.builtin.sandbox import json_bytes, read_bytes, spell_bytes

__all__ = [
    "STATUS_OK",
    "STATUS_REJECT",
    "STATUS_UNCHANGED",
    "Malformed",
    "decode_result",
    "encode_input",
]

STATUS_OK = 0
"""Result status: the (transformed) record or batch follows."""
STATUS_REJECT = 1
"""Result status: reject the batch; a UTF-8 reason follows."""
STATUS_UNCHANGED = 2
"""Result status: the record (v1) or batch (v2) passes unchanged."""


class Malformed(Exception):
    """The module's result does not follow the ABI."""


_I32 = struct.Struct("<i")
_U32 = struct.Struct("<I")
_I64 = struct.Struct("<q")


_NULL = b"\xff\xff\xff\xff"
_I64_I32 = struct.Struct("<qi")


def _record_parts(parts: list[bytes], record: Record) -> None:
    """Append the binary layout of ``record`` to ``parts`` (joined once per call)."""
    key, value, headers = record.key, record.value, record.headers
    parts.append(_I64_I32.pack(record.timestamp, -1 if key is None else len(key)))
    if key:
        parts.append(key)
    if value is None:
        parts.append(_NULL)
    else:
        parts.append(_I32.pack(len(value)))
        parts.append(value)
    parts.append(_U32.pack(len(headers)))
    for header in headers:
        name, data = header.key.encode(), header.value
        parts.append(_U32.pack(len(name)))
        parts.append(name)
        if data is None:
            parts.append(_NULL)
        else:
            parts.append(_I32.pack(len(data)))
            parts.append(data)


_json_bytes = spell_bytes("tagged")
"""Bytes in the JSON encoding: text when UTF-8, else ``{"b64": "..."}`` (the host's)."""


def _json_record(record: Record) -> dict[str, Any]:
    return {
        "key": _json_bytes(record.key),
        "value": _json_bytes(record.value),
        "headers": [[h.key, _json_bytes(h.value)] for h in record.headers],
        "timestamp": record.timestamp,
    }


def encode_input(
    abi: int, encoding: str, topic: str, partition: int, records: Sequence[Record]
) -> bytes:
    """The bytes the host writes into the module's memory for one call.

    ABI v1 takes exactly one record; ABI v2 the whole batch.
    """
    if encoding == "json":
        doc: dict[str, Any] = {"topic": topic, "partition": partition}
        if abi == 1:
            doc.update(_json_record(records[0]))
        else:
            doc["records"] = [_json_record(r) for r in records]
        return json_bytes(doc).encode()
    name = topic.encode()
    parts = [_U32.pack(len(name)), name, _I32.pack(partition)]
    if abi == 1:
        _record_parts(parts, records[0])
    else:
        parts.append(_U32.pack(len(records)))
        for record in records:
            _record_parts(parts, record)
    return b"".join(parts)


class _Reader:
    """Bounds-checked reads of the binary result layout."""

    __slots__ = ("data", "pos")

    def __init__(self, data: bytes, pos: int) -> None:
        self.data = data
        self.pos = pos

    def take(self, n: int, what: str) -> bytes:
        end = self.pos + n
        if n < 0 or end > len(self.data):
            raise Malformed(f"{what} runs past the end of the result "
                             f"({n} bytes at offset {self.pos} of {len(self.data)})")
        chunk = self.data[self.pos:end]
        self.pos = end
        return chunk

    def i32(self, what: str) -> int:
        value: int = _I32.unpack(self.take(4, what))[0]
        return value

    def u32(self, what: str) -> int:
        value: int = _U32.unpack(self.take(4, what))[0]
        return value

    def nullable(self, what: str) -> bytes | None:
        n = self.i32(f"{what} length")
        if n == -1:
            return None
        if n < 0:
            raise Malformed(f"{what} length {n} is negative (only -1, null, is allowed)")
        return self.take(n, what)

    def record(self, original: Record, index: int) -> Record:
        where = f"record {index}"
        (timestamp,) = _I64.unpack(self.take(8, f"{where} timestamp"))
        key = self.nullable(f"{where} key")
        value = self.nullable(f"{where} value")
        count = self.u32(f"{where} header count")
        if count > len(self.data):
            raise Malformed(f"{where} claims {count} headers in a {len(self.data)}-byte result")
        headers = []
        for h in range(count):
            raw = self.take(self.u32(f"{where} header {h} key length"), f"{where} header {h} key")
            try:
                hkey = raw.decode()
            except UnicodeDecodeError:
                raise Malformed(f"{where} header {h} key is not UTF-8") from None
            headers.append(Header(hkey, self.nullable(f"{where} header {h} value")))
        return _rebuilt(original, key, value, tuple(headers), timestamp)


def _binary_records(data: bytes, pos: int, originals: Sequence[Record]) -> tuple[list[Record], int]:
    """Decode ``len(originals)`` records of the binary layout from ``pos``: the fast path.

    Raises ``_Malformed`` with a precise reason (found by re-reading with ``_Reader``)
    when the bytes do not follow the layout.
    """
    unpack_i32, unpack_u32, unpack_i64 = (_I32.unpack_from, _U32.unpack_from,
                                          _I64.unpack_from)
    size = len(data)
    start = pos
    out: list[Record] = []
    try:
        for original in originals:
            (timestamp,) = unpack_i64(data, pos)
            (n,) = unpack_i32(data, pos + 8)
            pos += 12
            key: bytes | None = None
            if n != -1:
                if n < 0 or pos + n > size:
                    raise ValueError
                key = data[pos:pos + n]
                pos += n
            (n,) = unpack_i32(data, pos)
            pos += 4
            value: bytes | None = None
            if n != -1:
                if n < 0 or pos + n > size:
                    raise ValueError
                value = data[pos:pos + n]
                pos += n
            (count,) = unpack_u32(data, pos)
            pos += 4
            if count > size:
                raise ValueError
            headers = []
            for _ in range(count):
                (n,) = unpack_u32(data, pos)
                pos += 4
                if pos + n > size:
                    raise ValueError
                hkey = data[pos:pos + n].decode()
                pos += n
                (n,) = unpack_i32(data, pos)
                pos += 4
                hvalue: bytes | None = None
                if n != -1:
                    if n < 0 or pos + n > size:
                        raise ValueError
                    hvalue = data[pos:pos + n]
                    pos += n
                headers.append(Header(hkey, hvalue))
            out.append(_rebuilt(original, key, value, tuple(headers), timestamp))
    except (struct.error, ValueError):  # UnicodeDecodeError is a ValueError
        reader = _Reader(data, start)
        for i, original in enumerate(originals):
            reader.record(original, i)
        raise Malformed("the records do not follow the binary layout") from None
    return out, pos


def _rebuilt(
    original: Record, key: bytes | None, value: bytes | None, headers: tuple[Header, ...],
    timestamp: int,
) -> Record:
    """The record with these fields - the original object itself when nothing changed."""
    if (key == original.key and value == original.value and timestamp == original.timestamp
            and headers == original.headers):
        return original
    return Record(key=key, value=value, headers=headers, timestamp=timestamp,
                  offset_delta=original.offset_delta)


def _from_json_bytes(value: Any, what: str) -> bytes | None:
    return read_bytes(value, "tagged", what, Malformed)


_JSON_RECORD_KEYS = {"key", "value", "headers", "timestamp", "topic", "partition"}


_I64_RANGE = range(-(2**63), 2**63)


def _json_to_record(doc: Any, original: Record, index: int,
                    place: tuple[str, int] | None) -> Record:
    where = f"record {index}"
    if not isinstance(doc, Mapping):
        raise Malformed(f"{where} must be a JSON object, not {type(doc).__name__}")
    _check_fields(doc, _JSON_RECORD_KEYS, place, where,
                  "key, value, headers, timestamp; topic and partition as given", "record")
    key = _from_json_bytes(doc["key"], f"{where} key") if "key" in doc else original.key
    value = _from_json_bytes(doc["value"], f"{where} value") if "value" in doc else original.value
    timestamp = original.timestamp
    if "timestamp" in doc:
        timestamp = doc["timestamp"]
        if not isinstance(timestamp, int) or isinstance(timestamp, bool):
            raise Malformed(f"{where} timestamp must be an integer (ms)")
        if timestamp not in _I64_RANGE:
            raise Malformed(f"{where} timestamp {timestamp} is beyond 64 bits")
    headers = original.headers
    if "headers" in doc:
        raw = doc["headers"]
        if not isinstance(raw, list):
            raise Malformed(f"{where} headers must be a list of [key, value] pairs")
        out = []
        for h, pair in enumerate(raw):
            if (not isinstance(pair, list) or len(pair) != 2 or not isinstance(pair[0], str)):
                raise Malformed(f"{where} header {h} must be a [key, value] pair "
                                 "with a string key")
            out.append(Header(pair[0], _from_json_bytes(pair[1], f"{where} header {h} value")))
        headers = tuple(out)
    return _rebuilt(original, key, value, headers, timestamp)


_JSON_BATCH_KEYS = {"records", "topic", "partition"}


def _check_fields(doc: Mapping[str, Any], allowed: set[str], place: tuple[str, int] | None,
                  where: str, listed: str, kind: str) -> None:
    """A JSON record's (or v2 result's) fields: only ``allowed`` (``listed`` says which),
    ``topic`` and ``partition`` as given (a module may return its input changed)."""
    unknown = set(doc) - allowed
    if unknown:
        raise Malformed(f"{where} has unknown field(s) {', '.join(sorted(unknown))} "
                        f"(allowed: {listed})")
    if place is not None:
        for field, given in zip(("topic", "partition"), place, strict=True):
            if field in doc and doc[field] != given:
                raise Malformed(f"{where} names {field} {doc[field]!r}, not {given!r}: a "
                                f"{kind} stays in its topic-partition")

def decode_result(
    abi: int, encoding: str, result: bytes, originals: Sequence[Record], *,
    place: tuple[str, int] | None = None,
) -> tuple[Record, ...] | str | None:
    """Interpret a module's result for ``originals`` (one record for v1).

    Returns the records (same count as ``originals``), the reason string of a
    rejection, or None for "unchanged". Raises ``Malformed`` when the result
    does not follow the ABI: with ``place`` (the batch's topic and partition), also
    when a JSON record names another topic or partition than the one it was given.
    """
    if not result:
        raise Malformed("the result is empty (expected a status byte)")
    status = result[0]
    if status == STATUS_UNCHANGED:
        return None
    if status == STATUS_REJECT:
        return result[1:].decode(errors="replace") or "(no reason given)"
    if status != STATUS_OK:
        raise Malformed(f"unknown status byte {status} (0 ok, 1 reject, 2 unchanged)")
    if encoding == "json":
        try:
            doc = json.loads(result[1:])
        except (ValueError, UnicodeDecodeError) as exc:
            raise Malformed(f"the result is not JSON: {exc}") from None
        if abi == 1:
            return (_json_to_record(doc, originals[0], 0, place),)
        if not isinstance(doc, Mapping) or not isinstance(doc.get("records"), list):
            raise Malformed('a v2 result must be a JSON object {"records": [...]}')
        _check_fields(doc, _JSON_BATCH_KEYS, place, "the result",
                      "records; topic and partition as given", "batch")
        items = doc["records"]
        if len(items) != len(originals):
            raise Malformed(f"the result holds {len(items)} records for a batch of "
                             f"{len(originals)}")
        return tuple(_json_to_record(d, o, i, place) for i, (d, o) in
                     enumerate(zip(items, originals, strict=True)))
    pos = 1
    if abi == 2:
        count = _Reader(result, 1).u32("record count")
        if count != len(originals):
            raise Malformed(f"the result holds {count} records for a batch of "
                             f"{len(originals)}")
        pos = 5
    records, pos = _binary_records(result, pos, originals)
    if pos != len(result):
        raise Malformed(f"{len(result) - pos} unexpected bytes after the records")
    return tuple(records)
