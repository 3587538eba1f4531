"""The schema registry client against a real Apicurio Registry (its ``/apis/ccompat/v7``):
schemas registered with confluent-kafka's ``SchemaRegistryClient``, looked up by ID with
their references (an Avro record naming another subject's record, a Protobuf import,
two levels deep), the caches (negative, bounded, TTL), one request per ID however many
callers, an outage (the registry stopped and restarted), and TLS with a client certificate,
basic auth and a bearer token file through an HTTPS front.
"""

from __future__ import annotations

import asyncio
import json
import os
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import support.bench  # noqa: F401 - bench/ is not an installed package: this makes it importable
from support.registry import HttpsFront, Pki, make_pki

from kiproxy.interceptors.builtin.schema_registry.registry import (
    RegisteredSchema,
    RegistryUnavailable,
    SchemaRegistryClient,
    UnknownSchemaId,
    UnknownSubject,
)
from kiproxy.interceptors.builtin.schema_registry.registry_config import RegistrySettings
from kiproxy_dev.apicurio import ApicurioRegistry

RUN = uuid.uuid4().hex[:6]  # the shared registry outlives a test: subjects of this run only
MONEY_PROTO = 'syntax = "proto3";\npackage common;\nmessage Money { double amount = 1; }\n'
LINE_PROTO = ('syntax = "proto3";\npackage shop;\nimport "common/money.proto";\n'
              'message Line { common.Money price = 1; message Note { string text = 1; } }\n')


def sr_client(url: str) -> Any:
    from confluent_kafka.schema_registry import SchemaRegistryClient as ConfluentClient
    return ConfluentClient({"url": url})


def register(url: str, subject: str, text: str, schema_type: str = "AVRO",
             refs: tuple[tuple[str, str, int], ...] = ()) -> int:
    """Register with confluent-kafka's client; returns the schema ID."""
    from confluent_kafka.schema_registry import Schema, SchemaReference
    references = [SchemaReference(name, subj, version) for name, subj, version in refs]
    return int(sr_client(url).register_schema(subject, Schema(text, schema_type, references)))


def avro_record(name: str, fields: dict[str, str], namespace: str = "shop") -> str:
    return json.dumps({"type": "record", "name": name, "namespace": namespace,
                       "fields": [{"name": f, "type": t} for f, t in fields.items()]})


def client(url: str, **settings: Any) -> SchemaRegistryClient:
    return SchemaRegistryClient(RegistrySettings.from_config({"url": url, **settings}))


def names(schema: RegisteredSchema) -> list[tuple[str, str]]:
    return [(ref.name, ref.schema.schema_type) for ref in schema.references]


async def test_schemas_by_id_with_references_resolved(registry_url: str) -> None:
    currency = register(registry_url, f"{RUN}-shop.Currency",
                        avro_record("Currency", {"code": "string"}))
    money = register(registry_url, f"{RUN}-shop.Money",
                     avro_record("Money", {"amount": "double", "currency": "shop.Currency"}),
                     refs=(("shop.Currency", f"{RUN}-shop.Currency", 1),))
    order = register(registry_url, f"{RUN}-orders-value",
                     avro_record("Order", {"id": "string", "total": "shop.Money"}),
                     refs=(("shop.Money", f"{RUN}-shop.Money", 1),))
    proto_money = register(registry_url, f"{RUN}/common/money.proto", MONEY_PROTO, "PROTOBUF")
    line = register(registry_url, f"{RUN}-lines-value", LINE_PROTO, "PROTOBUF",
                    refs=(("common/money.proto", f"{RUN}/common/money.proto", 1),))
    event = register(registry_url, f"{RUN}-events-value",
                     json.dumps({"$schema": "http://json-schema.org/draft-07/schema#",
                                 "type": "object", "required": ["id"]}), "JSON")
    c = client(registry_url)
    try:
        got = await c.schema_by_id(order)
        assert (got.schema_id, got.schema_type) == (order, "AVRO")  # no schemaType: AVRO
        assert json.loads(got.schema)["name"] == "Order"
        (ref,) = got.references
        assert (ref.name, ref.subject, ref.version) == ("shop.Money", f"{RUN}-shop.Money", 1)
        assert ref.schema.schema_id == money and json.loads(ref.schema.schema)["name"] == "Money"
        (inner,) = ref.schema.references  # resolved recursively
        assert inner.schema.schema_id == currency and inner.schema.references == ()

        proto = await c.schema_by_id(line)
        assert proto.schema_type == "PROTOBUF" and "message Note" in proto.schema
        assert names(proto) == [("common/money.proto", "PROTOBUF")]
        assert proto.references[0].schema.schema_id == proto_money
        assert "message Money" in proto.references[0].schema.schema

        assert (await c.schema_by_id(event)).schema_type == "JSON"
        assert await c.subjects_of(order) == ((f"{RUN}-orders-value", 1),)
        assert await c.latest_id(f"{RUN}-orders-value") == order
        with pytest.raises(UnknownSubject, match="not registered"):
            await c.latest_id(f"{RUN}-no-such-subject")
        # The registry keeps a schema as it was registered (no canonical form, whose
        # sorted Avro fields would no longer read the producer's bytes): a whitespace-only
        # variant is another schema with an ID of its own, and comes back byte for byte.
        spaced = json.dumps(json.loads(avro_record("Currency", {"code": "string"})), indent=4)
        respaced = register(registry_url, f"{RUN}-shop.Currency", spaced)
        assert respaced != currency
        assert (await c.schema_by_id(respaced)).schema == spaced
    finally:
        await c.close()


async def test_unknown_ids_are_remembered_briefly(registry_url: str) -> None:
    c = client(registry_url, negative_ttl_s=0.3)
    try:
        for _ in range(3):
            with pytest.raises(UnknownSchemaId, match=r"schema id 987654 is not registered"):
                await c.schema_by_id(987654)
        assert c.stats().requests == 1 and c.stats().unknown == 2
        await asyncio.sleep(0.4)
        with pytest.raises(UnknownSchemaId):
            await c.schema_by_id(987654)
        assert c.stats().requests == 2
    finally:
        await c.close()


async def test_cache_is_bounded_and_entries_expire(registry_url: str) -> None:
    from bench.registry_schemas import register_schemas  # the benches' helper, tried here
    ids = [i for _, i in register_schemas(registry_url, 3, prefix=f"{RUN}-bound")]
    assert len(set(ids)) == 3
    c = client(registry_url, cache_size=2, cache_ttl_s=1.5)  # outlives the lookups below
    try:
        for schema_id in ids:
            await c.schema_by_id(schema_id)
        assert c.stats().cached == 2 and c.stats().requests == 3
        await c.schema_by_id(ids[2])  # still cached
        assert c.stats().requests == 3
        await c.schema_by_id(ids[0])  # evicted as least recently used: asked again
        assert c.stats().requests == 4
        await asyncio.sleep(1.6)
        first = await c.schema_by_id(ids[0])  # expired: served, and refreshed meanwhile
        assert first.schema_id == ids[0] and c.stats().stale == 1
        for _ in range(100):  # the refresh, done
            if c.stats().latency_count == 5:
                break
            await asyncio.sleep(0.02)
        assert c.stats().requests == 5
        stats = c.stats()
        assert stats.lookups == stats.hits + stats.misses == 6
        assert stats.latency_count == 5 and stats.latency_sum_s > 0
    finally:
        await c.close()


async def test_one_request_per_id_however_many_callers(registry_url: str, pki: Pki) -> None:
    schema_id = register(registry_url, f"{RUN}-flight-value", avro_record("Flight", {"n": "int"}))
    front = HttpsFront(registry_url, pki)
    c = client(front.url, ca_file=str(pki.ca))
    try:
        got = await asyncio.gather(*(c.schema_by_id(schema_id) for _ in range(50)))
        assert all(g is got[0] for g in got) and got[0].schema_id == schema_id
        assert len(front.seen) == 1  # counted by the server
        assert c.stats().requests == 1 and c.stats().misses == 1
    finally:
        await c.close()
        front.close()


async def test_requests_in_flight_never_exceed_the_bound(registry_url: str, pki: Pki) -> None:
    """Twelve new ids asked at once, each answer held 0.1 s by the server: the server
    never answers more than ``max_requests_in_flight`` at once (counted there), and more
    than one, so the bound is what holds them back, not a serial client."""
    ids = [register(registry_url, f"{RUN}-bound{i}-value", avro_record(f"Bound{i}", {"n": "int"}))
           for i in range(12)]
    front = HttpsFront(registry_url, pki, delay=0.1)
    c = client(front.url, ca_file=str(pki.ca), max_requests_in_flight=3)
    try:
        got = await asyncio.gather(*(c.schema_by_id(i) for i in ids))
        assert [g.schema_id for g in got] == ids
        assert len(front.seen) == 12
        assert 1 < front.peak <= 3
    finally:
        await c.close()
        front.close()


async def test_a_lookup_waits_for_a_request_slot_at_most_the_timeout(registry_url: str,
                                                                     pki: Pki) -> None:
    """One slot, answers held 0.6 s, a 1 s timeout: the first of three new ids resolves;
    the third would wait at least 1.2 s for the slot and fails as unavailable instead,
    naming the setting."""
    ids = [register(registry_url, f"{RUN}-slot{i}-value", avro_record(f"Slot{i}", {"n": "int"}))
           for i in range(3)]
    front = HttpsFront(registry_url, pki, delay=0.6)
    c = client(front.url, ca_file=str(pki.ca), max_requests_in_flight=1, timeout_ms=1000)
    try:
        got = await asyncio.gather(*(c.schema_by_id(i) for i in ids), return_exceptions=True)
        assert isinstance(got[0], RegisteredSchema) and got[0].schema_id == ids[0]
        assert isinstance(got[2], RegistryUnavailable)
        assert "no request slot free within 1000 ms" in str(got[2])
        assert "registry.max_requests_in_flight" in str(got[2])
    finally:
        await c.close()
        front.close()


async def test_a_burst_of_new_ids_in_one_batch_keeps_the_bound(registry_url: str,
                                                               pki: Pki) -> None:
    """The interceptor checking one batch of 10 records, each with a new id, to payload
    level (a schema and a subjects lookup per id): every record passes, and the server
    never answered more than the default bound (2) at once."""
    from kiproxy.interceptors.api import InterceptContext, Record, RecordBatch
    from kiproxy.interceptors.builtin.schema_registry import SchemaRegistryValidator

    topic = f"{RUN}-burst"
    ids = [register(registry_url, f"{topic}-value",
                    avro_record("Burst", {"n": "int"}).replace('"Burst"', f'"Burst", "doc": "{i}"'))
           for i in range(10)]
    assert len(set(ids)) == 10
    front = HttpsFront(registry_url, pki, delay=0.05)
    plugin = SchemaRegistryValidator()
    plugin.configure({"registry": {"url": front.url, "ca_file": str(pki.ca)},
                      "topics": {topic: {"value": "payload"}}})
    batch = RecordBatch(topic=topic, partition=0, records=tuple(
        Record(key=None, value=b"\x00" + sid.to_bytes(4, "big") + b"\x0e", offset_delta=n)
        for n, sid in enumerate(ids)))
    ctx = InterceptContext(client_id="t", client_address="t", principal=None, api_version=9,
                           acks=-1, transactional_id=None, deadline=0.0)
    try:
        assert await plugin.intercept(batch, ctx) is batch
        assert len(front.seen) == 20  # a schema and a subjects request per id
        assert 1 < front.peak <= 2
    finally:
        await plugin.close()
        front.close()


def test_a_client_serves_successive_event_loops(registry_url: str) -> None:
    """As in Spark executors: each task may run its own loop, one client per executor."""
    schema_id = register(registry_url, f"{RUN}-loops-value", avro_record("Loops", {"n": "int"}))
    c = client(registry_url)
    first = asyncio.run(c.schema_by_id(schema_id))
    assert asyncio.run(c.schema_by_id(schema_id)) is first  # cached across loops
    assert asyncio.run(c.subjects_of(schema_id, fresh=True)) == ((f"{RUN}-loops-value", 1),)
    asyncio.run(c.close())
    assert c.stats().requests == 2


async def test_an_outage_keeps_cached_ids_and_a_restart_resolves_new_ones(
        start_registry: Callable[[], ApicurioRegistry]) -> None:
    registry = start_registry()
    cached = register(registry.url, "outage-a-value", avro_record("A", {"n": "int"}))
    other = register(registry.url, "outage-b-value", avro_record("B", {"n": "int"}))
    c = client(registry.url, cache_ttl_s=0.5, timeout_ms=1000)
    try:
        await c.schema_by_id(cached)
        registry.stop()
        assert (await c.schema_by_id(cached)).schema_id == cached  # fresh in the cache
        with pytest.raises(RegistryUnavailable, match=rf"{registry.url}/schemas/ids/{other}"):
            await c.schema_by_id(other)
        await asyncio.sleep(0.6)
        assert (await c.schema_by_id(cached)).schema_id == cached  # expired, kept while down
        for _ in range(100):  # the refresh it started fails in the background
            if c.stats().errors == 2:
                break
            await asyncio.sleep(0.02)
        assert c.stats().stale == 1 and c.stats().errors == 2
        assert (await c.schema_by_id(cached)).schema_id == cached
        with pytest.raises(RegistryUnavailable):
            await c.latest_id("outage-a-value")

        registry.start()  # the same port; storage starts empty, IDs count from 1 again
        first = register(registry.url, "outage-c-value", avro_record("C", {"s": "string"}))
        new = register(registry.url, "outage-d-value", avro_record("D", {"s": "string"}))
        assert new == other
        got = await c.schema_by_id(new)  # the ID the outage refused, resolved now
        assert json.loads(got.schema)["name"] == "D" and first != new
    finally:
        await c.close()


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    return make_pki(tmp_path_factory.mktemp("registry-pki"))


@pytest.fixture
def tls_front(registry_url: str, pki: Pki) -> Iterator[HttpsFront]:
    front = HttpsFront(registry_url, pki, require_client_cert=True, basic=("reader", "s3cret"))
    yield front
    front.close()


async def test_tls_with_a_client_certificate_and_basic_auth(
        registry_url: str, pki: Pki, tls_front: HttpsFront, tmp_path: Path) -> None:
    schema_id = register(registry_url, f"{RUN}-tls-value", avro_record("Tls", {"n": "int"}))
    password = tmp_path / "password"
    password.write_text("s3cret\n")
    tls = {"ca_file": str(pki.ca), "cert_file": str(pki.client_cert),
           "key_file": str(pki.client_key)}
    good = client(tls_front.url, basic_auth={"username": "reader",
                                             "password_file": str(password)}, **tls)
    wrong = client(tls_front.url, basic_auth={"username": "reader", "password": "no"}, **tls)
    no_cert = client(tls_front.url, ca_file=str(pki.ca),
                     basic_auth={"username": "reader", "password": "s3cret"})
    untrusted = client(tls_front.url, basic_auth={"username": "reader", "password": "s3cret"},
                       cert_file=str(pki.client_cert), key_file=str(pki.client_key))
    try:
        assert (await good.schema_by_id(schema_id)).schema_id == schema_id
        assert tls_front.seen[-1] is not None and tls_front.seen[-1].startswith("Basic ")
        with pytest.raises(RegistryUnavailable, match=r"HTTP 401 .*registry.basic_auth"):
            await wrong.schema_by_id(schema_id)
        with pytest.raises(RegistryUnavailable, match=tls_front.url):
            await no_cert.schema_by_id(schema_id)
        with pytest.raises(RegistryUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            await untrusted.schema_by_id(schema_id)
    finally:
        for c in (good, wrong, no_cert, untrusted):
            await c.close()


async def test_a_bearer_token_file_is_read_again_when_it_changes(
        registry_url: str, pki: Pki, tmp_path: Path) -> None:
    schema_id = register(registry_url, f"{RUN}-bearer-value", avro_record("Bearer", {"n": "int"}))
    front = HttpsFront(registry_url, pki, bearer="token-2")
    token = tmp_path / "token"
    token.write_text("token-1\n")
    c = client(front.url, ca_file=str(pki.ca), bearer_token_file=str(token))
    try:
        with pytest.raises(RegistryUnavailable, match="HTTP 401"):
            await c.schema_by_id(schema_id)
        token.write_text("token-2\n")
        os.utime(token, (1, 1))  # a different mtime, however fast the rewrite
        assert (await c.schema_by_id(schema_id)).schema_id == schema_id
        assert front.seen == ["Bearer token-1", "Bearer token-2"]
    finally:
        await c.close()
        front.close()
