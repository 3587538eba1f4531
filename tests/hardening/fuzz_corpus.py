"""The seed corpus and the mutations of the fuzz tests.

Seeds are real frames: the golden ProduceRequests that confluent-kafka sent
(``tests/fixtures/golden``), their record batches, and one frame per version of
every request and response the proxy decodes, built with every field filled in
(arrays of one element, optional fields set, tagged fields present) so that a
mutation can reach every field of every version.

Mutations are the ones that break parsers: bit flips, "interesting" bytes,
truncation, splicing two frames, inserting and deleting ranges, and overwriting
a 1/2/4-byte or varint field with a lying length (-1, 0, huge, negative).
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import struct
import types
import typing
import uuid
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from kio.schema.errors import ErrorCode
from kio.schema.index import schema_name_map
from kio.static.primitive import Interval, Records

from kiproxy.protocol.framing import (
    encode_request_header,
    encode_response_header,
    request_header_version,
    response_header_version,
)
from kiproxy.protocol.messages import ApiKey, request_type, response_type, serialize
from kiproxy.protocol.records import Compression, Record, build_batch, decode_batches

__all__ = [
    "DECODED_APIS",
    "GOLDEN",
    "SEED_TOPIC_ID",
    "Seed",
    "batch_seeds",
    "mutated",
    "nulled",
    "request_seeds",
    "response_seeds",
]

GOLDEN = Path(__file__).resolve().parents[1] / "fixtures" / "golden"

DECODED_APIS: dict[str, int] = {
    "produce": ApiKey.PRODUCE,
    "metadata": ApiKey.METADATA,
    "api_versions": ApiKey.API_VERSIONS,
    "find_coordinator": ApiKey.FIND_COORDINATOR,
    "describe_cluster": ApiKey.DESCRIBE_CLUSTER,
    "sasl_handshake": ApiKey.SASL_HANDSHAKE,
    "sasl_authenticate": ApiKey.SASL_AUTHENTICATE,
    "fetch": ApiKey.FETCH,
    "share_fetch": ApiKey.SHARE_FETCH,
    "share_acknowledge": ApiKey.SHARE_ACKNOWLEDGE,
}
"""Every API whose requests or responses the proxy parses (kio schema name -> key)."""

SEED_TOPIC_ID = uuid.UUID(int=0x1234_5678)
"""The topic id in every seed (Produce v13 names topics by id)."""

_REQUESTS_DECODED = ("produce", "metadata", "api_versions", "find_coordinator",
                     "describe_cluster", "sasl_handshake", "sasl_authenticate")


@dataclass(frozen=True)
class Seed:
    """One corpus entry: a frame (no length prefix) and what it is."""

    api_key: int
    api_version: int
    frame: bytes
    origin: str

    def __repr__(self) -> str:
        return f"Seed({self.origin}, {len(self.frame)} bytes)"


def _golden_produce_frames() -> list[tuple[str, bytes, dict[str, Any]]]:
    out = []
    for path in sorted(GOLDEN.glob("produce_*.bin")):
        meta = json.loads(path.with_suffix(".json").read_text())
        out.append((path.stem, path.read_bytes(), meta))
    return out


_BATCH = build_batch(
    [Record(key=b"k", value=b"v", headers=[("h", b"x"), ("h", None)], timestamp=1_700_000_000_000),
     Record(key=None, value=None, headers=[], timestamp=1_700_000_000_005)],
    producer_id=7, producer_epoch=0, base_sequence=0,
)


def sample(tp: Any, empty: bool = False) -> Any:
    """A value of kio type ``tp`` with every field filled in: arrays of one element,
    or with ``empty`` every array empty."""
    origin = typing.get_origin(tp)
    if origin in (types.UnionType, typing.Union):
        return sample(next(a for a in typing.get_args(tp) if a is not type(None)), empty)
    if origin is tuple:
        return () if empty else (sample(typing.get_args(tp)[0]),)
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        hints = typing.get_type_hints(tp)
        return tp(**{f.name: sample(hints[f.name], empty) for f in dataclasses.fields(tp)})
    if isinstance(tp, type):
        if issubclass(tp, bool):
            return True
        if issubclass(tp, ErrorCode):
            return ErrorCode(0)
        if issubclass(tp, Interval):
            return tp(max(min(7, tp.__high__), tp.__low__))
        if issubclass(tp, int):
            return tp(7)
        if issubclass(tp, float):
            return tp(1.5)
        if issubclass(tp, Records):
            return Records(_BATCH)
        if issubclass(tp, bytes):
            return b"seed-bytes"
        if issubclass(tp, str):
            return "seed" if tp is str else tp("seed")
        if issubclass(tp, uuid.UUID):
            return SEED_TOPIC_ID
        if issubclass(tp, datetime.timedelta):
            return datetime.timedelta(milliseconds=5)
        if issubclass(tp, datetime.datetime):
            return datetime.datetime(2024, 1, 1, tzinfo=datetime.UTC)
    raise TypeError(f"no sample value for {tp!r}")


def versions(name: str) -> list[int]:
    """Every version kio ships a schema for."""
    return sorted(schema_name_map[name])


@cache
def request_seeds(empty: bool = False) -> tuple[Seed, ...]:
    """Whole request frames: the golden Produce frames, then one per API version
    (``empty``: with every array empty instead, and no golden frames)."""
    out = [] if empty else [
        Seed(int(meta["api_key"]), int(meta["api_version"]), frame, f"golden {stem}")
        for stem, frame, meta in _golden_produce_frames()]
    for name in _REQUESTS_DECODED:
        key = DECODED_APIS[name]
        for version in versions(name):
            header_version = request_header_version(key, version)
            assert header_version is not None
            header = encode_request_header(key, version, 42, "fuzz-seed", header_version)
            body = serialize(sample(request_type(key, version), empty))
            out.append(Seed(key, version, header + body, f"{name} v{version} request"))
    return tuple(out)


@cache
def response_seeds(empty: bool = False) -> tuple[Seed, ...]:
    """Whole response frames (header included), one per version of each decoded API
    (``empty``: with every array empty)."""
    out = []
    for name, key in DECODED_APIS.items():
        for version in versions(name):
            header_version = response_header_version(key, version)
            assert header_version is not None
            body = serialize(sample(response_type(key, version), empty))
            out.append(Seed(key, version, encode_response_header(42, header_version) + body,
                            f"{name} v{version} response"))
    return tuple(out)


def nulled(frame: bytes) -> list[bytes]:
    """``frame`` with one length field made null, for every place one could be: an int32
    0 (an empty array) becomes -1, a compact length 1 (empty array or string) becomes 0,
    an int16 length before a ``seed`` string becomes -1 (and the string goes)."""
    out = []
    for i in range(len(frame) - 3):
        if frame[i : i + 4] == b"\x00\x00\x00\x00":
            out.append(frame[:i] + b"\xff\xff\xff\xff" + frame[i + 4 :])
    for i, byte in enumerate(frame):
        if byte == 1:
            out.append(frame[:i] + b"\x00" + frame[i + 1 :])
    for i in range(len(frame) - 5):
        if frame[i : i + 6] == b"\x00\x04seed":
            out.append(frame[:i] + b"\xff\xff" + frame[i + 6 :])
        if frame[i : i + 5] == b"\x05seed":
            out.append(frame[:i] + b"\x00" + frame[i + 5 :])
    return out


@cache
def batch_seeds() -> tuple[bytes, ...]:
    """Record batches: those of the golden frames (every codec) and a few built ones."""
    from kiproxy.protocol.framing import parse_request_header
    from kiproxy.protocol.messages import parse_request

    out: list[bytes] = []
    for _, frame, _ in _golden_produce_frames():
        header = parse_request_header(frame)
        assert header.body_offset is not None
        request = parse_request(header.api_key, header.api_version, frame, header.body_offset)
        for topic in request.topic_data:
            for part in topic.partition_data:
                out.extend(b.raw for b in decode_batches(bytes(part.records)))
    records = [Record(key=b"k%d" % i, value=b"value %d " % i * 3,
                      headers=[("a", b"1"), ("a", None)], timestamp=1_700_000_000_000 + i)
               for i in range(5)]
    for codec in Compression:
        out.append(build_batch(records, compression=codec, producer_id=3, producer_epoch=1,
                               base_sequence=10, transactional=codec is Compression.GZIP))
    out.append(build_batch([Record(key=b"\x00\x00\x00\x00", value=b"\x00\x00\x00\x00\x00\x00",
                                   timestamp=1)], control=True, transactional=True))
    out.append(_BATCH + build_batch(records[:2]))  # two batches back to back
    return tuple(out)


# ---------------------------------------------------------------------------- mutations

_INTERESTING = (0x00, 0x01, 0x7F, 0x80, 0xFF, 0xFE)
_LIES = (-1, -2, 0, 1, 0x7F, 0xFF, 0x7FFF, 0x8000, 0xFFFF, 0x7FFF_FFFF, -0x8000_0000, 0xFFFF_FFFF)


def _varint(n: int) -> bytes:
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


@st.composite
def _mutation(draw: st.DrawFn, data: bytearray, donors: tuple[bytes, ...]) -> None:
    """Apply one mutation to ``data`` in place."""
    kind = draw(st.sampled_from(
        ("flip", "byte", "truncate", "splice", "insert", "delete", "duplicate", "lie",
         "varint")))
    n = len(data)
    pos = draw(st.integers(0, max(n - 1, 0)))
    if kind == "flip" and n:
        data[pos] ^= 1 << draw(st.integers(0, 7))
    elif kind == "byte" and n:
        data[pos] = draw(st.sampled_from(_INTERESTING) | st.integers(0, 255))
    elif kind == "truncate":
        del data[pos:]
    elif kind == "splice":
        donor = draw(st.sampled_from(donors))
        cut = draw(st.integers(0, len(donor)))
        data[pos:] = donor[cut:]
    elif kind == "insert":
        data[pos:pos] = draw(st.binary(min_size=1, max_size=16))
    elif kind == "delete":
        del data[pos : pos + draw(st.integers(1, 16))]
    elif kind == "duplicate":
        data[pos:pos] = data[pos : pos + draw(st.integers(1, 64))]
    elif kind == "lie":
        width = draw(st.sampled_from((1, 2, 4)))
        value = draw(st.sampled_from(_LIES) | st.integers(-(2**31), 2**31 - 1))
        raw = struct.pack(">q", value)[-width:]
        data[pos : pos + width] = raw
    elif kind == "varint":
        value = draw(st.sampled_from((0, 1, 2**7, 2**14, 2**21, 2**28, 2**31, 2**32, 2**35,
                                      2**63)))
        data[pos : pos + 1] = _varint(value)


@st.composite
def mutated(draw: st.DrawFn, seeds: tuple[bytes, ...], max_mutations: int = 4) -> bytes:
    """A seed with 0..``max_mutations`` mutations (0: the seed itself must be handled too)."""
    data = bytearray(draw(st.sampled_from(seeds)))
    for _ in range(draw(st.integers(0, max_mutations))):
        draw(_mutation(data, seeds))
    return bytes(data)
