"""The compiled per-record loops under record encryption: ``seal_values`` and
``open_values`` (the cipher is the caller's; here AES-GCM from ``cryptography``).

Sealed records open back to exactly what went in (keys, headers, timestamps, offset
deltas; a null value kept); records decoded lazily from a batch work the same; and
``open_values`` answers None - so the caller's general path names the record - for
every record that is not of the one shape it opens or does not open.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from kiproxy.protocol.records import (
    Header,
    Record,
    build_batch,
    decode_batch,
    open_values,
    seal_values,
)

MARKER = "kiproxy.encryption"
DESCRIPTOR = b"\x01\x01descriptor"
AAD = b"associated"
AEAD = AESGCM(AESGCM.generate_key(bit_length=256))


def _records() -> tuple[Record, ...]:
    return (Record(key=b"k0", value=b"first", headers=[Header("h", b"1")], timestamp=5),
            Record(key=None, value=None, timestamp=6, offset_delta=1),
            Record(key=b"k2", value=b"", headers=[Header("h", None), Header("a", b"2")],
                   timestamp=7, offset_delta=2))


def _seal(records: tuple[Record, ...]) -> tuple[Record, ...]:
    return seal_values(records, AEAD.encrypt, AAD, Header(MARKER, DESCRIPTOR),
                       os.urandom(12 * len(records)), 12)


def _open(records: tuple[Record, ...], descriptor: bytes = DESCRIPTOR) -> Any:
    return open_values(records, MARKER, descriptor, AEAD.decrypt, AAD, 12, 16)


def test_sealed_values_open_to_what_went_in_and_a_null_value_is_kept() -> None:
    records = _records()
    sealed = _seal(records)
    assert sealed[1] is records[1]
    for before, after in ((records[0], sealed[0]), (records[2], sealed[2])):
        assert after.value != before.value and len(after.value or b"") == \
            len(before.value or b"") + 12 + 16
        assert after.headers == (*before.headers, Header(MARKER, DESCRIPTOR))
        assert (after.key, after.timestamp, after.offset_delta) == (
            before.key, before.timestamp, before.offset_delta)
    values = (sealed[0], sealed[2])
    assert _open(values) == (records[0], records[2])


def test_records_decoded_lazily_from_a_batch_seal_and_open() -> None:
    records = tuple(Record(key=b"k%d" % i, value=b"v" * i, headers=[Header("x", b"y")],
                           timestamp=100 + i, offset_delta=i) for i in range(19))
    decoded = decode_batch(build_batch(records)).records
    stored = decode_batch(build_batch(_seal(decoded))).records
    assert _open(stored) == records


@pytest.mark.parametrize("case", ["no marker", "other descriptor", "marker twice",
                                  "marker not last", "null value", "short value",
                                  "tampered", "not a record"])
def test_anything_but_the_one_shape_is_left_to_the_general_path(case: str) -> None:
    sealed = _seal((_records()[0],))[0]
    marker = Header(MARKER, DESCRIPTOR)
    bad: object = {
        "no marker": sealed.with_headers(sealed.headers[:-1]),
        "other descriptor": sealed.with_headers((*sealed.headers[:-1],
                                                 Header(MARKER, b"other"))),
        "marker twice": sealed.with_headers((marker, *sealed.headers)),
        "marker not last": sealed.with_headers((marker, Header("h", b"1"))),
        "null value": sealed.with_value(None),
        "short value": sealed.with_value(b"x" * 27),
        "tampered": sealed.with_value((sealed.value or b"")[:-1] + b"\x00"),
        "not a record": "a string",
    }[case]
    assert _open((sealed, bad)) is None  # type: ignore[arg-type]
    assert _open((sealed,)) is not None


def test_seal_values_wants_a_nonce_per_record() -> None:
    with pytest.raises(ValueError, match="nonce bytes for 3 records"):
        seal_values(_records(), AEAD.encrypt, AAD, Header(MARKER, DESCRIPTOR), b"x" * 12, 12)
