"""The ``record_encryption`` built-in on both hooks, loaded as the proxy loads it:
what a producer's batch becomes (``intercept``, judged by the proxy's verdict), what a
consumer's batch becomes (``on_consume``), and each policy's outcome."""

from __future__ import annotations

import json
import math
import os
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from kiproxy.interceptors import (
    ConsumeContext,
    ConsumedBatch,
    ConsumedBlock,
    Header,
    Record,
    RefuseFetch,
)
from kiproxy.interceptors.builtin.record_encryption import MARKER_HEADER, RecordEncryption
from kiproxy.interceptors.builtin.record_encryption.key_file import write_key_file
from kiproxy.interceptors.loader import PluginLoadError
from kiproxy.interceptors.sealing import compiled_gcm
from kiproxy.interceptors.testing import Plugin, load, make_batch, run_interceptor_async

CONTEXT = ConsumeContext(client_id="reader", client_address="127.0.0.1:50001",
                         principal=None, api_version=16, deadline=math.inf)  # no deadline


@pytest.fixture
def key_file(tmp_path: Path) -> Path:
    path = tmp_path / "keys.yaml"
    write_key_file(path, {"KEK_orders": (1, {1: os.urandom(32)}),
                          "KEK_payments": (1, {1: os.urandom(32)}),
                          "shared": (1, {1: os.urandom(32)})})
    return path


def _plugin(key_file: Path, **config: Any) -> Iterator[Plugin]:
    plugin = load("record_encryption", config={
        "kms": {"type": "key_file", "path": str(key_file)}, "key": "KEK_${topic}", **config})
    yield plugin
    plugin.close()


@pytest.fixture
def plugin(key_file: Path) -> Iterator[Plugin]:
    yield from _plugin(key_file)


def _records() -> list[Record]:
    return [
        Record(key=b"o1", value=b'{"card": "4111 1111 1111 1111"}', timestamp=1000,
               headers=[Header("b", b"2"), Header("a", b"1"), Header("b", b"3")]),
        Record(key=b"o2", value=None, timestamp=1001, offset_delta=1,
               headers=[Header("a", b"x")]),
        Record(key=None, value=b"", timestamp=1002, offset_delta=2),
    ]


async def _produce(plugin: Plugin, topic: str, records: list[Record]) -> Any:
    return await run_interceptor_async(plugin, make_batch(records=records, topic=topic))


async def _consume(plugin: Plugin, topic: str, records: tuple[Record, ...] | list[Record],
                   ) -> ConsumedBatch:
    interceptor: RecordEncryption = plugin.interceptor
    batch = ConsumedBatch(topic=topic, partition=2, base_offset=40, records=tuple(records))
    return await interceptor.on_consume(batch, CONTEXT)


def _metric(plugin: Plugin, name: str, **labels: str) -> float:
    return next(m.value for m in plugin.interceptor.metrics()
                if m.name == name and dict(m.labels) == labels)


async def test_values_are_sealed_on_produce_and_opened_on_fetch_keys_headers_order_kept(
        plugin: Plugin) -> None:
    original = _records()
    outcome = await _produce(plugin, "orders", original)
    assert outcome.kind == "transformed"
    stored = outcome.records
    assert [r.key for r in stored] == [b"o1", b"o2", None]
    assert [r.timestamp for r in stored] == [1000, 1001, 1002]
    assert stored[0].value is not None and b"4111" not in stored[0].value
    assert stored[1].value is None  # a tombstone stays a tombstone, and is left alone
    assert stored[1] == original[1]
    assert stored[2].value != b""  # an empty value is a value: sealed
    assert [h.key for h in stored[0].headers] == ["b", "a", "b", MARKER_HEADER]
    assert [h.value for h in stored[0].headers[:3]] == [b"2", b"1", b"3"]

    opened = await _consume(plugin, "orders", stored)
    assert opened.records == tuple(original)
    assert (opened.topic, opened.partition, opened.base_offset) == ("orders", 2, 40)
    assert _metric(plugin, "record_encryption_records_encrypted") == 2
    assert _metric(plugin, "record_encryption_records_decrypted") == 2
    assert _metric(plugin, "record_encryption_data_keys_generated") == 1


async def test_chosen_headers_are_sealed_and_the_others_left_readable(key_file: Path) -> None:
    for plugin in _plugin(key_file, headers=["b"]):
        original = _records()
        stored = (await _produce(plugin, "orders", original)).records
        assert [h.key for h in stored[0].headers] == ["b", "a", "b", MARKER_HEADER]
        assert stored[0].headers[1].value == b"1"
        assert {stored[0].headers[0].value, stored[0].headers[2].value}.isdisjoint(
            {b"2", b"3"})
        assert (await _consume(plugin, "orders", stored)).records == tuple(original)


async def test_plaintext_records_pass_decryption_unchanged(plugin: Plugin) -> None:
    plain = _records()
    batch = ConsumedBatch(topic="orders", partition=0, base_offset=0, records=tuple(plain))
    assert await plugin.interceptor.on_consume(batch, CONTEXT) is batch
    sealed = (await _produce(plugin, "orders", plain[:1])).records
    mixed = [plain[1], Record(key=sealed[0].key, value=sealed[0].value,
                              headers=sealed[0].headers, timestamp=sealed[0].timestamp,
                              offset_delta=1)]
    opened = await _consume(plugin, "orders", mixed)
    assert opened.records[0] is plain[1]
    assert opened.records[1].value == plain[0].value


async def test_topics_select_what_is_encrypted_and_under_which_key(key_file: Path) -> None:
    topics = {"orders": {}, "pay.*": {"key": "KEK_payments"}, "payments-raw": {"encrypt": False},
              "audit": {"key": "shared"}}
    for plugin in _plugin(key_file, topics=topics):
        for topic in ("orders", "payments-eu", "audit"):
            assert (await _produce(plugin, topic, _records())).kind == "transformed", topic
        # a name is tried before the expressions, and says not to encrypt
        assert (await _produce(plugin, "payments-raw", _records())).kind == "unchanged"
        assert (await _produce(plugin, "logs", _records())).kind == "unchanged"
        assert _metric(plugin, "record_encryption_unresolved_key_records", policy="pass") == 0
        # decryption is by the marker header, whatever the topic table says
        for topic in ("orders", "logs"):
            for other in _plugin(key_file, topics={"nothing": {}}):
                sealed = (await _produce(plugin, topic if topic == "orders" else "audit",
                                         _records())).records
                source = "orders" if topic == "orders" else "audit"
                assert (await _consume(other, source, sealed)).records == tuple(_records())


async def test_a_topic_whose_key_is_unknown_is_stored_as_it_came_by_default(
        plugin: Plugin, caplog: pytest.LogCaptureFixture) -> None:
    for _ in range(3):
        assert (await _produce(plugin, "clicks", _records())).kind == "unchanged"
    assert _metric(plugin, "record_encryption_unresolved_key_records", policy="pass") == 9
    warnings = [r for r in caplog.records if "UNENCRYPTED" in r.getMessage()]
    assert len(warnings) == 1  # once a minute per topic
    assert "'KEK_clicks'" in warnings[0].getMessage()


async def test_the_warning_counts_the_records_of_its_own_topic(
        plugin: Plugin, caplog: pytest.LogCaptureFixture) -> None:
    for _ in range(4):
        await _produce(plugin, "clicks", _records())
    await _produce(plugin, "views", _records()[:2])
    warnings = {r.getMessage().split("'")[1]: r.getMessage() for r in caplog.records
                if "UNENCRYPTED" in r.getMessage()}
    assert "(unresolved_key: pass; records of this topic so far: 3)" in warnings["clicks"]
    assert "(unresolved_key: pass; records of this topic so far: 2)" in warnings["views"]
    assert _metric(plugin, "record_encryption_unresolved_key_records", policy="pass") == 14


def test_a_fixed_key_the_key_file_does_not_hold_is_refused_at_load(key_file: Path) -> None:
    """A key without ${topic} names one key for every topic: one the file lacks would
    store every record in clear, so the configuration is refused (a reload keeps the
    running one: tests/integration/test_record_encryption_e2e.py)."""
    kms = {"type": "key_file", "path": str(key_file)}
    cases = [("key", {"key": "KEK_missing"}),
             ("key", {"key": "KEK_missing", "topics": ["orders", "audit"]}),
             ("topics.orders.key", {"key": "KEK_${topic}", "topics": {
                 "orders": {"key": "KEK_missing"}}}),
             ("topics.pay.*.key", {"key": "KEK_${topic}", "topics": {
                 "pay.*": {"key": "KEK_missing"}}})]
    for where, config in cases:
        with pytest.raises(PluginLoadError) as caught:
            load("record_encryption", config={"kms": kms, **config})
        message = str(caught.value)
        assert f"{where}: key file {key_file} has no key 'KEK_missing'" in message, message
        assert "(it has ['KEK_orders', 'KEK_payments', 'shared'])" in message
    for config in ({"key": "shared"}, {"key": "KEK_${topic}", "topics": ["orders", "audit"]},
                   {"key": "KEK_missing", "topics": {"orders": {"key": "shared"},
                                                     "logs": {"encrypt": False}}}):
        load("record_encryption", config={"kms": kms, **config}).close()


async def test_unresolved_key_reject_refuses_the_batch(key_file: Path) -> None:
    for plugin in _plugin(key_file, unresolved_key="reject"):
        outcome = await _produce(plugin, "clicks", _records())
        assert (outcome.kind, outcome.error) == ("rejected", "POLICY_VIOLATION")
        assert "no usable encryption key 'KEK_clicks'" in outcome.message
        assert _metric(plugin, "record_encryption_unresolved_key_records",
                       policy="reject") == 3


async def test_a_record_already_marked_is_refused_as_invalid(plugin: Plugin) -> None:
    forged = Record(value=b"x", headers=[Header(MARKER_HEADER, b"\x01")], offset_delta=0)
    outcome = await _produce(plugin, "orders", [forged])
    assert (outcome.kind, outcome.error) == ("rejected", "INVALID_RECORD")
    assert "already carries" in outcome.message


@pytest.mark.parametrize("config", [{"topics": ["orders"]}, {"unresolved_key": "pass"}],
                         ids=["not-encrypted", "no-key-passed"])
async def test_a_record_already_marked_is_refused_on_a_topic_stored_as_it_came(
        key_file: Path, config: dict[str, Any]) -> None:
    """The fetch side opens a marked record on any topic: stored on a topic the proxy
    does not encrypt, a forged marker would hold every consumer at that offset."""
    for plugin in _plugin(key_file, **config):
        forged = Record(value=b"x", headers=[Header(MARKER_HEADER, b"\x01junk")])
        outcome = await _produce(plugin, "clicks", [_records()[0], forged])
        assert (outcome.kind, outcome.error) == ("rejected", "INVALID_RECORD")
        assert "already carries" in outcome.message
        assert (await _produce(plugin, "clicks", _records())).kind == "unchanged"


def _damaged(record: Record) -> Record:
    assert record.value is not None
    value = bytearray(record.value)
    value[-1] ^= 1
    return Record(key=record.key, value=bytes(value), headers=record.headers,
                  timestamp=record.timestamp, offset_delta=record.offset_delta)


async def test_a_record_that_does_not_decrypt_refuses_the_partition_by_default(
        plugin: Plugin) -> None:
    stored = (await _produce(plugin, "orders", _records())).records
    with pytest.raises(RefuseFetch, match=r"orders\[2\] batch at offset 40: a record does "
                                          r"not decrypt") as refused:
        await _consume(plugin, "orders", [_damaged(stored[0]), *stored[1:]])
    assert refused.value.error_code == -1  # UNKNOWN_SERVER_ERROR: consumers retry
    assert _metric(plugin, "record_encryption_undecryptable", policy="error") == 1


async def test_on_undecryptable_pass_hands_over_the_ciphertext_and_opens_the_rest(
        key_file: Path) -> None:
    for plugin in _plugin(key_file, on_undecryptable="error",
                          topics={"orders": {"on_undecryptable": "pass"},
                                  "other": {"key": "shared"}}):
        stored = (await _produce(plugin, "orders", _records())).records
        damaged = _damaged(stored[0])
        opened = await _consume(plugin, "orders", [damaged, *stored[1:]])
        assert opened.records == (damaged, *_records()[1:])
        assert _metric(plugin, "record_encryption_undecryptable", policy="pass") == 1
        sealed = (await _produce(plugin, "other", _records())).records
        with pytest.raises(RefuseFetch):  # the top-level policy still holds elsewhere
            await _consume(plugin, "other", [_damaged(sealed[0])])


def test_settings_errors_name_the_key(key_file: Path) -> None:
    cases = {
        "kms.regoin: unknown key; did you mean kms.region?":
            {"kms": {"type": "aws", "regoin": "x"}, "key": "k"},
        "kms: type key_file needs `path:`": {"kms": {"type": "key_file"}, "key": "k"},
        "kms: region: only for type aws":
            {"kms": {"type": "key_file", "path": str(key_file), "region": "r"}, "key": "k"},
        "the placeholders are ${topic} and ${topic_alias}":
            {"kms": {"type": "aws"}, "key": "KEK_${tpoic}"},
        "not a regular expression": {"kms": {"type": "aws"}, "key": "k", "topics": ["a("]},
        "kms.endpoint: '127.0.0.1:4566' is not an http(s) URL; write the scheme and the "
        "host, e.g. http://127.0.0.1:4566":
            {"kms": {"type": "aws", "endpoint": "127.0.0.1:4566"}, "key": "k"},
        "kms.endpoint: 'kms:x' is not an http(s) URL":
            {"kms": {"type": "aws", "endpoint": "kms:x"}, "key": "k"},
        "is not a key template: write ${topic} for the topic's name, ${topic_alias} for":
            {"kms": {"type": "aws"}, "key": "KEK_${topic.alias}"},
        "kiproxy.encryption is the marker header":
            {"kms": {"type": "aws"}, "key": "k", "headers": [MARKER_HEADER]},
        "unresolved_key: expected 'pass' or 'reject'":
            {"kms": {"type": "aws"}, "key": "k", "unresolved_key": "drop"},
        "data_keys.max_encryptions_per_key":
            {"kms": {"type": "aws"}, "key": "k", "data_keys": {"max_encryptions_per_key": 0}},
    }
    for message, config in cases.items():
        with pytest.raises(PluginLoadError) as caught:
            load("record_encryption", config=config)
        assert message in str(caught.value), (message, str(caught.value))


# -- AWS KMS (moto on loopback) -------------------------------------------------------


def _aws(endpoint: str, **config: Any) -> Plugin:
    return load("record_encryption", config={
        "kms": {"type": "aws", "endpoint": endpoint, "region": "eu-west-1",
                "connect_timeout_ms": 300, "read_timeout_ms": 500, "max_attempts": 1},
        "key": "alias/KEK_${topic}", **config})


def _alias(kms_admin: Any, topic: str) -> str:
    meta = kms_admin.create_key()["KeyMetadata"]
    kms_admin.create_alias(AliasName=f"alias/KEK_{topic}", TargetKeyId=meta["KeyId"])
    return str(meta["Arn"])


def _dead_endpoint() -> str:
    with socket.socket() as sock:  # a port nobody listens on once closed
        sock.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.mark.usefixtures("aws_env")
async def test_the_first_try_interface_with_aws_kms_round_trips_and_rotates(
        moto_kms: str, kms_admin: Any) -> None:
    topic = f"orders_{os.urandom(4).hex()}"
    arn = _alias(kms_admin, topic)
    config = {"kms": {"type": "aws", "endpoint": moto_kms, "region": "eu-west-1"},
              "key": "alias/KEK_${topic}", "data_keys": {"max_encryptions_per_key": 2}}
    with load("record_encryption", config=config) as writer, \
            load("record_encryption", config=config) as reader:
        stored: list[Record] = []
        for _ in range(3):  # 2 sealed fields a batch: a data key each
            stored += (await _produce(writer, topic, _records())).records
        assert _metric(writer, "record_encryption_data_keys_generated") == 3
        assert arn.encode() in dict(stored[0].headers)[MARKER_HEADER]
        opened = await _consume(reader, topic, stored)
        assert opened.records == tuple(_records() * 3)
        assert _metric(reader, "record_encryption_data_keys_unwrapped") == 3


@pytest.mark.usefixtures("aws_env")
async def test_a_kms_that_cannot_be_reached_refuses_produce_retriably_and_fetch(
        moto_kms: str, kms_admin: Any) -> None:
    topic = f"orders_{os.urandom(4).hex()}"
    _alias(kms_admin, topic)
    dead = _dead_endpoint()
    with _aws(dead) as plugin:
        outcome = await _produce(plugin, topic, _records())
        assert (outcome.kind, outcome.error) == ("rejected", "REQUEST_TIMED_OUT")
        assert "nothing was stored, retry" in outcome.message
        assert _metric(plugin, "record_encryption_kms_errors", hook="encrypt") == 1
    with _aws(dead, on_kms_unavailable="pass") as plugin:
        assert (await _produce(plugin, topic, _records())).kind == "unchanged"
        assert _metric(plugin, "record_encryption_kms_unavailable_passed") == 3
    with _aws(moto_kms) as writer, _aws(dead, on_undecryptable="pass") as reader:
        stored = (await _produce(writer, topic, _records())).records
        with pytest.raises(RefuseFetch, match="the KMS could not be used"):
            await _consume(reader, topic, stored)  # not undecryptable: unavailable
        assert _metric(reader, "record_encryption_kms_errors", hook="decrypt") == 1
        # a partition's blocks at once: refused the same way, not handed to on_consume
        sealed = [r for r in stored if r.value is not None]
        (answer,) = await reader.interceptor.on_consume_blocks(_blocks((topic, sealed)),
                                                               CONTEXT)
        assert isinstance(answer, RefuseFetch) and "the KMS could not be used" in \
            answer.message
        assert _metric(reader, "record_encryption_kms_errors", hook="decrypt") == 2


@pytest.mark.usefixtures("aws_env", "aws_key_states")
async def test_a_data_key_whose_kms_key_was_disabled_follows_on_undecryptable(
        moto_kms: str, kms_admin: Any) -> None:
    topic = f"orders_{os.urandom(4).hex()}"
    arn = _alias(kms_admin, topic)
    with _aws(moto_kms) as writer:
        stored = (await _produce(writer, topic, _records())).records
    kms_admin.disable_key(KeyId=arn.rsplit("/", 1)[1])
    with _aws(moto_kms) as reader, pytest.raises(RefuseFetch, match="does not decrypt"):
        await _consume(reader, topic, stored)
    with _aws(moto_kms, on_undecryptable="pass") as reader:
        assert (await _consume(reader, topic, stored)).records == tuple(stored)
    with _aws(moto_kms) as writer:  # and new records: its key is unusable
        assert (await _produce(writer, topic, _records())).kind == "unchanged"


@pytest.mark.usefixtures("aws_env")
async def test_a_dotted_topic_is_encrypted_under_its_topic_alias_not_its_name(
        moto_kms: str, kms_admin: Any, caplog: pytest.LogCaptureFixture) -> None:
    """An AWS alias name cannot hold a '.', which a Kafka topic's name may: with
    ``alias/KEK_${topic}`` such a topic has no key, and both policies say why;
    ``${topic_alias}`` names the alias with each '.' as '_'."""
    topic = f"logs.app{os.urandom(4).hex()}"
    rule = "(an alias name is alias/ followed by letters, digits, '/', '_', '-' and ':' only: " \
        "^[a-zA-Z0-9:/_-]+$)"
    invalid = f"'alias/KEK_{topic}' is not a valid AWS KMS alias name: '.' is not allowed"
    with _aws(moto_kms, topics=[r"logs\..*"]) as plugin:
        assert (await _produce(plugin, topic, _records())).kind == "unchanged"
        [warning] = [r.getMessage() for r in caplog.records if "UNENCRYPTED" in r.getMessage()]
        assert f"topic {topic!r} stored UNENCRYPTED, {invalid} {rule}" in warning, warning
        assert "write ${topic_alias}" in warning
    with _aws(moto_kms, unresolved_key="reject") as plugin:
        outcome = await _produce(plugin, topic, _records())
        assert (outcome.kind, outcome.error) == ("rejected", "POLICY_VIOLATION")
        assert f"{topic}[0] refused, {invalid} {rule}" in outcome.message, outcome.message
        assert "nothing was stored (unresolved_key: reject)" in outcome.message
    with pytest.raises(PluginLoadError, match=r"key: 'alias/logs\.all' is not a valid AWS "
                                              r"KMS alias name: '\.' is not allowed"):
        _aws(moto_kms, key="alias/logs.all")  # one key for every topic: known at load

    arn = _alias(kms_admin, topic.replace(".", "_"))
    config = {"key": "alias/KEK_${topic_alias}", "topics": {r"logs\..*": {}}}
    with _aws(moto_kms, **config) as writer, _aws(moto_kms, **config) as reader:
        stored = (await _produce(writer, topic, _records())).records
        assert arn.encode() in dict(stored[0].headers)[MARKER_HEADER]
        assert (await _consume(reader, topic, stored)).records == tuple(_records())


def test_kiproxy_check_runs_the_produce_hook_over_samples(
        key_file: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kiproxy.interceptors import check
    sample = tmp_path / "sample.jsonl"
    sample.write_text('{"key": "o1", "value": "card 4111"}\n{"key": "o2", "value": null}\n')
    config = json.dumps({"kms": {"type": "key_file", "path": str(key_file)},
                         "key": "KEK_${topic}"})
    assert check.main(["record_encryption", "--topic", "orders", "--config", config,
                       "--sample", str(sample)]) == 0
    out = capsys.readouterr().out
    assert "batch 1: orders[0], 2 records: transformed (1 changed)" in out
    assert "card 4111" not in out
    assert MARKER_HEADER in out  # the changed record is printed, sealed


# -- the proxy's rules for a fetch-side hook, and replay's backfill --------------------


def test_decryption_keeps_what_the_consume_verdict_requires(plugin: Plugin) -> None:
    from kiproxy.interceptors.consume_verdict import ConsumeRefusal
    from kiproxy.interceptors.testing import make_consumed_batch

    stored = plugin.run(make_batch(records=_records(), topic="orders")).records
    sealed = make_consumed_batch(make_batch(records=stored, topic="orders"), base_offset=500)
    opened = plugin.consume(sealed)  # judged as the proxy's fetch path judges it
    assert isinstance(opened, ConsumedBatch)
    assert opened.records == tuple(_records()) and opened.base_offset == 500
    damaged = make_consumed_batch(make_batch(records=[_damaged(stored[0])], topic="orders"))
    refused = plugin.consume(damaged)
    assert isinstance(refused, ConsumeRefusal)
    assert (refused.code, refused.reason) == (-1, "refused")
    assert "does not decrypt" in refused.message


def test_replay_reads_through_the_fetch_hook_and_re_encrypts_under_other_keys(
        tmp_path: Path) -> None:
    from kiproxy.pipelines.apply import InterceptorRunner, InterceptorSpec
    from kiproxy.pipelines.sources import SourceBatch

    old_keys, new_keys = tmp_path / "old.yaml", tmp_path / "new.yaml"
    write_key_file(old_keys, {"KEK_orders": (1, {1: os.urandom(32)})})
    write_key_file(new_keys, {"KEK2_orders": (1, {1: os.urandom(32)})})
    old = {"kms": {"type": "key_file", "path": str(old_keys)}, "key": "KEK_${topic}"}
    new = {"kms": {"type": "key_file", "path": str(new_keys)}, "key": "KEK2_${topic}"}
    for writer in _plugin(old_keys):
        stored = writer.run(make_batch(records=_records(), topic="orders")).records
    runner = InterceptorRunner(InterceptorSpec("record_encryption", new,
                                               fetch_hook="record_encryption",
                                               fetch_hook_config=old))
    moved = runner.apply(SourceBatch(topic="orders", partition=0, offsets=(40, 41, 42),
                                     records=stored, stored=True))
    assert moved.kind == "transformed"
    assert all(b"KEK2_orders" in dict(r.headers)[MARKER_HEADER]
               for r in moved.records if r.value is not None)
    with load("record_encryption", config=new) as reader:
        assert reader.consume(make_consumed_batch_of(moved.records)).records == tuple(
            _records())
    with load("record_encryption", config=old) as old_reader:  # the old keys no longer open
        assert not isinstance(old_reader.consume(make_consumed_batch_of(moved.records)),
                              ConsumedBatch)


def make_consumed_batch_of(records: tuple[Record, ...]) -> ConsumedBatch:
    return ConsumedBatch(topic="orders", partition=0, base_offset=0, records=records)


def test_a_compacted_batch_keeps_the_latest_value_of_each_key_decryptable(
        plugin: Plugin) -> None:
    """The log cleaner keeps the latest record of each key and rewrites the batch with
    the survivors at their offsets: each sealed record carries its own envelope, so
    what survives opens alone, and a compaction tombstone stays a tombstone."""
    from kiproxy.interceptors.testing import make_consumed_batch, run_interceptor
    from kiproxy.protocol.records import build_batch, decode_batch, encode_batch

    written = [Record(key=b"k%d" % (i % 3), value=b"version %d" % i, timestamp=1000 + i,
                      offset_delta=i) for i in range(9)]
    written.append(Record(key=b"k2", value=None, timestamp=1009, offset_delta=9))
    sealed = run_interceptor(plugin, make_batch(records=written, topic="orders"))
    assert sealed.kind == "transformed"
    stored = decode_batch(build_batch(sealed.records, base_offset=100))
    latest = {r.key: r for r in stored.records}  # what the cleaner keeps: last per key
    survivors = tuple(r for r in stored.records if latest[r.key] is r)
    compacted = decode_batch(encode_batch(stored.header, survivors, renumber=False,
                                          keep_extent=True))
    opened = plugin.consume(make_consumed_batch(base_offset=100, records=compacted.records,
                                                topic="orders"))
    assert isinstance(opened, ConsumedBatch)
    assert [(r.key, r.value, r.offset_delta) for r in opened.records] == [
        (b"k0", b"version 6", 6), (b"k1", b"version 7", 7), (b"k2", None, 9)]


# -- the fetch side on records blocks (on_consume_block) ------------------------------


async def _consume_block(plugin: Plugin, topic: str, records: tuple[Record, ...] | list[Record]
                         ) -> tuple[Any, ConsumedBlock]:
    from kiproxy.protocol.records import encode_records

    data = encode_records(tuple(records), 1000, False)[0]
    block = ConsumedBlock(topic=topic, partition=2, base_offset=40, base_timestamp=1000,
                          record_count=len(records), data=memoryview(data))
    return await plugin.interceptor.on_consume_block(block, CONTEXT), block


def _decoded(block: bytes, count: int) -> tuple[Record, ...]:
    from kiproxy.protocol.records import decode_records

    return decode_records(block, 0, len(block), count, 1000)


@pytest.mark.skipif(not compiled_gcm(), reason="the block path needs OpenSSL bound")
async def test_the_common_batch_opens_as_its_block(plugin: Plugin) -> None:
    original = [r for r in _records() if r.value is not None]
    stored = (await _produce(plugin, "orders", original)).records
    opened, block = await _consume_block(plugin, "orders", stored)
    assert isinstance(opened, bytes) and opened is not block.data
    assert _decoded(opened, len(original)) == tuple(original)
    assert _metric(plugin, "record_encryption_records_decrypted") == len(original)


async def test_a_block_with_nothing_sealed_is_returned_as_given(plugin: Plugin) -> None:
    opened, block = await _consume_block(plugin, "orders", _records())
    assert opened is block.data
    assert _metric(plugin, "record_encryption_records_decrypted") == 0


def _stored_key_not_utf8() -> list[Record]:
    """Records as a client that writes raw header keys stores them (brokers keep any
    bytes): the key ``b"\\xff\\xfe"``, read as lone surrogates."""
    key = b"\xff\xfe".decode("utf-8", "surrogateescape")
    return [Record(key=b"k", value=b"v%d" % i, timestamp=1000, offset_delta=i,
                   headers=[Header(key, b"x"), Header("a", b"1")]) for i in range(2)]


async def test_a_header_key_that_is_not_utf8_neither_blocks_nor_changes_a_partition(
        plugin: Plugin) -> None:
    """A batch whose header key is not UTF-8 (stored as sent) is handed over as it lies
    when nothing in it is sealed, and sealed and opened back to the same bytes when its
    producer came through the proxy: it once made the hook give up on the batch, whose
    partition then could not be read past it."""
    from kiproxy.protocol.records import encode_records

    plain = _stored_key_not_utf8()
    assert b"\xff\xfe" in encode_records(tuple(plain), 1000, False)[0]
    (block,) = _blocks(("orders", plain))
    assert (await plugin.interceptor.on_consume_blocks([block], CONTEXT)) == [block.data]
    opened_one, given = await _consume_block(plugin, "orders", plain)
    assert opened_one is given.data

    stored = (await _produce(plugin, "orders", plain)).records
    assert [h.key for h in stored[0].headers][:2] == [plain[0].headers[0].key, "a"]
    (sealed,) = _blocks(("orders", stored))
    (opened,) = await plugin.interceptor.on_consume_blocks([sealed], CONTEXT)
    if opened is None:  # no compiled cipher here: the per-batch path opens it
        assert (await _consume(plugin, "orders", stored)).records == tuple(plain)
    else:
        assert bytes(opened) == encode_records(tuple(plain), 1000, False)[0]


async def test_any_other_block_is_handed_to_on_consume(plugin: Plugin) -> None:
    stored = (await _produce(plugin, "orders", _records())).records  # a tombstone among them
    assert (await _consume_block(plugin, "orders", stored))[0] is None
    damaged = [_damaged(stored[0]), stored[2]]
    assert (await _consume_block(plugin, "orders", damaged))[0] is None
    # and the test kit, as the proxy does, then opens what opens record by record
    from kiproxy.interceptors.testing import make_consumed_batch

    fetched = plugin.consume(make_consumed_batch(make_batch(records=stored, topic="orders")))
    assert isinstance(fetched, ConsumedBatch) and fetched.records == tuple(_records())


async def test_a_data_key_that_cannot_be_unwrapped_follows_on_undecryptable_on_blocks(
        key_file: Path, tmp_path: Path) -> None:
    for writer in _plugin(key_file):
        stored = (await _produce(writer, "orders", [_records()[0]])).records
    other = tmp_path / "other.yaml"
    write_key_file(other, {"KEK_orders": (1, {1: os.urandom(32)})})  # same name, other key
    for reader in _plugin(other):
        with pytest.raises(RefuseFetch, match="a record does not decrypt"):
            await _consume_block(reader, "orders", stored)
        assert _metric(reader, "record_encryption_undecryptable", policy="error") == 1
    for reader in _plugin(other, on_undecryptable="pass"):
        assert (await _consume_block(reader, "orders", stored))[0] is None


# -- a fetched partition's blocks at once (on_consume_blocks) -------------------------


def _blocks(*batches: tuple[str, tuple[Record, ...] | list[Record]]) -> list[ConsumedBlock]:
    from kiproxy.protocol.records import encode_records

    return [ConsumedBlock(topic=topic, partition=2, base_offset=40 + 10 * i,
                          base_timestamp=1000, record_count=len(records),
                          data=memoryview(encode_records(tuple(records), 1000, False)[0]))
            for i, (topic, records) in enumerate(batches)]


@pytest.mark.skipif(not compiled_gcm(), reason="the block path needs OpenSSL bound")
async def test_a_partitions_blocks_open_together_and_the_rest_go_to_on_consume(
        key_file: Path, tmp_path: Path) -> None:
    original = [r for r in _records() if r.value is not None]
    for plugin in _plugin(key_file, data_keys={"max_encryptions_per_key": 2}):
        first = (await _produce(plugin, "orders", original)).records      # data key 1
        second = (await _produce(plugin, "orders", original[:1])).records  # data key 2
        whole = (await _produce(plugin, "orders", _records())).records    # a tombstone
        blocks = _blocks(("orders", first), ("orders", _records()), ("orders", second),
                         ("orders", [_damaged(first[0]), first[1]]), ("orders", whole),
                         ("orders", first))
        answers = await plugin.interceptor.on_consume_blocks(blocks, CONTEXT)
        assert answers[1] is blocks[1].data  # nothing sealed
        assert answers[3] is None and answers[4] is None  # on_consume says why, or opens
        for i, plain in ((0, original), (2, original[:1]), (5, original)):
            assert isinstance(answers[i], bytes)
            assert _decoded(answers[i], len(plain)) == tuple(plain)
            assert answers[i] == (await _consume_block(plugin, "orders",
                                                       _decoded(bytes(blocks[i].data),
                                                                len(plain))))[0]
        decrypted = _metric(plugin, "record_encryption_records_decrypted")
        assert decrypted == 2 * (2 + 1 + 2)  # the three blocks above, twice each
    # a malformed block: left to the per-batch path, which says what is wrong
    garbage = ConsumedBlock(topic="orders", partition=2, base_offset=99, base_timestamp=1000,
                            record_count=2, data=memoryview(b"\x07not a block"))
    for plugin in _plugin(key_file):
        answers = await plugin.interceptor.on_consume_blocks(
            [*_blocks(("orders", first)), garbage], CONTEXT)
        assert isinstance(answers[0], bytes) and answers[1] is None
    # a data key the KMS will not unwrap: the policy, as on_consume_block applies it -
    # refused (one refusal for the partition, counted once), or None under "pass"
    other = tmp_path / "other.yaml"
    write_key_file(other, {"KEK_orders": (1, {1: os.urandom(32)})})
    for reader in _plugin(other):
        answers = await reader.interceptor.on_consume_blocks(
            _blocks(("orders", first), ("orders", _records()), ("orders", first)), CONTEXT)
        assert isinstance(answers[0], RefuseFetch) and answers[2] is answers[0]
        assert answers[1] is not None  # nothing sealed: its own block
        assert "a record does not decrypt" in answers[0].message
        assert _metric(reader, "record_encryption_undecryptable", policy="error") == 1
    for reader in _plugin(other, on_undecryptable="pass"):
        assert await reader.interceptor.on_consume_blocks(_blocks(("orders", first)),
                                                          CONTEXT) == [None]
