"""The compiled per-record loops under record encryption: ``seal_values`` and
``open_values``, with the cipher given as ``cryptography``'s AES-GCM (a Python call per
value) and as the codec's own ``AesGcm`` bound to OpenSSL (the whole run without the
GIL), the object itself or its bound methods: the same records come out either way.

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

from kiproxy.interceptors.sealing import AesGcm, aes_gcm, compiled_gcm
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
KEY = AESGCM.generate_key(bit_length=256)
AEAD = AESGCM(KEY)
GCM = aes_gcm(KEY)
CIPHERS = {  # (encrypt, decrypt) as handed to the loops
    "cryptography": (AEAD.encrypt, AEAD.decrypt),
    "openssl": (GCM, GCM),
    "openssl methods": (GCM.encrypt, GCM.decrypt),
}


def _records() -> tuple[Record, ...]:
    return (Record(key=b"k0", value=b"first", headers=[Header("h", b"1")], timestamp=5),
            Record(key=None, value=None, timestamp=6, offset_delta=1),
            Record(key=b"k2", value=b"", headers=[Header("h", None), Header("a", b"2")],
                   timestamp=7, offset_delta=2))


def _seal(records: tuple[Record, ...], cipher: str = "cryptography") -> tuple[Record, ...]:
    return seal_values(records, CIPHERS[cipher][0], AAD, Header(MARKER, DESCRIPTOR),
                       os.urandom(12 * len(records)), 12)


def _open(records: tuple[Record, ...], descriptor: bytes = DESCRIPTOR,
          cipher: str = "cryptography") -> Any:
    return open_values(records, MARKER, descriptor, CIPHERS[cipher][1], AAD, 12, 16)


def _flipped(data: bytes) -> bytes:
    """``data`` with one bit of its last byte changed (a changed tag, whatever it was)."""
    return data[:-1] + bytes((data[-1] ^ 1,))


def test_the_codec_binds_openssl_here() -> None:
    # Linux with CPython's own OpenSSL: the compiled cipher is what the built-in uses
    assert compiled_gcm() is not None and "libcrypto" in str(compiled_gcm())
    assert type(GCM) is AesGcm


@pytest.mark.parametrize("cipher", CIPHERS)
def test_sealed_values_open_to_what_went_in_and_a_null_value_is_kept(cipher: str) -> None:
    records = _records()
    sealed = _seal(records, cipher)
    assert sealed[1] is records[1]
    for before, after in ((records[0], sealed[0]), (records[2], sealed[2])):
        assert after.value != before.value and len(after.value or b"") == \
            len(before.value or b"") + 12 + 16
        assert after.headers == (*before.headers, Header(MARKER, DESCRIPTOR))
        assert (after.key, after.timestamp, after.offset_delta) == (
            before.key, before.timestamp, before.offset_delta)
    values = (sealed[0], sealed[2])
    for opener in CIPHERS:  # what one sealed, every other opens
        assert _open(values, cipher=opener) == (records[0], records[2])


@pytest.mark.parametrize("cipher", CIPHERS)
def test_records_decoded_lazily_from_a_batch_seal_and_open(cipher: str) -> None:
    records = tuple(Record(key=b"k%d" % i, value=b"v" * i, headers=[Header("x", b"y")],
                           timestamp=100 + i, offset_delta=i) for i in range(19))
    decoded = decode_batch(build_batch(records)).records
    stored = decode_batch(build_batch(_seal(decoded, cipher))).records
    assert _open(stored, cipher=cipher) == records
    assert _open(stored, cipher="cryptography") == records


@pytest.mark.parametrize("case", ["no marker", "other descriptor", "marker twice",
                                  "marker not last", "null value", "short value",
                                  "tampered", "not a record"])
@pytest.mark.parametrize("cipher", CIPHERS)
def test_anything_but_the_one_shape_is_left_to_the_general_path(case: str,
                                                                cipher: str) -> None:
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
        "tampered": sealed.with_value(_flipped(sealed.value or b"")),
        "not a record": "a string",
    }[case]
    assert _open((sealed, bad), cipher=cipher) is None  # type: ignore[arg-type]
    assert _open((bad, sealed), cipher=cipher) is None  # type: ignore[arg-type]
    assert _open((sealed,), cipher=cipher) is not None


def test_seal_values_wants_a_nonce_per_record() -> None:
    with pytest.raises(ValueError, match="nonce bytes for 3 records"):
        seal_values(_records(), AEAD.encrypt, AAD, Header(MARKER, DESCRIPTOR), b"x" * 12, 12)


@pytest.mark.parametrize("key_bits", [128, 192, 256])
@pytest.mark.parametrize("nonce_bytes", [12, 8, 16])
def test_aes_gcm_gives_the_bytes_cryptography_gives(key_bits: int, nonce_bytes: int) -> None:
    key = AESGCM.generate_key(bit_length=key_bits)
    ours, theirs = aes_gcm(key), AESGCM(key)
    for size in (0, 1, 15, 16, 17, 1024, 70_001):
        nonce, data, aad = os.urandom(nonce_bytes), os.urandom(size), os.urandom(size % 40)
        sealed = theirs.encrypt(nonce, data, aad)
        assert ours.encrypt(nonce, data, aad) == sealed
        assert ours.decrypt(nonce, sealed, aad) == data
        assert ours.decrypt(nonce, bytearray(sealed), memoryview(aad)) == data
        for bad_nonce, bad_sealed, bad_aad in ((nonce, sealed, aad + b"x"),
                                               (nonce, _flipped(sealed), aad),
                                               (os.urandom(nonce_bytes), sealed, aad)):
            with pytest.raises(ValueError, match="does not open"):
                ours.decrypt(bad_nonce, bad_sealed, bad_aad)


def test_aes_gcm_refuses_a_bad_key_a_bad_nonce_and_a_cut_tag() -> None:
    with pytest.raises(ValueError, match="16, 24 or 32 bytes, not 31"):
        aes_gcm(b"k" * 31)
    with pytest.raises(ValueError, match="nonce of 0 bytes"):
        GCM.encrypt(b"", b"data", None)
    with pytest.raises(ValueError, match="shorter than a tag"):
        GCM.decrypt(b"n" * 12, b"x" * 15, None)
    assert "256-bit" in repr(GCM) and KEY.hex() not in repr(GCM)


def test_without_openssl_aes_gcm_is_cryptographys(monkeypatch: pytest.MonkeyPatch) -> None:
    import kiproxy.interceptors.sealing as sealing

    monkeypatch.setattr(sealing, "compiled_gcm", lambda: None)
    assert type(sealing.aes_gcm(KEY)) is AESGCM


def test_one_key_opens_batches_on_several_threads_at_once() -> None:
    # the loops run without the GIL, each with a cipher context of its own
    from concurrent.futures import ThreadPoolExecutor

    batches = [tuple(Record(key=b"%d" % t, value=os.urandom(100 + i), offset_delta=i)
                     for i in range(200)) for t in range(8)]
    sealed = [_seal(b, "openssl") for b in batches]
    with ThreadPoolExecutor(4) as pool:
        for _ in range(5):
            opened = list(pool.map(lambda s: _open(s, cipher="openssl"), sealed))
            assert opened == batches


def test_carries_header_reads_lazy_and_built_headers() -> None:
    from kiproxy.interceptors.sealing import carries_header

    plain = tuple(Record(value=b"v", headers=[Header("a", b"1"), Header("kiproxy.e", None)],
                         offset_delta=i) for i in range(3))
    marked = _seal(plain[:1])
    for records, expected in ((plain, False), ((*plain, *marked), True), ((), False)):
        lazy = decode_batch(build_batch(records)).records if records else ()
        assert carries_header(records, MARKER) is expected
        assert carries_header(lazy, MARKER) is expected
        assert all(r.headers for r in lazy)  # and, built now, read the same way
        assert carries_header(lazy, MARKER) is expected
    assert carries_header(plain, "kiproxy.e") and not carries_header(plain, "kiproxy")


def test_first_moved_names_the_first_record_whose_offset_or_timestamp_changed() -> None:
    from kiproxy.protocol.records import first_moved

    records = tuple(Record(value=b"v", timestamp=10 + i, offset_delta=i) for i in range(4))
    assert first_moved(records, tuple(r.with_value(b"w") for r in records)) == -1
    assert first_moved(records, [*records[:2], records[3], records[2]]) == 2
    assert first_moved(records, (*records[:3], records[3].with_timestamp(0))) == 3
    with pytest.raises(ValueError, match="3 records returned for 4"):
        first_moved(records, records[:3])


def test_values_present_counts_non_null_values_lazy_or_built() -> None:
    from kiproxy.interceptors.sealing import values_present

    records = (Record(value=b"a"), Record(value=None, offset_delta=1),
               Record(value=b"", offset_delta=2), Record(key=b"k", offset_delta=3))
    lazy = decode_batch(build_batch(records)).records
    assert values_present(records) == values_present(lazy) == 2
    assert [r.value for r in lazy] == [b"a", None, b"", None]  # built now: the same count
    assert values_present(lazy) == 2 and values_present(()) == 0


def test_a_library_that_fails_the_known_answer_is_not_used(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import kiproxy.interceptors.sealing as sealing

    key, nonce, plain, aad, sealed = sealing._KAT
    assert AESGCM(key).encrypt(nonce, plain, aad) == sealed  # the vector is right
    monkeypatch.setattr(sealing, "_KAT", (key, nonce, plain, aad, _flipped(sealed)))
    sealing.compiled_gcm.cache_clear()
    try:
        assert sealing.compiled_gcm() is None
        assert type(sealing.aes_gcm(KEY)) is AESGCM
    finally:
        monkeypatch.undo()
        sealing.compiled_gcm.cache_clear()
    assert sealing.compiled_gcm() is not None


def _cpu_runs_libsodium_gcm() -> bool:
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as info:
            flags = next((line.split() for line in info if line.startswith("flags")), [])
    except OSError:
        return False
    return "aes" in flags and "pclmulqdq" in flags


@pytest.mark.skipif(not _cpu_runs_libsodium_gcm(), reason="no AES-NI and PCLMULQDQ here")
def test_256_bit_keys_with_12_byte_nonces_run_through_libsodium_where_the_cpu_can() -> None:
    pytest.importorskip("nacl")  # the encryption extra brings PyNaCl
    from kiproxy.interceptors.sealing import sodium_gcm

    assert (sodium_gcm() or "").endswith(".so") and "nacl" in (sodium_gcm() or "")


def _fresh(script: str) -> list[str]:
    """What ``script`` prints, run in an interpreter of its own (nothing bound yet)."""
    import subprocess
    import sys

    return subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          check=True).stdout.splitlines()


def test_without_pynacl_openssl_seals_and_opens_every_key() -> None:
    out = _fresh("""
import sys
sys.modules["nacl"] = None  # as if PyNaCl were not installed
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from kiproxy.interceptors.sealing import aes_gcm, compiled_gcm, sodium_gcm
key = AESGCM.generate_key(bit_length=256)
sealed = AESGCM(key).encrypt(b"n" * 12, b"value" * 200, b"aad")
ours = aes_gcm(key)
print(compiled_gcm() is not None, sodium_gcm())
print(ours.encrypt(b"n" * 12, b"value" * 200, b"aad") == sealed,
      ours.decrypt(b"n" * 12, sealed, b"aad") == b"value" * 200)
""")
    assert out == ["True None", "True True"]


def test_a_libsodium_that_fails_the_known_answer_is_not_bound() -> None:
    out = _fresh("""
import nacl._sodium
from kiproxy.interceptors import sealing
from kiproxy.protocol._codec import load_sodium, sodium_bound
key, nonce, plain, aad, sealed = sealing._KAT
wrong = sealed[:-1] + bytes([sealed[-1] ^ 1])
try:
    load_sodium(nacl._sodium.__file__, (key, nonce, plain, aad, wrong))
except OSError as exc:
    print(exc)
print(sodium_bound())
""")
    assert out[0].endswith("does not give the known answer") and out[1] == "False"


def test_openssl_is_looked_for_on_linux_only(monkeypatch: pytest.MonkeyPatch) -> None:
    import kiproxy.interceptors.sealing as sealing

    assert sealing._libcrypto() == compiled_gcm()  # here: the one Python's hashlib loaded
    monkeypatch.setattr(sealing.sys, "platform", "darwin")
    assert sealing._libcrypto() is None
