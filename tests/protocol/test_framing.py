"""Framing: int32-length frames out of a byte stream, and request/response headers.

A proxy sees pipelined requests arriving in arbitrary TCP segments; the decoder
must give back exactly the frames that were sent, whatever the segmentation, and
refuse an oversized or negative length as soon as the prefix arrives.
"""

from __future__ import annotations

import dataclasses
import re
import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiproxy.protocol.errors import FrameTooLarge, MalformedFrame
from kiproxy.protocol.framing import (
    API_VERSIONS_KEY,
    FrameDecoder,
    RequestHeader,
    encode_frame,
    encode_request_header,
    encode_response_header,
    is_flexible,
    parse_request_header,
    parse_response_header,
    request_header_version,
    response_header_version,
)
from kiproxy.protocol.messages import ApiKey

PAYLOADS = st.lists(st.binary(max_size=300), max_size=12)


def uvarint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


def tagged_fields(fields: list[tuple[int, bytes]]) -> bytes:
    """A tagged-field section: count, then (tag, size, data) each."""
    return uvarint(len(fields)) + b"".join(uvarint(t) + uvarint(len(d)) + d for t, d in fields)


# ------------------------------------------------------------- FrameDecoder


def test_frame_split_at_every_byte_boundary() -> None:
    payloads = [b"", b"a", b"hello kafka", bytes(range(256)) * 3]
    stream = b"".join(encode_frame(p) for p in payloads)
    for cut in range(len(stream) + 1):
        decoder = FrameDecoder()
        frames = decoder.feed(stream[:cut]) + decoder.feed(stream[cut:])
        assert frames == payloads, f"split at byte {cut}"
        assert decoder.buffered == 0


def test_frame_fed_one_byte_at_a_time() -> None:
    payloads = [b"x" * n for n in (0, 1, 4, 5, 70)]
    decoder = FrameDecoder()
    frames: list[bytes] = []
    for byte in b"".join(encode_frame(p) for p in payloads):
        frames += decoder.feed(bytes([byte]))
    assert frames == payloads


def test_many_frames_in_one_feed_come_out_in_order() -> None:
    payloads = [struct.pack(">i", i) * (i % 7) for i in range(500)]
    decoder = FrameDecoder()
    assert decoder.feed(b"".join(encode_frame(p) for p in payloads)) == payloads
    assert decoder.buffered == 0


def test_partial_frame_stays_buffered_until_complete() -> None:
    decoder = FrameDecoder()
    frame = encode_frame(b"0123456789")
    assert decoder.feed(encode_frame(b"first") + frame[:7]) == [b"first"]
    assert decoder.buffered == 7
    assert decoder.feed(frame[7:]) == [b"0123456789"]
    assert decoder.buffered == 0


@settings(max_examples=150, deadline=None)
@given(payloads=PAYLOADS, cuts=st.lists(st.integers(0, 4000), max_size=10))
def test_any_segmentation_yields_the_same_frames(payloads: list[bytes], cuts: list[int]) -> None:
    stream = b"".join(encode_frame(p) for p in payloads)
    points = sorted({min(c, len(stream)) for c in cuts})
    decoder = FrameDecoder(max_frame_size=300)
    frames: list[bytes] = []
    start = 0
    for point in [*points, len(stream)]:
        frames += decoder.feed(stream[start:point])
        start = point
    assert frames == payloads
    assert decoder.buffered == 0


def test_frame_at_the_maximum_size_is_accepted() -> None:
    decoder = FrameDecoder(max_frame_size=16)
    assert decoder.feed(encode_frame(b"x" * 16)) == [b"x" * 16]


def test_frame_over_max_size_raises_as_soon_as_the_prefix_arrives() -> None:
    decoder = FrameDecoder(max_frame_size=1024)
    with pytest.raises(FrameTooLarge, match="1025"):
        # Only the length prefix: the decoder must not wait for (or buffer) the body.
        decoder.feed(struct.pack(">i", 1025))
    assert decoder.buffered <= 4


def test_huge_length_prefix_is_refused_without_allocating() -> None:
    decoder = FrameDecoder()
    with pytest.raises(FrameTooLarge):
        decoder.feed(struct.pack(">i", 2**31 - 1) + b"tiny")
    assert decoder.buffered <= 8


def test_oversized_frame_after_good_frames_in_the_same_feed() -> None:
    decoder = FrameDecoder(max_frame_size=10)
    with pytest.raises(FrameTooLarge):
        decoder.feed(encode_frame(b"ok") + struct.pack(">i", 11) + b"x" * 11)


@pytest.mark.parametrize("size", [-1, -2**31])
def test_negative_frame_length_is_malformed(size: int) -> None:
    decoder = FrameDecoder()
    with pytest.raises(MalformedFrame, match="negative"):
        decoder.feed(struct.pack(">i", size))


def test_size_errors_are_distinct_types() -> None:
    assert not issubclass(FrameTooLarge, MalformedFrame)
    assert not issubclass(MalformedFrame, FrameTooLarge)


# ------------------------------------------------------------- request headers


@pytest.mark.parametrize(
    ("api_key", "api_version", "header_version"),
    [
        (ApiKey.PRODUCE, 3, 1),
        (ApiKey.PRODUCE, 8, 1),
        (ApiKey.PRODUCE, 9, 2),
        (ApiKey.METADATA, 0, 1),
        (ApiKey.METADATA, 8, 1),
        (ApiKey.METADATA, 9, 2),
        (ApiKey.API_VERSIONS, 2, 1),
        (ApiKey.API_VERSIONS, 3, 2),  # flexible request, though the response is header v0
        (ApiKey.FIND_COORDINATOR, 3, 2),
        (7, 0, 0),  # ControlledShutdown v0: the one request with header v0
        # Older than any schema kio ships, but older than flexible versions too: v1.
        (ApiKey.PRODUCE, 0, 1),
        (ApiKey.PRODUCE, 2, 1),
        (ApiKey.FETCH, 0, 1),
    ],
)
def test_request_header_version(api_key: int, api_version: int, header_version: int) -> None:
    assert request_header_version(api_key, api_version) == header_version


def test_unknown_api_or_version_has_no_header_version() -> None:
    assert request_header_version(ApiKey.PRODUCE, 999) is None
    assert request_header_version(32_000, 0) is None
    assert is_flexible(32_000, 0) is None
    assert response_header_version(ApiKey.METADATA, 999) is None


CLIENT_IDS = st.none() | st.text(max_size=40)


@settings(max_examples=150, deadline=None)
@given(
    api=st.sampled_from([(ApiKey.PRODUCE, 7), (ApiKey.METADATA, 4), (ApiKey.PRODUCE, 11),
                         (ApiKey.METADATA, 12), (ApiKey.API_VERSIONS, 3), (7, 0)]),
    correlation_id=st.integers(-(2**31), 2**31 - 1),
    client_id=CLIENT_IDS,
    body=st.binary(max_size=20),
)
def test_request_header_round_trip(api: tuple[int, int], correlation_id: int,
                                   client_id: str | None, body: bytes) -> None:
    api_key, api_version = api
    version = request_header_version(api_key, api_version)
    assert version is not None
    raw = encode_request_header(api_key, api_version, correlation_id, client_id, version)
    header = parse_request_header(raw + body)
    assert header == RequestHeader(
        api_key=api_key, api_version=api_version, correlation_id=correlation_id,
        client_id=None if version == 0 else client_id, header_version=version,
        body_offset=len(raw),
    )
    assert (raw + body)[header.body_offset:] == body


def test_request_header_v1_layout() -> None:
    raw = encode_request_header(ApiKey.METADATA, 4, 0x01020304, "abc", 1)
    assert raw == b"\x00\x03\x00\x04\x01\x02\x03\x04\x00\x03abc"


def test_request_header_v2_keeps_client_id_a_non_compact_string() -> None:
    raw = encode_request_header(ApiKey.METADATA, 12, 9, "abc", 2)
    assert raw == b"\x00\x03\x00\x0c\x00\x00\x00\x09\x00\x03abc\x00"


def test_request_header_null_client_id() -> None:
    raw = encode_request_header(ApiKey.PRODUCE, 9, 1, None, 2)
    assert raw[8:10] == b"\xff\xff"
    header = parse_request_header(raw)
    assert header.client_id is None
    assert header.body_offset == len(raw)


def test_request_header_empty_client_id_is_not_null() -> None:
    header = parse_request_header(encode_request_header(ApiKey.PRODUCE, 7, 1, "", 1))
    assert header.client_id == ""


def test_request_header_v2_skips_tagged_fields() -> None:
    fields = tagged_fields([(0, b"\x01\x02"), (5, b""), (300, b"x" * 200)])
    frame = (struct.pack(">hhih", ApiKey.METADATA, 12, 77, 2) + b"me" + fields + b"BODY")
    header = parse_request_header(frame)
    assert header.client_id == "me"
    assert header.header_version == 2
    assert header.body_offset is not None
    assert frame[header.body_offset:] == b"BODY"


def test_request_header_v1_does_not_read_tagged_fields() -> None:
    frame = struct.pack(">hhih", ApiKey.METADATA, 8, 77, 2) + b"me" + b"\x01BODY"
    header = parse_request_header(frame)
    assert header.body_offset is not None
    assert frame[header.body_offset:] == b"\x01BODY"


@pytest.mark.parametrize("api_version", [0, 1, 2])
def test_old_produce_request_header_has_a_body_offset(api_version: int) -> None:
    # Produce v0-v2 has no kio schema; the proxy still has to find the body to refuse it.
    raw = encode_request_header(ApiKey.PRODUCE, api_version, 9, "legacy", 1)
    header = parse_request_header(raw + b"BODY")
    assert header.header_version == 1
    assert header.client_id == "legacy"
    assert header.body_offset == len(raw)


def test_request_header_of_unknown_version_has_no_body_offset() -> None:
    frame = struct.pack(">hhih", ApiKey.API_VERSIONS, 99, 5, 3) + b"cli" + b"\x00body"
    header = parse_request_header(frame)
    assert (header.api_key, header.api_version, header.correlation_id) == (18, 99, 5)
    assert header.client_id == "cli"
    assert header.header_version is None
    assert header.body_offset is None


@pytest.mark.parametrize(
    ("frame", "what"),
    [
        (b"", "shorter"),
        (b"\x00\x03\x00\x04\x00\x00\x00", "shorter"),
        (b"\x00\x03\x00\x04\x00\x00\x00\x01", "client_id"),  # v1 without the length
        (b"\x00\x03\x00\x04\x00\x00\x00\x01\x00\x05abc", "runs past"),
        (b"\x00\x03\x00\x04\x00\x00\x00\x01\xff\xfe", "negative"),
        (b"\x00\x03\x00\x0c\x00\x00\x00\x01\x00\x00", "tagged field count"),
        (b"\x00\x03\x00\x0c\x00\x00\x00\x01\x00\x00\x01\x00\x05ab", "runs past"),
        (b"\x00\x03\x00\x0c\x00\x00\x00\x01\x00\x00\xff\xff\xff\xff\xff\x01", "overflows"),
    ],
)
def test_malformed_request_header(frame: bytes, what: str) -> None:
    with pytest.raises(MalformedFrame, match=what):
        parse_request_header(frame)


# ------------------------------------------------------------- response headers


@pytest.mark.parametrize("version", [0, 1])
@settings(max_examples=50, deadline=None)
@given(correlation_id=st.integers(-(2**31), 2**31 - 1), body=st.binary(max_size=10))
def test_response_header_round_trip(version: int, correlation_id: int, body: bytes) -> None:
    raw = encode_response_header(correlation_id, version)
    assert len(raw) == 4 + version
    assert parse_response_header(raw + body, version) == (correlation_id, len(raw))


def test_response_header_v1_skips_tagged_fields() -> None:
    frame = struct.pack(">i", 42) + tagged_fields([(1, b"abc"), (2, b"")]) + b"BODY"
    correlation_id, offset = parse_response_header(frame, 1)
    assert correlation_id == 42
    assert frame[offset:] == b"BODY"
    # The same bytes read as header v0 leave the tagged fields in the body.
    assert parse_response_header(frame, 0) == (42, 4)


@pytest.mark.parametrize("frame", [b"", b"\x00\x00\x01"])
def test_truncated_response_header(frame: bytes) -> None:
    with pytest.raises(MalformedFrame):
        parse_response_header(frame, 0)


def test_truncated_response_tagged_fields() -> None:
    with pytest.raises(MalformedFrame):
        parse_response_header(struct.pack(">i", 1), 1)
    with pytest.raises(MalformedFrame):
        parse_response_header(struct.pack(">i", 1) + b"\x01\x00\x09ab", 1)


@pytest.mark.parametrize("api_version", range(5))
def test_api_versions_response_always_uses_header_v0(api_version: int) -> None:
    assert response_header_version(API_VERSIONS_KEY, api_version) == 0
    # Even the version a server has never heard of: the answer is v0-framed.
    assert response_header_version(API_VERSIONS_KEY, 1000) == 0


@pytest.mark.parametrize(
    ("api_key", "api_version", "header_version"),
    [
        (ApiKey.METADATA, 8, 0),
        (ApiKey.METADATA, 9, 1),
        (ApiKey.PRODUCE, 8, 0),
        (ApiKey.PRODUCE, 9, 1),
        (ApiKey.FETCH, 11, 0),
        (ApiKey.FETCH, 12, 1),
        (ApiKey.DESCRIBE_CLUSTER, 0, 1),
        (ApiKey.FIND_COORDINATOR, 2, 0),
        (ApiKey.FIND_COORDINATOR, 3, 1),
        (ApiKey.PRODUCE, 0, 0),
        (ApiKey.PRODUCE, 2, 0),
    ],
)
def test_response_header_version(api_key: int, api_version: int, header_version: int) -> None:
    assert response_header_version(api_key, api_version) == header_version


def test_receive_buffers_have_the_size_asked_and_refuse_a_negative_one() -> None:
    from kiproxy.protocol._codec import receive_buffer

    assert [len(receive_buffer(n)) for n in (0, 1, 65536)] == [0, 1, 65536]
    assert isinstance(receive_buffer(8), bytearray)
    with pytest.raises(ValueError, match="negative size"):
        receive_buffer(-1)


@settings(max_examples=300, deadline=None)
@given(
    api=st.sampled_from([(ApiKey.PRODUCE, 7), (ApiKey.METADATA, 4), (ApiKey.PRODUCE, 11),
                         (ApiKey.METADATA, 12), (ApiKey.API_VERSIONS, 3), (7, 0),
                         (ApiKey.PRODUCE, 99), (-3, 1)]),
    correlation_id=st.integers(-(2**31), 2**31 - 1),
    client_id=CLIENT_IDS | st.binary(max_size=12).map(lambda b: b.decode("latin-1")),
    body=st.binary(max_size=20),
    mutation=st.none() | st.tuples(st.integers(0, 60), st.integers(0, 255)),
    cut=st.none() | st.integers(0, 60),
    as_bytearray=st.booleans(),
)
def test_the_compiled_header_reader_agrees_with_the_python_one(
        api: tuple[int, int], correlation_id: int, client_id: str | None, body: bytes,
        mutation: tuple[int, int] | None, cut: int | None, as_bytearray: bool) -> None:
    """What the compiled reader reads (None: it leaves the frame to Python) is what the
    Python reader reads; with bytes cut, changed or invalid UTF-8 in the client id."""
    from kiproxy.protocol._codec import read_request_header
    from kiproxy.protocol.framing import _parse_request_header

    api_key, api_version = api
    version = request_header_version(api_key, api_version) or 1
    frame = encode_request_header(api_key, api_version, correlation_id, client_id,
                                  version) + body
    if mutation is not None and mutation[0] < len(frame):
        frame = frame[:mutation[0]] + bytes([mutation[1]]) + frame[mutation[0] + 1:]
    if cut is not None:
        frame = frame[:cut]
    data: bytes | bytearray = bytearray(frame) if as_bytearray else frame
    compiled = read_request_header(data, RequestHeader, request_header_version)
    try:
        expected: RequestHeader | Exception = _parse_request_header(data)
    except MalformedFrame as exc:
        expected = exc
    if compiled is not None:
        assert compiled == expected
        assert type(compiled) is RequestHeader
    else:  # what parse_request_header gives or raises is the Python reader's
        if isinstance(expected, Exception):
            with pytest.raises(MalformedFrame, match=re.escape(str(expected))):
                parse_request_header(data)
        else:
            assert parse_request_header(data) == expected


def test_the_compiled_header_reader_takes_what_clients_send() -> None:
    from kiproxy.protocol._codec import read_request_header

    for api_key, api_version, header_version in ((ApiKey.PRODUCE, 9, 2), (ApiKey.METADATA, 4, 1)):
        for client_id in ("rdkafka", None, "é"):
            frame = encode_request_header(api_key, api_version, 42, client_id, header_version)
            header = read_request_header(frame + b"body", RequestHeader, request_header_version)
            assert header is not None and header.client_id == client_id
            with pytest.raises(dataclasses.FrozenInstanceError):
                header.correlation_id = 1  # type: ignore[misc]
