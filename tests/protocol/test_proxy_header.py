"""The PROXY protocol parser: round trips, bounds, and hostile bytes never crash it."""

from __future__ import annotations

import ipaddress
import struct

import pytest
from crc32c import crc32c
from hypothesis import given, settings
from hypothesis import strategies as st

from kiproxy.protocol.proxy_header import (
    PP2_TYPE_CRC32C,
    V1_MAX_LENGTH,
    V2_SIGNATURE,
    Incomplete,
    Local,
    NotProxy,
    ProxyHeader,
    ProxyHeaderError,
    parse_proxy_header,
)

Endpoint = tuple[str, int]
Ends = tuple[Endpoint, Endpoint]
Tlvs = tuple[tuple[int, bytes], ...]
KAFKA = b"\x00\x00\x00\x14\x00\x12\x00\x03"  # the start of an ApiVersions request


# ------------------------------------------------------------------ a test encoder

def encode_v1(source: tuple[str, int] | None, destination: tuple[str, int] | None) -> bytes:
    if source is None or destination is None:
        return b"PROXY UNKNOWN\r\n"
    proto = "TCP6" if ":" in source[0] else "TCP4"
    return (f"PROXY {proto} {source[0]} {destination[0]} {source[1]} {destination[1]}\r\n"
            .encode("ascii"))


def encode_v2(source: tuple[str, int] | None, destination: tuple[str, int] | None,
              tlvs: tuple[tuple[int, bytes], ...] = (), *, local: bool = False,
              with_crc: bool = False) -> bytes:
    if source is None or destination is None:
        family, block = 0x00, b""
    else:
        src, dst = ipaddress.ip_address(source[0]), ipaddress.ip_address(destination[0])
        family = 0x11 if src.version == 4 else 0x21
        block = src.packed + dst.packed + struct.pack("!HH", source[1], destination[1])
    if local:
        family, block = 0x00, b""
    body = block + b"".join(struct.pack("!BH", k, len(v)) + v for k, v in tlvs)
    crc_at = None
    if with_crc:
        crc_at = 16 + len(body) + 3
        body += struct.pack("!BH", PP2_TYPE_CRC32C, 4) + b"\0\0\0\0"
    header = V2_SIGNATURE + bytes([0x20 if local else 0x21, family]) + \
        struct.pack("!H", len(body)) + body
    if crc_at is not None:
        header = header[:crc_at] + crc32c(header).to_bytes(4, "big") + header[crc_at + 4:]
    return header


ipv4 = st.ip_addresses(v=4).map(str)
ipv6 = st.ip_addresses(v=6).map(str)
port = st.integers(0, 65535)
endpoints = st.one_of(
    st.tuples(st.tuples(ipv4, port), st.tuples(ipv4, port)),
    st.tuples(st.tuples(ipv6, port), st.tuples(ipv6, port)),
)
tlv_lists = st.lists(
    st.tuples(st.integers(0, 255).filter(lambda k: k != PP2_TYPE_CRC32C),
              st.binary(max_size=40)), max_size=5).map(tuple)


# ------------------------------------------------------------------ round trips

@given(endpoints, st.binary(max_size=20))
def test_v1_round_trip_keeps_the_application_bytes(ends: Ends, tail: bytes) -> None:
    header = encode_v1(ends[0], ends[1])
    assert len(header) <= V1_MAX_LENGTH
    parsed = parse_proxy_header(header + tail)
    assert parsed == ProxyHeader(version=1, family="inet6" if ":" in ends[0][0] else "inet",
                                 source=ends[0], destination=ends[1], length=len(header))


@given(endpoints, tlv_lists, st.booleans(), st.binary(max_size=20))
def test_v2_round_trip_with_tlvs(ends: Ends, tlvs: Tlvs, with_crc: bool, tail: bytes) -> None:
    header = encode_v2(ends[0], ends[1], tlvs, with_crc=with_crc)
    parsed = parse_proxy_header(header + tail)
    assert isinstance(parsed, ProxyHeader)
    assert (parsed.version, parsed.source, parsed.destination, parsed.length) == \
        (2, ends[0], ends[1], len(header))
    assert parsed.tlvs[:len(tlvs)] == tlvs


@given(endpoints, tlv_lists, st.sampled_from(["v1", "v2"]), st.data())
def test_every_proper_prefix_is_incomplete(ends: Ends, tlvs: Tlvs, version: str,
                                           data: st.DataObject) -> None:
    header = encode_v1(ends[0], ends[1]) if version == "v1" else encode_v2(ends[0], ends[1], tlvs)
    cut = data.draw(st.integers(1, len(header) - 1))
    assert isinstance(parse_proxy_header(header[:cut]), Incomplete)


@given(endpoints, tlv_lists, st.sampled_from(["v1", "v2"]), st.data())
@settings(max_examples=300)
def test_mutated_headers_answer_or_raise_the_typed_error(
        ends: Ends, tlvs: Tlvs, version: str, data: st.DataObject) -> None:
    header = bytearray(encode_v1(ends[0], ends[1]) if version == "v1"
                       else encode_v2(ends[0], ends[1], tlvs))
    for _ in range(data.draw(st.integers(1, 4))):
        at = data.draw(st.integers(0, len(header) - 1))
        header[at] = data.draw(st.integers(0, 255))
    cut = data.draw(st.integers(0, len(header)))
    stream = bytes(header[:cut])
    try:
        parsed = parse_proxy_header(stream)
    except ProxyHeaderError:
        return
    if isinstance(parsed, ProxyHeader | Local):
        assert parsed.length <= len(stream)  # never claims bytes it was not given


@given(st.binary(max_size=200))
def test_arbitrary_bytes_never_crash(stream: bytes) -> None:
    try:
        parsed = parse_proxy_header(stream)
    except ProxyHeaderError:
        return
    if isinstance(parsed, ProxyHeader | Local):
        assert parsed.length <= len(stream)


# ------------------------------------------------------------------ decisions in examples

def test_kafka_bytes_are_not_a_proxy_header() -> None:
    assert parse_proxy_header(KAFKA) == NotProxy()
    assert parse_proxy_header(b"") == Incomplete(1)


def test_v1_unknown_and_v2_local_name_no_client() -> None:
    assert parse_proxy_header(b"PROXY UNKNOWN\r\n" + KAFKA) == ProxyHeader(
        version=1, family="unspec", source=None, destination=None, length=15)
    local = encode_v2(None, None, local=True)
    assert parse_proxy_header(local + KAFKA) == Local(length=len(local))


def test_v1_longer_than_107_bytes_is_refused() -> None:
    with pytest.raises(ProxyHeaderError, match="no CRLF within 107 bytes"):
        parse_proxy_header(b"PROXY TCP4 " + b"1" * 200)


@pytest.mark.parametrize(("line", "message"), [
    (b"PROXY TCP4 10.0.0.1 10.0.0.2 5000\r\n", "is not 'TCP4"),
    (b"PROXY TCP5 10.0.0.1 10.0.0.2 5000 9092\r\n", "protocol 'TCP5'"),
    (b"PROXY TCP4 ::1 10.0.0.2 5000 9092\r\n", "'::1' is not a TCP4 address"),
    (b"PROXY TCP4 10.0.0.1 10.0.0.2 65536 9092\r\n", "'65536' is not a port"),
    (b"PROXY TCP4 10.0.0.1 10.0.0.2 5000 9092\n", "no CRLF"),
    (b"PROXY TCP4 10.0.0.1 10.0.0.\xff 5000 9092\r\n", "not ASCII"),
])
def test_malformed_v1_lines_are_named(line: bytes, message: str) -> None:
    with pytest.raises(ProxyHeaderError, match=message):
        parse_proxy_header(line)


def test_v2_bogus_lengths_and_versions_are_named() -> None:
    good = encode_v2(("10.0.0.1", 5000), ("10.0.0.2", 9092))
    with pytest.raises(ProxyHeaderError, match="above the bound of 4096"):
        parse_proxy_header(good[:14] + b"\xff\xff")  # refused before the bytes arrive
    with pytest.raises(ProxyHeaderError, match="too short for its inet addresses"):
        parse_proxy_header(good[:14] + b"\x00\x04" + good[16:20])
    with pytest.raises(ProxyHeaderError, match="version 3"):
        parse_proxy_header(good[:12] + b"\x31" + good[13:])
    with pytest.raises(ProxyHeaderError, match="unknown command"):
        parse_proxy_header(good[:12] + b"\x2f" + good[13:])
    with pytest.raises(ProxyHeaderError, match="family/protocol byte 0x41"):
        parse_proxy_header(good[:13] + b"\x41" + good[14:])


def test_v2_tlvs_that_overrun_or_a_wrong_crc_are_refused() -> None:
    overrun = encode_v2(("10.0.0.1", 5000), ("10.0.0.2", 9092), ((0xE0, b"abc"),))
    bad = overrun[:-5] + b"\x00\x09" + overrun[-3:]  # TLV claims 9 bytes, has 3
    with pytest.raises(ProxyHeaderError, match="overruns"):
        parse_proxy_header(bad)
    crc = bytearray(encode_v2(("10.0.0.1", 5000), ("10.0.0.2", 9092), with_crc=True))
    crc[-1] ^= 1
    with pytest.raises(ProxyHeaderError, match="CRC32C does not match"):
        parse_proxy_header(bytes(crc))


def test_unknown_tlvs_are_kept() -> None:
    header = encode_v2(("2001:db8::1", 5000), ("2001:db8::2", 9092),
                       ((0xEE, b"vendor"), (0x04, b"")))
    parsed = parse_proxy_header(header)
    assert isinstance(parsed, ProxyHeader)
    assert parsed.tlvs == ((0xEE, b"vendor"), (0x04, b""))
