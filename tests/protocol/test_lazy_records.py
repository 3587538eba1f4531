"""Decoded records build their fields on first read; nothing else may tell.

``decode_records`` checks every record completely (the validity pass) and builds a
record's key, value and headers only when they are read. Whatever fields a plugin
reads, and whatever it changes, the records compare, hash, pickle and encode
exactly as records built from the same values; a header key that is not UTF-8 (which
brokers store) is read with ``surrogateescape`` and written back as the same bytes.
"""

from __future__ import annotations

import pickle

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiproxy.protocol._codec import (
    Header,
    Record,
    decode_records,
    encode_records,
    upper_values,
)

NULLABLE = st.none() | st.binary(max_size=40)
HEADERS = st.lists(st.tuples(st.text(max_size=8), NULLABLE), max_size=3)
BASE_TS = 1_700_000_000_000


@st.composite
def records(draw: st.DrawFn) -> tuple[Record, ...]:
    return tuple(
        Record(key=draw(NULLABLE), value=draw(NULLABLE),
               headers=tuple(Header(k, v) for k, v in draw(HEADERS)),
               timestamp=BASE_TS + draw(st.integers(-1000, 10**6)), offset_delta=i)
        for i in range(draw(st.integers(0, 6))))


def _decoded(recs: tuple[Record, ...]) -> tuple[Record, ...]:
    block, _ = encode_records(recs, BASE_TS, False)
    return decode_records(block, 0, len(block), len(recs), BASE_TS)


def _touch(record: Record, what: str) -> Record:
    if what == "key":
        _ = record.key
    elif what == "value":
        _ = record.value
    elif what == "headers":
        _ = record.headers
    elif what == "with_value":
        return record.with_value(b"new")
    elif what == "with_key":
        return record.with_key(None)
    elif what == "with_header":
        return record.with_header("added", b"x")
    elif what == "with_headers":
        return record.with_headers(())
    elif what == "with_timestamp":
        return record.with_timestamp(record.timestamp + 1)
    return record


TOUCHES = st.sampled_from(("none", "key", "value", "headers", "with_value", "with_key",
                           "with_header", "with_headers", "with_timestamp"))


def _eager(record: Record) -> Record:
    """The same record built from its values (no block behind it)."""
    return Record(key=record.key, value=record.value, headers=record.headers,
                  timestamp=record.timestamp, offset_delta=record.offset_delta)


@settings(max_examples=300, deadline=None)
@given(recs=records(), data=st.data())
def test_lazy_records_encode_like_records_built_from_their_values(
        recs: tuple[Record, ...], data: st.DataObject) -> None:
    decoded = _decoded(recs)
    touched = tuple(_touch(r, data.draw(TOUCHES)) for r in decoded)
    # Encode before anything else reads the fields: untouched ones come from the block.
    lazy_block = encode_records(touched, BASE_TS, True)
    assert lazy_block == encode_records(tuple(_eager(r) for r in touched), BASE_TS, True)


@settings(max_examples=200, deadline=None)
@given(recs=records())
def test_decoded_records_equal_hash_and_pickle_like_the_originals(
        recs: tuple[Record, ...]) -> None:
    decoded = _decoded(recs)
    assert decoded == recs
    assert [hash(r) for r in _decoded(recs)] == [hash(r) for r in recs]
    assert pickle.loads(pickle.dumps(_decoded(recs))) == recs
    assert [repr(r) for r in _decoded(recs)] == [repr(r) for r in recs]


@settings(max_examples=500, deadline=None)
@given(key=st.binary(max_size=12))
def test_header_keys_are_read_as_text_and_written_back_as_the_same_bytes(key: bytes) -> None:
    """Brokers store a header key whatever its bytes: UTF-8 is read as Python decodes
    it, anything else as lone surrogates standing for the bytes (``surrogateescape``),
    and a record rebuilt from what was read is written back byte for byte."""
    body = b"\x00\x00\x00\x01\x01\x02" + bytes([len(key) << 1]) + key + b"\x01"
    block = bytes([len(body) << 1]) + body
    (record,) = decode_records(block, 0, len(block), 1, 0)
    assert record.headers == (Header(key.decode("utf-8", "surrogateescape"), None),)
    rebuilt = Record(key=record.key, value=record.value, timestamp=record.timestamp,
                     headers=tuple(Header(h.key, h.value) for h in record.headers))
    assert encode_records((rebuilt,), 0, False)[0] == block


@pytest.mark.parametrize("key", [b"\xed\xa0\x80", b"\xc0\xaf", b"\xf4\x90\x80\x80",
                                 b"\xe0\x80\xaf", b"\xf0\x80\x80\xaf", b"\xff", b"\xc3"])
def test_surrogates_overlongs_and_truncations_in_a_key_are_kept_as_bytes(key: bytes) -> None:
    body = b"\x00\x00\x00\x01\x01\x02" + bytes([len(key) << 1]) + key + b"\x01"
    block = bytes([len(body) << 1]) + body
    (record,) = decode_records(block, 0, len(block), 1, 0)
    (header,) = record.headers
    assert all(0xDC80 <= ord(ch) <= 0xDCFF for ch in header.key)
    assert header.key.encode("utf-8", "surrogateescape") == key


def test_a_key_with_a_surrogate_that_stands_for_no_byte_is_not_encodable() -> None:
    with pytest.raises(UnicodeEncodeError):
        encode_records((Record(key=None, value=b"v", headers=(Header("\ud800", b"x"),)),),
                       0, False)


def test_a_record_read_in_full_lets_go_of_its_block() -> None:
    import sys

    block, _ = encode_records((Record(key=b"k", value=b"v", headers=(Header("h", b"1"),)),),
                              0, True)
    (record,) = decode_records(block, 0, len(block), 1, 0)
    held = sys.getrefcount(block)
    _ = record.key, record.value, record.headers
    assert sys.getrefcount(block) == held - 1


@settings(max_examples=300, deadline=None)
@given(recs=records(), keys=st.booleans(), lazy=st.booleans())
def test_upper_values_is_bytes_upper_of_every_value(recs: tuple[Record, ...], keys: bool,
                                                    lazy: bool) -> None:
    source = _decoded(recs) if lazy else recs
    out = upper_values(source, keys)
    expected = tuple(
        r.with_value(None if r.value is None else r.value.upper())
        .with_key(r.key.upper() if keys and r.key is not None else r.key) for r in recs)
    assert out == expected
    assert (out is source) == (expected == recs)  # nothing to change: the same tuple
    assert encode_records(out, BASE_TS, True) == encode_records(expected, BASE_TS, True)


@settings(max_examples=300, deadline=None)
@given(recs=records(), data=st.data())
def test_equality_of_unbuilt_fields_is_equality_of_their_values(
        recs: tuple[Record, ...], data: st.DataObject) -> None:
    decoded = [_touch(r, data.draw(TOUCHES)).with_offset_delta(0) for r in _decoded(recs)]
    copies = [r.with_timestamp(r.timestamp) for r in decoded]  # same spans, nothing built
    for i, a in enumerate(decoded):
        assert a == copies[i]
        for b in copies:
            assert (a == b) == (_eager(a) == _eager(b))
