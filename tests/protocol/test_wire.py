"""The wire primitives every decoder reads through: the varint and the byte reader."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kiproxy.protocol.errors import MalformedFrame, MalformedMessage
from kiproxy.protocol.wire import ByteReader, read_uvarint


def uvarint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


@given(st.integers(0, 2**32 - 1), st.binary(max_size=4), st.binary(max_size=4))
def test_a_varint_reads_back_between_other_bytes(n: int, before: bytes, after: bytes) -> None:
    data = before + uvarint(n) + after
    assert read_uvarint(data, len(before), len(data), "count") == (n, len(data) - len(after))


@given(st.integers(0, 2**32 - 1))
def test_a_varint_cut_by_end_is_truncated_at_its_first_byte(n: int) -> None:
    data = b"\x00" + uvarint(n)
    for end in range(1, len(data)):
        with pytest.raises(MalformedMessage, match=r"^size varint truncated at byte 1$"):
            read_uvarint(data, 1, end, "size")


@pytest.mark.parametrize("data", [uvarint(2**32), b"\x80\x80\x80\x80\x80\x01"])
def test_a_varint_over_32_bits_raises_the_callers_error(data: bytes) -> None:
    with pytest.raises(MalformedFrame, match=r"^tag varint at byte 0 overflows 32 bits$"):
        read_uvarint(data, 0, len(data), "tag", MalformedFrame)


def test_the_byte_reader_reads_big_endian_and_names_what_was_cut() -> None:
    data = b"\x00\x07" + b"\xff\xff\xff\xfe" + b"\x00" * 7 + b"\x09" + b"\x2a" + b"abc"
    r = ByteReader(data, context="Fetch response: ")
    assert (r.i16("a"), r.i32("b"), r.i64("c"), r.uvarint("d")) == (7, -2, 9, 42)
    r.skip(1, "e")
    assert r.take(2, "f") == b"bc"
    with pytest.raises(MalformedMessage, match=r"^Fetch response: g truncated at byte 18$"):
        r.i16("g")
    with pytest.raises(MalformedMessage, match=r"^Fetch response: h varint truncated"):
        r.uvarint("h")
