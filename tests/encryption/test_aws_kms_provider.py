"""The AWS KMS provider against moto's KMS on loopback, set up through boto3 as an AWS
user sets it up (CreateKey, CreateAlias): data keys generated, records sealed and
opened, rotation, unusable keys, and a KMS that is gone, hangs or answers garbage."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import re
import socket
import time
from collections.abc import Callable
from typing import Any

import pytest
from moto.server import ThreadedMotoServer

from encryption.conftest import REGION, CountingKms, StandIn, aws_provider
from kiproxy.interceptors import ConsumeContext, ConsumedBatch, Record, RefuseFetch
from kiproxy.interceptors.builtin.record_encryption import (
    MARKER_HEADER,
    DataKeyCache,
    DataKeyPolicy,
    KmsError,
    KmsUnavailable,
    RecordCipher,
    Undecryptable,
    UnresolvedKey,
)
from kiproxy.interceptors.builtin.record_encryption.aws_kms import AwsKmsSettings
from kiproxy.interceptors.builtin.record_encryption.envelope import read_descriptor, seal_record
from kiproxy.interceptors.sealing import aes_gcm
from kiproxy.interceptors.testing import load, make_batch, run_interceptor_async

pytestmark = pytest.mark.usefixtures("aws_env")


def _records(n: int, start: int = 0) -> list[Record]:
    return [Record(key=b"k%d" % i, value=b"order %d" % i, offset_delta=i - start)
            for i in range(start, start + n)]


def _cipher(moto_kms: str, **policy: Any) -> tuple[RecordCipher, CountingKms]:
    kms = CountingKms(aws_provider(moto_kms))
    return RecordCipher(DataKeyCache(kms, DataKeyPolicy(**policy))), kms


def _key_ids(records: tuple[Record, ...], topic: str) -> list[tuple[str, bytes]]:
    found = [read_descriptor(r, topic=topic) for r in records]
    return [(d.key_id, d.wrapped_key) for d, _ in filter(None, found)]


async def test_records_sealed_under_an_alias_open_with_a_fresh_cache(
        moto_kms: str, kek: tuple[str, str]) -> None:
    alias, arn = kek
    writer, writer_kms = _cipher(moto_kms)
    sealed: list[Record] = []
    for start in range(0, 500, 50):
        sealed += await writer.encrypt("orders", _records(50, start), key_reference=alias)
    assert writer_kms.calls == {"resolve_key": 1, "generate_data_key": 1}
    assert all(r.value is not None and b"order" not in r.value for r in sealed)
    assert {key_id for key_id, _ in _key_ids(tuple(sealed), "orders")} == {arn}

    reader, reader_kms = _cipher(moto_kms)
    opened = []
    for start in range(0, 500, 50):
        opened += await reader.decrypt("orders", sealed[start:start + 50])
    assert [(r.key, r.value) for r in opened] == [(r.key, r.value) for r in _records(500)]
    assert all(MARKER_HEADER not in (h.key for h in r.headers) for r in opened)
    assert reader_kms.calls == {"decrypt_data_key": 1}
    await writer_kms.close()
    await reader_kms.close()


async def test_rotation_by_count_makes_new_data_keys_and_old_records_still_open(
        moto_kms: str, kek: tuple[str, str]) -> None:
    writer, writer_kms = _cipher(moto_kms, max_encryptions_per_key=10)
    sealed: tuple[Record, ...] = ()
    for i in range(35):
        sealed += await writer.encrypt("orders", _records(1, i), key_reference=kek[0])
    sealed += await writer.encrypt("orders", _records(25, 35), key_reference=kek[0])
    assert writer_kms.calls["generate_data_key"] == 7  # 35 -> 4 keys, then 5 + 10 + 10
    assert len(set(_key_ids(sealed, "orders"))) == 7

    reader, reader_kms = _cipher(moto_kms)
    assert [r.value for r in await reader.decrypt("orders", sealed)] == [
        r.value for r in _records(60)]
    assert reader_kms.calls["decrypt_data_key"] == 7
    await writer_kms.close()
    await reader_kms.close()


async def test_rotation_by_age_and_a_rotated_or_repointed_kms_key(
        moto_kms: str, kek: tuple[str, str], kms_admin: Any) -> None:
    alias, arn = kek
    now = [1000.0]
    kms = CountingKms(aws_provider(moto_kms))
    writer = RecordCipher(DataKeyCache(kms, DataKeyPolicy(max_key_age_s=60),
                                       clock=lambda: now[0]))
    first = await writer.encrypt("orders", _records(2), key_reference=alias)
    now[0] += 59
    first += await writer.encrypt("orders", _records(2, 2), key_reference=alias)
    assert kms.calls["generate_data_key"] == 1
    now[0] += 2
    kms_admin.rotate_key_on_demand(KeyId=arn)  # a new version of the KMS key
    second = await writer.encrypt("orders", _records(2, 4), key_reference=alias)
    assert kms.calls["generate_data_key"] == 2

    other = kms_admin.create_key()["KeyMetadata"]
    kms_admin.update_alias(AliasName=alias, TargetKeyId=other["KeyId"])
    now[0] += 61
    third = await writer.encrypt("orders", _records(2, 6), key_reference=alias)
    assert {k for k, _ in _key_ids(third, "orders")} == {other["Arn"]}

    reader, _ = _cipher(moto_kms)
    assert [r.value for r in await reader.decrypt("orders", first + second + third)] == [
        r.value for r in _records(8)]
    await kms.close()


async def test_an_unknown_alias_is_an_unresolved_key_remembered_briefly(
        moto_kms: str) -> None:
    cipher, kms = _cipher(moto_kms, negative_ttl_s=60)
    for _ in range(3):
        with pytest.raises(UnresolvedKey, match="alias/KEK_nobody"):
            await cipher.encrypt("orders", _records(1), key_reference="alias/KEK_nobody")
    assert kms.calls == {"resolve_key": 1}
    await kms.close()


@pytest.mark.usefixtures("aws_key_states")
@pytest.mark.parametrize("retire", ["disable_key", "schedule_key_deletion"])
async def test_a_data_key_whose_kms_key_is_retired_is_undecryptable(
        moto_kms: str, kek: tuple[str, str], kms_admin: Any, retire: str) -> None:
    alias, arn = kek
    writer, _ = _cipher(moto_kms)
    sealed = await writer.encrypt("orders", _records(3), key_reference=alias)
    getattr(kms_admin, retire)(KeyId=arn.rpartition("/")[2])  # moto wants the bare id

    reader, reader_kms = _cipher(moto_kms)
    with pytest.raises(Undecryptable, match=arn) as caught:
        await reader.decrypt("orders", sealed)
    assert not caught.value.retriable
    with pytest.raises(UnresolvedKey, match=r"it is (Disabled|PendingDeletion)"
                       r"(, for ENCRYPT_DECRYPT)?; enable it") as unresolved:
        await RecordCipher(DataKeyCache(reader_kms)).encrypt("orders", _records(1),
                                                             key_reference=alias)
    assert "None" not in str(unresolved.value)  # a key usage the KMS did not give
    provider = aws_provider(moto_kms)
    with pytest.raises(UnresolvedKey, match=r"DisabledException|KMSInvalidStateException"):
        await provider.generate_data_key(arn)
    await provider.close()
    await reader_kms.close()


async def test_a_changed_wrapped_key_is_undecryptable(moto_kms: str,
                                                      kek: tuple[str, str]) -> None:
    provider = aws_provider(moto_kms)
    key = await provider.generate_data_key(await provider.resolve_key(kek[0]))
    assert await provider.decrypt_data_key(key.key_id, key.wrapped) == key.plaintext
    damaged = bytearray(key.wrapped)
    damaged[-1] ^= 0x01
    with pytest.raises(Undecryptable, match="InvalidCiphertextException"):
        await provider.decrypt_data_key(key.key_id, bytes(damaged))
    with pytest.raises(Undecryptable, match="6144"):
        await provider.decrypt_data_key(key.key_id, bytes(6145))
    await provider.close()


async def test_100_concurrent_encryptions_of_a_topic_make_one_generate_data_key(
        moto_kms: str, kek: tuple[str, str]) -> None:
    writer, writer_kms = _cipher(moto_kms)
    batches = await asyncio.gather(*(
        writer.encrypt("orders", _records(1, i), key_reference=kek[0]) for i in range(100)))
    assert writer_kms.calls == {"resolve_key": 1, "generate_data_key": 1}

    reader, reader_kms = _cipher(moto_kms)
    opened = await asyncio.gather(*(reader.decrypt("orders", b) for b in batches))
    assert reader_kms.calls == {"decrypt_data_key": 1}
    assert [b[0].value for b in opened] == [r.value for r in _records(100)]
    await writer_kms.close()
    await reader_kms.close()


async def test_credentials_and_region_come_from_a_profile_as_aws_sdks_read_them(
        moto_kms: str, kek: tuple[str, str], tmp_path: Any,
        monkeypatch: pytest.MonkeyPatch) -> None:
    config = tmp_path / "aws-config"
    config.write_text(f"[profile kiproxy]\nregion = {REGION}\n"
                      "aws_access_key_id = AKIAKIPROXYPROFILE\n"
                      "aws_secret_access_key = from-the-profile\n")
    monkeypatch.setenv("AWS_CONFIG_FILE", str(config))
    for name in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION"):
        monkeypatch.delenv(name)
    provider = aws_provider(moto_kms, profile="kiproxy")
    assert await provider.resolve_key(kek[0]) == kek[1]
    await provider.close()

    missing = aws_provider(moto_kms, profile="nobody")
    with pytest.raises(KmsError, match=r"nobody.*; kms\.profile \(or AWS_PROFILE\) names a "
                                       "profile that is in neither") as caught:
        await missing.resolve_key(kek[0])
    assert not caught.value.retriable
    await missing.close()

    # a region but no credentials: the hint is about credentials, not the region
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    anonymous = aws_provider(moto_kms, region=REGION)
    with pytest.raises(KmsError, match="Unable to locate credentials; give credentials "
                                       "as AWS SDKs read them: AWS_ACCESS_KEY_ID"):
        await anonymous.resolve_key(kek[0])
    await anonymous.close()


async def test_a_stopped_kms_is_unavailable(aws_env: None, kms_admin: Any) -> None:
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    provider = aws_provider(f"http://{host}:{port}")
    key = await provider.generate_data_key(
        await asyncio.to_thread(_make_key, f"http://{host}:{port}"))
    server.stop()
    with pytest.raises(KmsUnavailable, match="Decrypt") as caught:
        await provider.decrypt_data_key(key.key_id, key.wrapped)
    assert caught.value.retriable
    await provider.close()


def _make_key(endpoint: str) -> str:
    import boto3
    client = boto3.client("kms", endpoint_url=endpoint, region_name=REGION)
    return str(client.create_key()["KeyMetadata"]["Arn"])


Make = Callable[[Callable[[socket.socket], None] | None], StandIn]


@pytest.mark.parametrize("attempts", [1, 2])
async def test_a_kms_that_never_answers_is_unavailable_after_each_attempts_timeout(
        stand_in: Make, attempts: int) -> None:
    silent = stand_in(None)
    provider = aws_provider(silent.url, read_timeout_ms=300, max_attempts=attempts)
    with pytest.raises(KmsUnavailable, match=r"ReadTimeoutError|timeout"):
        await provider.resolve_key("alias/KEK_orders")
    assert silent.connections == attempts  # the retries set, and no more
    await provider.close()


def _answer(raw: bytes) -> Callable[[socket.socket], None]:
    return lambda conn: conn.sendall(raw)


def _http(status: str, body: bytes, content_type: bytes = b"application/x-amz-json-1.1",
          ) -> Callable[[socket.socket], None]:
    return _answer(b"HTTP/1.1 " + status.encode() + b"\r\nContent-Type: " + content_type
                   + b"\r\nContent-Length: %d\r\nConnection: close\r\n\r\n" % len(body)
                   + body)


@pytest.mark.parametrize(("answer", "cause"), [
    (_http("200 OK", b"<html>not KMS</html>", b"text/html"), "without a 32-byte key"),
    (_http("200 OK", b'{"Plaintext": "c2hvcnQ=", "CiphertextBlob": "eA==", "KeyId": "k"}'),
     "without a 32-byte key"),
    (_http("503 Service Unavailable", b"busy"), "503"),
    (_http("400 Bad Request", b'{"__type": "ThrottlingException", "message": "slow down"}'),
     "ThrottlingException"),
    (_answer(b"\x00\x01 not HTTP at all\r\n\r\n"), "Error"),
    # What the SDK cannot read at all (it raises no error of its own for these).
    (_http("200 OK", b'{"Plaintext": "abcdefghi", "KeyId": "k"}'),
     "the answer is not one of AWS KMS .*Error"),
    (_http("200 OK", b"[1, 2]"), "the answer is not one of AWS KMS .*AttributeError"),
    (_http("200 OK", b'{"Plaintext": 7, "KeyId": "k"}'), "the answer is not one of AWS KMS"),
], ids=["html", "short-key", "503", "throttled", "not-http", "bad-base64", "json-list",
        "number-blob"])
async def test_a_kms_that_answers_garbage_is_unavailable(
        stand_in: Make, answer: Callable[[socket.socket], None], cause: str) -> None:
    provider = aws_provider(stand_in(answer).url)
    with pytest.raises(KmsUnavailable, match=cause) as caught:
        await provider.decrypt_data_key("arn:aws:kms:eu-west-1:1:key/k", b"wrapped")
    assert caught.value.retriable
    await provider.close()


async def test_a_generated_data_key_of_the_wrong_size_is_named_by_its_sizes(
        stand_in: Make) -> None:
    big = base64.b64encode(b"w" * 200_000).decode()
    key = base64.b64encode(b"k" * 32).decode()
    answer = _http("200 OK", json.dumps(
        {"Plaintext": key, "CiphertextBlob": big, "KeyId": "k"}).encode())
    provider = aws_provider(stand_in(answer).url)
    with pytest.raises(KmsUnavailable, match=r"with a 32-byte Plaintext and a 200000-byte "
                                               r"CiphertextBlob \(AWS KMS gives 32 bytes"):
        await provider.generate_data_key("arn:aws:kms:eu-west-1:1:key/k")
    await provider.close()


def test_settings_name_the_key_that_is_wrong(tmp_path: Any) -> None:
    with pytest.raises(ValueError, match=r"^kms\.max_attempts"):
        AwsKmsSettings.from_config({"max_attempts": 0})
    with pytest.raises(ValueError, match=r"^kms\.regoin"):
        AwsKmsSettings.from_config({"regoin": "eu-west-1"})
    with pytest.raises(ValueError, match=r"^kms\.endpoint: '127\.0\.0\.1:4566' is not an "
                                         r"http\(s\) URL; .* e\.g\. http://127\.0\.0\.1:4566"):
        AwsKmsSettings.from_config({"endpoint": "127.0.0.1:4566"})
    for endpoint in ("http://127.0.0.1:4566", "https://kms.eu-west-1.amazonaws.com"):
        assert AwsKmsSettings.from_config({"endpoint": endpoint}).endpoint == endpoint
    with pytest.raises(ValueError, match=r"^kms\.region: 'us east 1' is not a region name"):
        AwsKmsSettings.from_config({"region": "us east 1"})
    assert AwsKmsSettings.from_config({"region": "eu-west-1"}).region == "eu-west-1"
    with pytest.raises(ValueError, match=r"^kms\.ca_bundle: no file"):
        AwsKmsSettings.from_config({"ca_bundle": str(tmp_path / "ca.pem")})
    settings = AwsKmsSettings.from_config({"connect_timeout_ms": 100, "read_timeout_ms": 200,
                                           "max_attempts": 3})
    assert settings.call_timeout_s == pytest.approx(3 * 1.3)


def _sealed_under_an_aws_key() -> Record:
    """A record sealed under a data key wrapped by an AWS KMS key (its unwrapping is a
    ``Decrypt`` call)."""
    return seal_record(Record(key=b"k", value=b"card 4111"), topic="orders",
                       aead=aes_gcm(os.urandom(32)), wrapped_key=os.urandom(184),
                       key_id="arn:aws:kms:eu-west-1:111122223333:key/k")


@pytest.mark.parametrize("on_kms_unavailable", ["reject", "pass"])
async def test_a_kms_that_hangs_past_the_batchs_deadline_gets_the_kms_policy_not_a_timeout(
        stand_in: Make, aws_env: None, on_kms_unavailable: str) -> None:
    """The SDK's bounds (2 s connect, 5 s read, 2 attempts) outlast a plugin's deadline:
    the wait ends before it, and the batch is answered by ``on_kms_unavailable``."""
    silent = stand_in(None)
    plugin = load("record_encryption", config={
        "kms": {"type": "aws", "endpoint": silent.url, "region": REGION},
        "key": "alias/KEK_${topic}", "on_kms_unavailable": on_kms_unavailable})
    try:
        started = time.monotonic()
        outcome = await run_interceptor_async(
            plugin, make_batch(records=[Record(key=b"k", value=b"card 4111")], topic="orders"),
            timeout_ms=800)
        took = time.monotonic() - started
        assert outcome.fault is None  # not the proxy's cut-off of a late plugin
        if on_kms_unavailable == "pass":
            assert outcome.kind == "unchanged"
        else:
            assert (outcome.kind, outcome.error) == ("rejected", "REQUEST_TIMED_OUT")
            assert "did not answer before the batch's deadline" in str(outcome.message)
        assert took < 5  # well before the SDK's own read timeout
        consumer = ConsumeContext(client_id="reader", client_address="127.0.0.1:50001",
                                  principal=None, api_version=16,
                                  deadline=time.monotonic() + 0.5)
        with pytest.raises(RefuseFetch, match="before the batch's deadline"):
            await plugin.interceptor.on_consume(ConsumedBatch(
                topic="orders", partition=0, base_offset=0,
                records=(_sealed_under_an_aws_key(),)), consumer)
    finally:
        plugin.close()


async def test_a_malformed_region_from_the_environment_is_never_stored_around(
        moto_kms: str, kek: tuple[str, str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A region the SDK refuses (here from AWS_DEFAULT_REGION, which the settings cannot
    check) is a setting to fix, not a KMS that is down: not retriable, so even
    ``on_kms_unavailable: pass`` refuses the batch rather than storing it in clear."""
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us east 1")
    provider = aws_provider(moto_kms)
    with pytest.raises(KmsError, match=r"InvalidRegionError.*fix them") as caught:
        await provider.resolve_key(kek[0])
    assert not caught.value.retriable
    await provider.close()
    plugin = load("record_encryption", config={
        "kms": {"type": "aws", "endpoint": moto_kms}, "key": "alias/KEK_${topic}",
        "on_kms_unavailable": "pass"})
    try:
        outcome = await run_interceptor_async(
            plugin, make_batch(records=[Record(key=b"k", value=b"card 4111")], topic="orders"))
        assert outcome.kind == "rejected"
        assert plugin.interceptor.counts["kms_unavailable_passed"] == 0
    finally:
        plugin.close()


@pytest.mark.parametrize(("kms", "key", "problem"), [
    ({"region": REGION}, "KEK_${topic}",
     "'KEK_t' is neither an alias (alias/...) nor an alias ARN"),
    ({"region": "us east 1"}, "alias/KEK_${topic}",
     "kms.region: 'us east 1' is not a region name"),
], ids=["template-not-an-alias", "malformed-region"])
def test_settings_no_topic_could_use_are_refused_at_load(
        moto_kms: str, kms: dict[str, Any], key: str, problem: str) -> None:
    """Found at load (and so at a reload, which keeps the running configuration),
    rather than at each producer's first batch as a retriable error."""
    with pytest.raises(Exception, match=re.escape(problem)):
        load("record_encryption", config={
            "kms": {"type": "aws", "endpoint": moto_kms, **kms}, "key": key})
    load("record_encryption", config={
        "kms": {"type": "aws", "endpoint": moto_kms, "region": REGION},
        "key": "arn:aws:kms:eu-west-1:111122223333:alias/KEK_${topic}"}).close()
