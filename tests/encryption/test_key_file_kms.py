"""The key file provider: data keys wrapped under named, versioned KEKs; a rotated KEK
still unwraps its old data keys; unknown names, removed versions, changed bytes and
malformed files are named."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from kiproxy.interceptors import Record
from kiproxy.interceptors.builtin.record_encryption import (
    DataKeyCache,
    KeyFileKms,
    RecordCipher,
    Undecryptable,
    UnresolvedKey,
)
from kiproxy.interceptors.builtin.record_encryption.key_file import write_key_file

V1, V2 = os.urandom(32), os.urandom(32)


@pytest.fixture(params=["keys.yaml", "keys.json"])
def key_file(request: pytest.FixtureRequest, tmp_path: Path) -> Path:
    path = tmp_path / request.param
    write_key_file(path, {"KEK_orders": (1, {1: V1}), "KEK_payments": (1, {1: V2})})
    return path


async def test_records_sealed_before_and_after_a_kek_rotation_open(key_file: Path) -> None:
    records = [Record(key=b"%d" % i, value=b"v%d" % i, headers=[("user", b"u%d" % i)])
               for i in range(10)]
    before = await RecordCipher(DataKeyCache(KeyFileKms(key_file))).encrypt(
        "orders", records[:5], key_reference="KEK_orders", header_names={"user"})
    write_key_file(key_file, {"KEK_orders": (2, {1: V1, 2: V2})})
    kms = KeyFileKms(key_file)
    after = await RecordCipher(DataKeyCache(kms)).encrypt(
        "orders", records[5:], key_reference="KEK_orders", header_names={"user"})
    assert before[0].headers[-1].value != after[0].headers[-1].value
    assert await RecordCipher(DataKeyCache(kms)).decrypt("orders", before + after) == tuple(
        records)


async def test_unknown_names_removed_versions_and_changed_wrapped_keys(key_file: Path) -> None:
    kms = KeyFileKms(key_file)
    with pytest.raises(UnresolvedKey, match="no key 'KEK_nobody'"):
        await kms.resolve_key("KEK_nobody")
    key = await kms.generate_data_key("KEK_orders")
    assert await kms.decrypt_data_key("KEK_orders", key.wrapped) == key.plaintext
    assert repr(key.plaintext) not in repr(key)
    with pytest.raises(Undecryptable, match="another key"):
        await kms.decrypt_data_key("KEK_payments", key.wrapped)
    changed = bytearray(key.wrapped)
    changed[-1] ^= 1
    with pytest.raises(Undecryptable, match="damaged"):
        await kms.decrypt_data_key("KEK_orders", bytes(changed))
    with pytest.raises(Undecryptable, match="64 bytes"):
        await kms.decrypt_data_key("KEK_orders", key.wrapped[:-1])

    write_key_file(key_file, {"KEK_orders": (2, {2: V2})})
    with pytest.raises(Undecryptable, match="no version 1"):
        await KeyFileKms(key_file).decrypt_data_key("KEK_orders", key.wrapped)
    write_key_file(key_file, {"KEK_payments": (1, {1: V1})})
    with pytest.raises(Undecryptable, match="no key 'KEK_orders'"):
        await KeyFileKms(key_file).decrypt_data_key("KEK_orders", key.wrapped)


async def test_a_record_whose_wrapped_key_was_changed_does_not_open(key_file: Path) -> None:
    cipher = RecordCipher(DataKeyCache(KeyFileKms(key_file)))
    sealed = (await cipher.encrypt("orders", [Record(value=b"v")],
                                   key_reference="KEK_orders"))[0]
    marker = sealed.headers[-1]
    assert marker.value is not None
    changed = bytearray(marker.value)
    changed[-2] ^= 1  # inside the wrapped key (the last byte is the header count)
    fresh = RecordCipher(DataKeyCache(KeyFileKms(key_file)))
    with pytest.raises(Undecryptable):
        await fresh.decrypt("orders", [sealed.with_headers([(marker.key, bytes(changed))])])


@pytest.mark.parametrize(("text", "why"), [
    ("keys: [", "does not parse"),
    ("other: {}", "expected a mapping with `keys:`"),
    ("keys: {K: {current: 1, versions: {1: 'c2hvcnQ='}}}", r"keys\.K\.versions\.1: .*got 5"),
    ("keys: {K: {current: 1, versions: {1: 'not base64!'}}}", r"keys\.K\.versions\.1"),
    ("keys: {K: {current: 2, versions: {1: '" + "A" * 43 + "='}}}", r"keys\.K\.current: 2"),
])
def test_a_malformed_key_file_is_named(tmp_path: Path, text: str, why: str) -> None:
    path = tmp_path / "keys.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=why):
        KeyFileKms(path)
    with pytest.raises(ValueError, match="no such file"):
        KeyFileKms(tmp_path / "missing.yaml")
