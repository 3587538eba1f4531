"""Schema ids in record headers, written by Apicurio Registry's own Java Avro serde.

A Java producer (tests/java/ApicurioProducer.java) serializes with
``io.apicurio:apicurio-registry-serdes-avro-serde`` against the session's Apicurio Registry
and produces through ``kiproxy run`` (interceptor ``schema_registry``) in front of Tansu.
With its defaults the serde writes the raw Avro payload and the artifact version's globalId
as an 8-byte big-endian long in the header ``apicurio.value.globalId``; with
``apicurio.registry.use-id=contentId``, the contentId in ``apicurio.value.contentId``, which
is the id Apicurio's Confluent-compatible API numbers schemas by. Records the serde wrote are
stored byte for byte, headers included; a header naming an unregistered id, a payload that
does not decode and a rule failure are each refused with the record error, which the Java
producer's callback reads (InvalidRecordException).
"""

from __future__ import annotations

import io
import json
import struct
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ProxyProcess, consume, launch_proxy
from support.apache_kafka import kafka_home_or_skip
from support.apicurio_producer import ApicurioProducer, ProducerRun

from kiproxy_dev.tansu import EmbeddedBroker

from .test_interception import _create_topics

pytestmark = pytest.mark.timeout(240)

RUN = uuid.uuid4().hex[:6]
GLOBAL, CONTENT = f"ap{RUN}-global", f"ap{RUN}-content"
ORDER = {"type": "record", "name": "Order", "namespace": "shop", "fields": [
    {"name": "id", "type": "string"}, {"name": "amount", "type": "double"}]}
COMPACT = json.dumps(ORDER, separators=(",", ":"))
INVALID_RECORD = "org.apache.kafka.common.InvalidRecordException"


def native(registry_url: str) -> str:
    """Apicurio's native API beside its Confluent-compatible one."""
    return registry_url.replace("/apis/ccompat/v7", "/apis/registry/v2")


@pytest.fixture(scope="module")
def producer() -> ApicurioProducer:
    return ApicurioProducer.build(kafka_home_or_skip())


@pytest.fixture(scope="module")
def proxy(broker: EmbeddedBroker, registry_url: str) -> Iterator[ProxyProcess]:
    config = {"registry": {"url": registry_url}, "topics": {
        # The serde's default header; its globalIds are translated (header id: global_id).
        GLOBAL: {"value": {"check": "payload", "header": "apicurio.value.globalId"},
                 "rules": [{"name": "positive_amount", "expr": "value.amount > 0.0"}]},
        # use-id=contentId: the number the Confluent-compatible API knows, looked up as is.
        CONTENT: {"value": {"check": "payload", "header": {
            "name": "apicurio.value.contentId", "encoding": "long", "id": "registry"}}},
    }}
    p = launch_proxy(broker.bootstrap, interceptor="schema_registry",
                     interceptor_config=config)
    _create_topics(broker.bootstrap, GLOBAL, CONTENT)
    yield p
    assert p.alive(), f"the proxy died:\n{p.log}"
    p.stop()


def _post(url: str, artifact: str, body: str) -> dict[str, Any]:
    request = urllib.request.Request(
        f"{url}/groups/default/artifacts", data=body.encode(), method="POST",
        headers={"Content-Type": "application/json", "X-Registry-ArtifactId": artifact,
                 "X-Registry-ArtifactType": "AVRO"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        answer: dict[str, Any] = json.load(resp)
    return answer


def _stored(broker: EmbeddedBroker, topic: str, count: int) -> list[tuple[bytes, list[Any]]]:
    return [(m.value(), list(m.headers() or [])) for m in consume(broker.bootstrap, topic, count)]


def _check_stored(run: ProducerRun, broker: EmbeddedBroker, topic: str, good: list[int]) -> None:
    sent = run.sent
    stored = _stored(broker, topic, len(good))
    assert stored == [(sent[i].value, sent[i].headers) for i in good]


def test_default_serde_global_ids_in_headers(producer: ApicurioProducer, proxy: ProxyProcess,
                                             broker: EmbeddedBroker, registry_url: str,
                                             tmp_path: Path) -> None:
    # The same content (the compact text the serde registers) registered before, under
    # another artifact: the serde's version of it gets a new globalId but the old
    # contentId, so the two numberings differ.
    _post(native(registry_url), f"ap{RUN}-earlier", COMPACT)
    schema = tmp_path / "order.avsc"
    schema.write_text(COMPACT)
    run = producer.produce(proxy.bootstrap, GLOBAL, native(registry_url), schema, [
        ("good", {"id": "o1", "amount": 1.5}), ("good", {"id": "o2", "amount": 2.5}),
        ("unknown-id", {"id": "o3", "amount": 3.5}), ("cut", {"id": "o4", "amount": 4.5}),
        ("good", {"id": "o5", "amount": -1.0})])
    sent = run.sent
    assert [name for name, _ in sent[0].headers] == ["apicurio.value.globalId",
                                                     "apicurio.value.encoding"]
    global_id = struct.unpack(">q", dict(sent[0].headers)["apicurio.value.globalId"])[0]
    with urllib.request.urlopen(f"{registry_url}/subjects/{GLOBAL}-value/versions/1",
                                timeout=10) as resp:
        registry_id = json.load(resp)["id"]
    assert registry_id != global_id  # a lookup as is would miss, or find another schema

    assert [run.result(i)["event"] for i in range(5)] == [
        "delivered", "delivered", "error", "error", "error"], run.events
    errors = {i: run.result(i) for i in (2, 3, 4)}
    assert {e["error"] for e in errors.values()} == {INVALID_RECORD}
    assert errors[2]["message"] == ("record 0: Apicurio global id 987654321 is not registered "
                                    "(header apicurio.value.globalId)")
    assert errors[3]["message"].startswith("record 0: field amount: ")
    assert errors[4]["message"] == ("record 0: rule positive_amount failed: "
                                    "value.amount > 0.0 is false")
    _check_stored(run, broker, GLOBAL, [0, 1])


def test_content_ids_in_headers(producer: ApicurioProducer, proxy: ProxyProcess,
                                broker: EmbeddedBroker, registry_url: str,
                                tmp_path: Path) -> None:
    schema = tmp_path / "order.avsc"
    schema.write_text(COMPACT)
    run = producer.produce(proxy.bootstrap, CONTENT, native(registry_url), schema, [
        ("good", {"id": "c1", "amount": 1.0}), ("unknown-id", {"id": "c2", "amount": 2.0})],
        serde=[("apicurio.registry.use-id", "contentId")])
    assert [name for name, _ in run.sent[0].headers] == ["apicurio.value.contentId",
                                                         "apicurio.value.encoding"]
    assert run.result(0)["event"] == "delivered", run.events
    assert run.result(1) == {"event": "error", "index": 1, "error": INVALID_RECORD,
                             "message": "record 0: schema id 987654321 is not registered"}
    _check_stored(run, broker, CONTENT, [0])


def _new_version(url: str, artifact: str, body: str) -> int:
    """Register ``body`` as a new version of ``artifact`` (created if missing): its globalId."""
    request = urllib.request.Request(
        f"{url}/groups/default/artifacts?ifExists=UPDATE", data=body.encode(), method="POST",
        headers={"Content-Type": "application/json", "X-Registry-ArtifactId": artifact,
                 "X-Registry-ArtifactType": "AVRO"})
    with urllib.request.urlopen(request, timeout=10) as resp:
        global_id: int = json.load(resp)["globalId"]
    return global_id


def test_a_global_id_of_an_older_version_is_found(proxy: ProxyProcess,
                                                  registry_url: str) -> None:
    """Producers still on the version before the latest, as in a rolling upgrade: Apicurio's
    search by globalId finds only an artifact's latest version."""
    import fastavro
    from confluent_kafka import Producer

    artifact = f"{GLOBAL}-value"  # the topic's subject, which the check holds it to
    older = _new_version(native(registry_url), artifact, COMPACT)
    newer = {**ORDER, "fields": [*ORDER["fields"],
                                 {"name": "note", "type": "string", "default": ""}]}
    _new_version(native(registry_url), artifact, json.dumps(newer, separators=(",", ":")))
    payload = io.BytesIO()
    fastavro.schemaless_writer(payload, fastavro.parse_schema(ORDER), {"id": "r1", "amount": 1.0})
    errors: list[Any] = []
    p = Producer({"bootstrap.servers": proxy.bootstrap, "message.timeout.ms": 20000})
    p.produce(GLOBAL, payload.getvalue(),
              headers=[("apicurio.value.globalId", struct.pack(">q", older))],
              on_delivery=lambda err, _msg: errors.append(err))
    p.flush(30)
    assert [None if e is None else e.str() for e in errors] == [None]
