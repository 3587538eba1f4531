"""The envelope: sealed records open to the originals (property tests), plaintext and
tombstones pass, and a changed byte, a value moved to another topic or to another
field, a cut or unknown-version marker never opens."""

from __future__ import annotations

import pytest
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from hypothesis import given
from hypothesis import strategies as st
from hypothesis.strategies import DrawFn, composite

from kiproxy.interceptors import Header, Record
from kiproxy.interceptors.builtin.record_encryption import MARKER_HEADER, EnvelopeError
from kiproxy.interceptors.builtin.record_encryption.envelope import (
    open_record,
    read_descriptor,
    seal_record,
    sealed_fields,
)

AEAD = AESGCM(bytes(range(32)))
KEY_ID = "arn:aws:kms:eu-west-1:123456789012:key/1234abcd"
WRAPPED = b"\x01\x02wrapped data key" * 8
NAMES = ("trace", "user", "tenant", "ü-ñame")


def seal(record: Record, topic: str = "orders", headers: tuple[str, ...] = ()) -> Record:
    return seal_record(record, topic=topic, aead=AEAD, key_id=KEY_ID, wrapped_key=WRAPPED,
                       header_names=headers)


def unseal(record: Record, topic: str = "orders") -> Record:
    parsed = read_descriptor(record, topic=topic)
    if parsed is None:
        return record
    return open_record(record, topic=topic, descriptor=parsed[0], raw_descriptor=parsed[1],
                       aead=AEAD)


@composite
def records(draw: DrawFn) -> Record:
    return Record(
        key=draw(st.none() | st.binary(max_size=20)),
        value=draw(st.none() | st.binary(max_size=300)),
        headers=draw(st.lists(st.tuples(st.sampled_from(NAMES) | st.text(max_size=8),
                                        st.none() | st.binary(max_size=40)), max_size=6)),
        timestamp=draw(st.integers(0, 2**40)),
        offset_delta=draw(st.integers(0, 1000)))


@given(records(), st.sets(st.sampled_from(NAMES)), st.text(min_size=1, max_size=30))
def test_a_sealed_record_opens_to_the_original(record: Record, names: set[str],
                                               topic: str) -> None:
    sealed = seal(record, topic, tuple(names))
    assert unseal(sealed, topic) == record
    assert (sealed.key, sealed.timestamp, sealed.offset_delta) == (
        record.key, record.timestamp, record.offset_delta)
    assert (sealed.value is None) == (record.value is None)  # a tombstone stays one
    assert sealed.headers[-1].key == MARKER_HEADER
    plain = [h for h in record.headers if h.key not in names or h.value is None]
    assert [h for h in sealed.headers[:-1] if h.key not in names or h.value is None] == plain
    assert sealed_fields(record, names) == sum(
        1 for h in record.headers if h.key in names and h.value is not None) + (
        record.value is not None)


@given(records())
def test_a_record_without_the_marker_passes_unchanged(record: Record) -> None:
    assert unseal(record) is record


def test_a_plaintext_value_shaped_like_a_sealed_one_still_passes_unchanged() -> None:
    sealed = seal(Record(value=b"secret"))
    looks_sealed = Record(value=sealed.value, headers=[("other", b"x")])
    assert unseal(looks_sealed) is looks_sealed


def test_a_tombstone_stays_a_tombstone_and_its_chosen_headers_are_sealed() -> None:
    record = Record(key=b"k", value=None, headers=[("user", b"alice"), ("user", None)])
    sealed = seal(record, headers=("user",))
    assert sealed.value is None
    assert sealed.headers[0].value != b"alice" and sealed.headers[1].value is None
    assert unseal(sealed) == record


def _flipped(data: bytes, i: int) -> bytes:
    changed = bytearray(data)
    changed[i] ^= 0x01
    return bytes(changed)


def test_every_flipped_byte_of_the_value_or_the_marker_fails_to_open() -> None:
    record = Record(key=b"k", value=b"card 4111 1111 1111 1111", headers=[("user", b"alice")])
    sealed = seal(record, headers=("user",))
    assert sealed.value is not None
    for i in range(len(sealed.value)):
        with pytest.raises(EnvelopeError, match="does not open"):
            unseal(sealed.with_value(_flipped(sealed.value, i)))
    marker = sealed.headers[-1].value
    assert marker is not None
    for i in range(len(marker)):
        changed = sealed.with_headers([*sealed.headers[:-1],
                                       Header(MARKER_HEADER, _flipped(marker, i))])
        with pytest.raises(EnvelopeError):
            unseal(changed)


def test_a_value_moved_to_another_topic_or_field_fails_to_open() -> None:
    sealed = seal(Record(value=b"v", headers=[("user", b"alice"), ("trace", b"t")]),
                  headers=("user", "trace"))
    with pytest.raises(EnvelopeError, match="another topic"):
        unseal(sealed, topic="orders-copy")
    user, trace = sealed.headers[0].value, sealed.headers[1].value
    swapped = sealed.with_headers([Header("user", trace), Header("trace", user),
                                   sealed.headers[2]])
    with pytest.raises(EnvelopeError, match="header 'user'"):
        unseal(swapped)
    with pytest.raises(EnvelopeError, match="value"):
        unseal(sealed.with_value(user))


def test_a_sealed_field_removed_or_a_value_added_to_a_tombstone_fails() -> None:
    sealed = seal(Record(value=b"v", headers=[("user", b"alice")]), headers=("user",))
    with pytest.raises(EnvelopeError, match="missing"):
        unseal(sealed.with_headers(sealed.headers[1:]))
    with pytest.raises(EnvelopeError, match="null"):
        unseal(sealed.with_value(None))
    tombstone = seal(Record(value=None, headers=[("user", b"alice")]), headers=("user",))
    with pytest.raises(EnvelopeError, match="set"):
        unseal(tombstone.with_value(b"plaintext slipped in"))


def test_an_unknown_version_a_cut_marker_or_two_markers_are_named() -> None:
    sealed = seal(Record(value=b"v"))
    marker = sealed.headers[-1].value
    assert marker is not None and marker[0] == 1
    for changed, why in [(b"\x02" + marker[1:], "format version 2"),
                         (marker[:-1], "cut or damaged"), (marker + b"\x00", "cut or damaged"),
                         (b"", "is empty: cut or damaged"),
                         (b"junk", "format version 106, which this kiproxy .* does not read: "
                                   "the header is damaged, or the record was sealed by a newer"),
                         (b"\x00" + marker[1:], "format version 0, which this kiproxy .* does "
                                                 "not read: the header is damaged$")]:
        with pytest.raises(EnvelopeError, match=why):
            unseal(sealed.with_headers([Header(MARKER_HEADER, changed)]))
    with pytest.raises(EnvelopeError, match="twice"):
        unseal(sealed.with_headers([*sealed.headers, *sealed.headers]))


def test_a_record_carrying_the_marker_is_not_sealed_again() -> None:
    with pytest.raises(EnvelopeError, match="already carries"):
        seal(seal(Record(value=b"v")))
    with pytest.raises(EnvelopeError, match="already carries"):
        seal(Record(value=b"plaintext", headers=[(MARKER_HEADER, b"\x01forged")]))


def test_the_layout_is_the_documented_one() -> None:
    sealed = seal(Record(value=b"hello", headers=[("user", b"alice")]), headers=("user",))
    marker = sealed.headers[-1].value
    kid = KEY_ID.encode()
    assert marker == (b"\x01\x01" + len(kid).to_bytes(2, "big") + kid
                      + len(WRAPPED).to_bytes(2, "big") + WRAPPED
                      + b"\x01" + b"\x00\x04user")
    assert sealed.value is not None and len(sealed.value) == 12 + len(b"hello") + 16
    again = seal(Record(value=b"hello")).value
    assert again is not None and sealed.value[:12] != again[:12]  # a fresh nonce each time


def test_a_marker_over_8_kib_is_refused_both_ways() -> None:
    names = tuple(f"h{i:03d}-" + "x" * 60 for i in range(200))
    with pytest.raises(EnvelopeError, match="over 8192"):
        seal(Record(value=b"v", headers=[(n, b"v") for n in names]), headers=names)
    with pytest.raises(EnvelopeError, match="over 8192"):
        unseal(Record(value=b"v", headers=[(MARKER_HEADER, b"\x01" * 8193)]))
