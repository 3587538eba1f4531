"""Records blocks read and rewritten whole: ``open_block``, ``check_block``,
``block_header_value`` and ``block_carries_header``.

``open_block`` gives exactly the block that ``open_values`` then ``encode_records`` give
for the same sealed records (any keys, values, headers, hundreds of records, values up
to several KiB), and None wherever ``open_values`` does (another descriptor, a value
that does not open, a record without the marker or with it twice, a tombstone) or when
the cipher is not the compiled one. ``check_block`` says which record moved, and
refuses a block that is not the given number of well-formed records.
"""

from __future__ import annotations

import os

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import given, settings
from hypothesis import strategies as st

from kiproxy.interceptors.sealing import aes_gcm, compiled_gcm
from kiproxy.protocol.errors import CorruptBatch
from kiproxy.protocol.records import (
    Header,
    Record,
    block_carries_header,
    block_header_value,
    block_moved,
    check_block,
    decode_records,
    encode_records,
    open_block,
    open_values,
    seal_values,
)

MARKER = "kiproxy.encryption"
DESCRIPTOR = b"\x01\x01descriptor"
AAD = b"associated"
KEY = AESGCM.generate_key(bit_length=256)
GCM = aes_gcm(KEY)
BASE = 1_700_000_000_000

needs_compiled = pytest.mark.skipif(not compiled_gcm(), reason="OpenSSL cannot be bound here")

headers = st.lists(st.tuples(st.sampled_from(["h", "trace", "é"]),
                             st.none() | st.binary(max_size=20)), max_size=3)
records = st.lists(st.tuples(st.none() | st.binary(max_size=30),
                             st.binary(max_size=5000), headers,
                             st.integers(-1000, 10**6)), min_size=1, max_size=300)


def _records(drawn: list[tuple[bytes | None, bytes, list[tuple[str, bytes | None]], int]]
             ) -> tuple[Record, ...]:
    return tuple(Record(key=k, value=v, headers=h, timestamp=BASE + t, offset_delta=i)
                 for i, (k, v, h, t) in enumerate(drawn))


def _sealed_block(plain: tuple[Record, ...]) -> bytes:
    sealed = seal_values(plain, GCM, AAD, Header(MARKER, DESCRIPTOR),
                         os.urandom(12 * len(plain)), 12)
    return encode_records(sealed, BASE, False)[0]


def _open(block: bytes | memoryview, count: int, descriptor: bytes = DESCRIPTOR,
          decrypt: object = GCM.decrypt, aad: bytes = AAD) -> bytes | None:
    return open_block(block, count, MARKER, descriptor, decrypt, aad, 12)


@needs_compiled
@settings(max_examples=60, deadline=None)
@given(drawn=records)
def test_open_block_gives_the_block_of_open_values(
        drawn: list[tuple[bytes | None, bytes, list[tuple[str, bytes | None]], int]]) -> None:
    plain = _records(drawn)
    block = _sealed_block(plain)
    decoded = decode_records(block, 0, len(block), len(plain), BASE)
    expected = open_values(decoded, MARKER, DESCRIPTOR, GCM, AAD, 12, 16)
    assert expected is not None
    opened = _open(memoryview(block), len(plain))
    assert opened == encode_records(expected, BASE, False)[0]
    assert opened == encode_records(plain, BASE, False)[0]


@needs_compiled
def test_open_block_reads_a_view_in_the_middle_of_a_larger_buffer() -> None:
    plain = _records([(b"k", b"v" * 100, [], 0)] * 5)
    block = _sealed_block(plain)
    framed = b"\xff" * 13 + block + b"\xee" * 7
    assert _open(memoryview(framed)[13:13 + len(block)], 5) == \
        encode_records(plain, BASE, False)[0]


@needs_compiled
@pytest.mark.parametrize("case", ["descriptor", "aad", "cipher", "second marker",
                                  "no marker", "tombstone", "tampered"])
def test_open_block_answers_none_where_open_values_does(case: str) -> None:
    plain = _records([(b"k%d" % i, b"value %d" % i * 20, [("h", b"x")], i) for i in range(4)])
    sealed = list(seal_values(plain, GCM, AAD, Header(MARKER, DESCRIPTOR),
                              os.urandom(48), 12))
    descriptor, aad, decrypt = DESCRIPTOR, AAD, GCM.decrypt
    if case == "descriptor":
        descriptor = b"\x01\x01other"
    elif case == "aad":
        aad = b"another topic"
    elif case == "cipher":
        decrypt = AESGCM(KEY).decrypt
    elif case == "second marker":
        sealed[2] = sealed[2].with_headers((Header(MARKER, DESCRIPTOR), *sealed[2].headers))
    elif case == "no marker":
        sealed[1] = plain[1]
    elif case == "tombstone":
        sealed[3] = Record(key=b"k3", value=None, headers=[Header(MARKER, DESCRIPTOR)],
                           timestamp=BASE + 3, offset_delta=3)
    elif case == "tampered":
        value = bytearray(sealed[1].value or b"")
        value[20] ^= 0x01
        sealed[1] = sealed[1].with_value(bytes(value))
    block = encode_records(tuple(sealed), BASE, False)[0]
    assert _open(block, 4, descriptor, decrypt, aad) is None


def test_the_marker_is_found_where_it_lies() -> None:
    plain = _records([(b"k", b"v", [("h", b"1")], 0), (None, b"w", [], 1)])
    block = _sealed_block(plain)
    assert block_header_value(block, MARKER) == DESCRIPTOR
    assert block_header_value(block, "h") is None  # not the last header
    assert block_header_value(b"", MARKER) is None
    assert block_carries_header(block, 2, MARKER)
    clear = encode_records(plain, BASE, False)[0]
    assert block_header_value(clear, "h") == b"1"
    assert not block_carries_header(clear, 2, MARKER)
    assert block_carries_header(clear, 2, "h")
    with pytest.raises(CorruptBatch):
        block_carries_header(clear, 3, "h")


def test_check_block_names_the_record_that_moved() -> None:
    plain = _records([(b"k", b"v%d" % i, [], i * 7) for i in range(6)])
    block = encode_records(plain, BASE, False)[0]
    assert check_block(block, BASE, plain) == -1
    assert check_block(memoryview(block), BASE, plain) == -1
    moved = (*plain[:4], plain[4].with_offset_delta(9), plain[5])
    assert check_block(encode_records(moved, BASE, False)[0], BASE, plain) == 4
    later = (*plain[:2], plain[2].with_timestamp(plain[2].timestamp + 1), *plain[3:])
    assert check_block(encode_records(later, BASE, False)[0], BASE, plain) == 2
    assert check_block(block, BASE + 1, plain) == 0


@pytest.mark.parametrize("block", [b"", b"\x00", b"\x07not a block", b"\x02\x00" * 50])
def test_check_block_refuses_what_is_not_the_records(block: bytes) -> None:
    plain = _records([(b"k", b"v", [], 0), (b"k", b"w", [], 1)])
    with pytest.raises(CorruptBatch):
        check_block(block, BASE, plain)
    good = encode_records(plain, BASE, False)[0]
    with pytest.raises(CorruptBatch):
        check_block(good, BASE, plain[:1])
    with pytest.raises(CorruptBatch):
        check_block(good + b"\x00", BASE, plain)


def test_block_moved_says_the_same_as_check_block_without_records() -> None:
    plain = _records([(b"k", b"v%d" % i, [], i * 7) for i in range(6)])
    block = encode_records(plain, BASE, False)[0]
    assert block_moved(block, memoryview(block), 6) == -1
    changed = tuple(r.with_value(b"other") for r in plain)
    assert block_moved(encode_records(changed, BASE, False)[0], block, 6) == -1
    moved = (*plain[:4], plain[4].with_offset_delta(9), plain[5])
    assert block_moved(encode_records(moved, BASE, False)[0], block, 6) == 4
    later = (*plain[:2], plain[2].with_timestamp(plain[2].timestamp + 1), *plain[3:])
    assert block_moved(encode_records(later, BASE, False)[0], block, 6) == 2
    for bad in (b"", b"\x07not a block", block[:-1], block + b"\x00"):
        with pytest.raises(CorruptBatch):
            block_moved(bad, block, 6)
        with pytest.raises(CorruptBatch):
            block_moved(block, bad, 6)  # the original's lengths and deltas are read too

