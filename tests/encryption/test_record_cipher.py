"""``RecordCipher``: a batch's records sealed and opened as the hooks will call it -
count, order and plaintext records kept, tombstones left alone, a batch split across
data keys, a record already marked refused."""

from __future__ import annotations

import asyncio
import os

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kiproxy.interceptors import Record
from kiproxy.interceptors.builtin.record_encryption import (
    MARKER_HEADER,
    DataKeyCache,
    DataKeyPolicy,
    EnvelopeError,
    KeyFileKms,
    RecordCipher,
)
from kiproxy.interceptors.builtin.record_encryption.envelope import read_descriptor
from kiproxy.interceptors.builtin.record_encryption.key_file import write_key_file


@pytest.fixture(scope="module")
def kms(tmp_path_factory: pytest.TempPathFactory) -> KeyFileKms:
    path = tmp_path_factory.mktemp("keys") / "keys.yaml"
    write_key_file(path, {"KEK": (1, {1: os.urandom(32)})})
    return KeyFileKms(path)


records = st.lists(st.builds(
    Record, key=st.none() | st.binary(max_size=8), value=st.none() | st.binary(max_size=64),
    headers=st.lists(st.tuples(st.sampled_from(["user", "trace"]),
                               st.none() | st.binary(max_size=8)), max_size=3),
    offset_delta=st.integers(0, 100)), max_size=20)


@settings(suppress_health_check=[HealthCheck.function_scoped_fixture], max_examples=50)
@given(records, records, st.integers(1, 7))
def test_a_batch_of_sealed_and_plaintext_records_opens_to_the_original(
        kms: KeyFileKms, sealed_part: list[Record], plain_part: list[Record],
        limit: int) -> None:
    async def run() -> None:
        writer = RecordCipher(DataKeyCache(kms, DataKeyPolicy(max_encryptions_per_key=limit)))
        sealed = await writer.encrypt("orders", sealed_part, key_reference="KEK",
                                      header_names={"user"})
        assert len(sealed) == len(sealed_part)
        keys: dict[bytes, int] = {}
        for record in sealed:
            parsed = read_descriptor(record, topic="orders")
            if parsed is not None:
                keys[parsed[0].wrapped_key] = keys.get(parsed[0].wrapped_key, 0) + (
                    record.value is not None) + sum(
                    1 for h in record.headers if h.key == "user" and h.value is not None)
        assert all(uses <= limit for uses in keys.values())  # no data key sealed more
        mixed = sealed + tuple(plain_part)
        reader = RecordCipher(DataKeyCache(kms))
        assert await reader.decrypt("orders", mixed) == tuple(sealed_part + plain_part)

    if any(sum(1 for h in r.headers if h.key == "user" and h.value is not None)
           + (r.value is not None) > limit for r in sealed_part):
        with pytest.raises(EnvelopeError, match="max_encryptions_per_key"):
            asyncio.run(run())
    else:
        asyncio.run(run())


async def test_a_tombstone_without_chosen_headers_is_left_as_it_is(kms: KeyFileKms) -> None:
    tombstone = Record(key=b"gone", value=None, headers=[("trace", b"t")])
    cipher = RecordCipher(DataKeyCache(kms))
    assert await cipher.encrypt("orders", [tombstone], key_reference="KEK",
                                header_names={"user"}) == (tombstone,)


async def test_a_record_already_marked_is_refused_with_its_offset_delta(kms: KeyFileKms) -> None:
    cipher = RecordCipher(DataKeyCache(kms))
    forged = Record(value=None, headers=[(MARKER_HEADER, b"\x01")], offset_delta=3)
    with pytest.raises(EnvelopeError, match="offset delta 3: it already carries"):
        await cipher.encrypt("orders", [Record(value=b"v"), forged], key_reference="KEK")
    sealed = await cipher.encrypt("orders", [Record(value=b"v", offset_delta=7)],
                                  key_reference="KEK")
    with pytest.raises(EnvelopeError, match="offset delta 7: topic 'other'"):
        await cipher.decrypt("other", sealed)
