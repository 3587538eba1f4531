"""Data contracts at the door: a real Apicurio Registry, confluent-kafka's own serializers.

Producers serialize with confluent-kafka's ``AvroSerializer``,
``ProtobufSerializer`` and ``JSONSerializer`` (registering through
``SchemaRegistryClient``) and produce through a ``kiproxy run`` process whose
interceptor is ``schema_registry``, in front of Tansu. What a confluent-kafka
producer sees is its delivery report's error code (librdkafka shows no
``record_errors``, see docs/rejections.md), so the record errors are read from
the Produce v9 response of the same bytes sent on a raw connection.
"""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ProxyProcess, consume, launch_proxy
from support.processes import runtime_env
from support.raw_client import RawClient

from kiproxy.protocol.records import Record, build_batch
from kiproxy_dev.tansu import EmbeddedBroker, free_port

from .test_interception import _create_topics

pytestmark = pytest.mark.timeout(180)

RUN = uuid.uuid4().hex[:6]  # subjects live as long as the registry: names of this run only
ORDER = {"type": "record", "name": "Order", "namespace": "shop", "fields": [
    {"name": "id", "type": "string"}, {"name": "amount", "type": "double"},
    {"name": "currency", "type": "string"}]}
PAYMENT = {"type": "record", "name": "Payment", "namespace": "shop", "fields": [
    {"name": "id", "type": "string"}, {"name": "amount", "type": "string"}]}
CUSTOMER = {"type": "record", "name": "Customer", "namespace": "shop", "fields": [
    {"name": "name", "type": "string"}]}
INVOICE = {"type": "record", "name": "Invoice", "namespace": "shop", "fields": [
    {"name": "number", "type": "long"}, {"name": "customer", "type": "shop.Customer"}]}
MONEY_PROTO = ('syntax = "proto3";\npackage common;\n'
               "message Money { string currency = 1; double amount = 2; }\n")
ORDER_PROTO = ('syntax = "proto3";\npackage shop;\nimport "common/money.proto";\n'
               "message Order { string id = 1; common.Money total = 2;\n"
               "  message Line { string sku = 1; int32 qty = 2; }\n"
               "  repeated Line lines = 3; }\n")
EVENT_JSON = {"title": "Event", "type": "object", "required": ["kind"],
              "properties": {"kind": {"type": "string"}, "size": {"type": "integer"}}}


def topic(name: str) -> str:
    return f"sr{RUN}-{name}"


def interceptor_config(url: str, *, rules: list[dict[str, str]] | None = None,
                       on_unavailable: str = "reject") -> dict[str, Any]:
    return {
        "registry": {"url": url},
        "on_registry_unavailable": on_unavailable,
        "topics": {
            topic("orders"): {"value": "payload", "rules": rules if rules is not None else [
                {"name": "positive_amount", "expr": "value.amount > 0.0"}]},
            topic("lines"): {"value": "payload"},
            topic("events"): {"value": "payload"},
            topic("invoices"): {"value": "payload"},
            topic("history"): {"value": "payload", "rules": [
                {"name": "positive_amount", "expr": "value.amount > 0.0"}]},
            topic("keyed"): {"key": "payload", "value": "payload", "tombstones": "reject"},
            f"sr{RUN}-mixed-.*": {"value": "payload"},
            topic("plain"): {"rules": [{"name": "has_kind", "expr": "has(value.kind)"}]},
        },
    }


# -- the registry and its clients ------------------------------------------------------


@pytest.fixture(scope="module")
def sr(registry_url: str) -> Any:
    from confluent_kafka.schema_registry import SchemaRegistryClient
    return SchemaRegistryClient({"url": registry_url})


@pytest.fixture(scope="module")
def proxy(broker: EmbeddedBroker, registry_url: str) -> Iterator[ProxyProcess]:
    p = launch_proxy(broker.bootstrap, interceptor="schema_registry",
                     interceptor_config=interceptor_config(registry_url))
    _create_topics(broker.bootstrap, *(topic(n) for n in (
        "orders", "lines", "events", "invoices", "keyed", "mixed-a", "mixed-b", "plain",
        "history")))
    yield p
    assert p.alive(), f"the proxy died:\n{p.log}"
    p.stop()


def avro_serializer(sr: Any, schema: Any, **conf: Any) -> Any:
    from confluent_kafka.schema_registry.avro import AvroSerializer
    return AvroSerializer(sr, schema if not isinstance(schema, dict) else json.dumps(schema),
                          conf=conf)


def ser(serializer: Any, value: Any, topic_name: str, *, key: bool = False) -> bytes:
    from confluent_kafka.serialization import MessageField, SerializationContext
    field = MessageField.KEY if key else MessageField.VALUE
    return bytes(serializer(value, SerializationContext(topic_name, field)))


def proto_classes(files: dict[str, str], main: str) -> dict[str, Any]:
    """Message classes built from ``.proto`` texts (protoc from grpcio-tools)."""
    from google.protobuf import descriptor_pb2, message_factory
    from grpc_tools import protoc

    include = str(Path(protoc.__file__).parent / "_proto")
    with tempfile.TemporaryDirectory() as tmp:
        for name, text in files.items():
            path = Path(tmp, name)
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
        out = os.path.join(tmp, "set.pb")
        assert protoc.main(["protoc", f"-I{tmp}", f"-I{include}", "--include_imports",
                            f"--descriptor_set_out={out}", os.path.join(tmp, main)]) == 0
        files_set = descriptor_pb2.FileDescriptorSet.FromString(Path(out).read_bytes())
    return message_factory.GetMessages(list(files_set.file))


def framed(schema_id: int, payload: bytes) -> bytes:
    return b"\x00" + struct.pack(">I", schema_id) + payload


# -- what producers see ---------------------------------------------------------------


def produce(bootstrap: str, topic_name: str, values: list[bytes | None],
            keys: list[bytes | None] | None = None, **conf: Any) -> list[Any]:
    """Produce each value (one batch each) with confluent-kafka; the delivery errors."""
    from confluent_kafka import Producer

    reports: list[Any] = [None] * len(values)
    producer = Producer({"bootstrap.servers": bootstrap, "linger.ms": 0,
                         "message.timeout.ms": 15000, **conf})
    for i, value in enumerate(values):
        producer.produce(topic_name, value, key=None if keys is None else keys[i], partition=0,
                         on_delivery=lambda err, _msg, i=i: reports.__setitem__(i, err))
        producer.flush(20)
    assert producer.flush(20) == 0
    return reports


def answer(bootstrap: str, parts: list[tuple[str, list[Record]]]) -> dict[str, Any]:
    """The Produce v9 answer, per topic, of one request carrying ``parts`` (partition 0)."""
    with RawClient(bootstrap) as client:
        client.send(RawClient.produce(9, [(t, build_batch(records)) for t, records in parts]))
        _, response = client.read_produce(9)
    out = {}
    for t in response.responses:
        [p] = t.partition_responses
        out[str(t.name)] = (int(p.error_code), p.error_message,
                            [(int(e.batch_index), e.batch_index_error_message)
                             for e in p.record_errors])
    return out


def records(*values: bytes | None, key: bytes | None = None) -> list[Record]:
    return [Record(key=key, value=v, timestamp=1_763_800_000_000 + i) for i, v in
            enumerate(values)]


INVALID_RECORD = 87


def test_avro_good_records_are_stored_byte_for_byte_and_each_bad_one_is_named(
        proxy: ProxyProcess, broker: EmbeddedBroker, sr: Any) -> None:
    orders = topic("orders")
    order_ser = avro_serializer(sr, ORDER)
    good = [ser(order_ser, {"id": f"o{i}", "amount": 10.0 + i, "currency": "EUR"}, orders)
            for i in range(3)]
    assert produce(proxy.bootstrap, orders, list(good)) == [None, None, None]
    assert [m.value() for m in consume(broker.bootstrap, orders, 3)] == good

    order_id = struct.unpack(">I", good[0][1:5])[0]
    payments = avro_serializer(sr, PAYMENT)
    payment = ser(payments, {"id": "p1", "amount": "12.5"}, topic("payments"))
    payment_id = struct.unpack(">I", payment[1:5])[0]
    bad = {
        "unregistered": framed(987_654, good[0][5:]),
        "other subject": payment,
        "mismatch": framed(order_id, payment[5:]),
        "unframed": b'{"id": "o1", "amount": 1}',
        "rule": ser(order_ser, {"id": "o9", "amount": -5.0, "currency": "EUR"}, orders),
    }
    reports = produce(proxy.bootstrap, orders, list(bad.values()))
    assert [r.code() for r in reports] == [INVALID_RECORD] * len(bad), reports

    code, message, errors = answer(proxy.bootstrap, [(orders, records(good[0], *bad.values()))])[
        orders]
    assert code == INVALID_RECORD
    assert message.startswith(f"5 of 6 record(s) of {orders}[0] broke the data contract")
    named = dict(errors)
    assert sorted(named) == [1, 2, 3, 4, 5]
    assert named[1] == "record 1: schema id 987654 is not registered"
    assert named[2].startswith(f"record 2: schema id {payment_id} is registered under ")
    assert f"{topic('payments')}-value" in named[2]
    assert named[2].endswith(f", not {orders}-value")
    assert named[3].startswith("record 3: field amount: expected double: ")
    assert named[4] == ("record 4: not framed with a schema id: expected magic byte 0 and a "
                        "4-byte schema id, as Confluent serializers write, got first byte 0x7b")
    assert named[5] == "record 5: rule positive_amount failed: value.amount > 0.0 is false"


def test_a_mixed_request_stores_the_good_partitions(proxy: ProxyProcess, broker: EmbeddedBroker,
                                                     sr: Any) -> None:
    a, b = topic("mixed-a"), topic("mixed-b")
    good = ser(avro_serializer(sr, ORDER), {"id": "m", "amount": 1.0, "currency": "USD"}, a)
    result = answer(proxy.bootstrap, [(a, records(good)), (b, records(b"not framed"))])
    assert result[a] == (0, None, []) and result[b][0] == INVALID_RECORD
    assert [m.value() for m in consume(broker.bootstrap, a, 1)] == [good]


def test_protobuf_nested_type_with_an_import(proxy: ProxyProcess, broker: EmbeddedBroker,
                                             sr: Any) -> None:
    from confluent_kafka.schema_registry.protobuf import ProtobufSerializer

    lines = topic("lines")
    classes = proto_classes({"common/money.proto": MONEY_PROTO, "shop/order.proto": ORDER_PROTO},
                            "shop/order.proto")
    order_cls = classes["shop.Order"]
    line_ser = ProtobufSerializer(order_cls.Line, sr, {"use.deprecated.format": False})
    good = ser(line_ser, order_cls.Line(sku="abc", qty=2), lines)
    assert good[5:7] == b"\x04\x00"  # indexes [0, 0]: Order.Line
    order_ser = ProtobufSerializer(order_cls, sr, {"use.deprecated.format": False})
    whole = ser(order_ser, order_cls(id="o1", total={"currency": "EUR", "amount": 2.5}),
                topic("proto-orders"))
    assert produce(proxy.bootstrap, lines, [good]) == [None]
    assert [m.value() for m in consume(broker.bootstrap, lines, 1)] == [good]

    line_id = struct.unpack(">I", good[1:5])[0]
    wrong_type = framed(line_id, b"\x04\x00\x00" + whole[6:])  # an Order's bytes read as a Line
    [report] = produce(proxy.bootstrap, lines, [wrong_type])
    assert report.code() == INVALID_RECORD
    _, _, errors = answer(proxy.bootstrap, [(lines, records(good, wrong_type))])[lines]
    [(index, text)] = errors
    assert index == 1 and "shop.Order.Line" in text and "written with another schema" in text


def test_json_schema(proxy: ProxyProcess, broker: EmbeddedBroker, sr: Any) -> None:
    from confluent_kafka.schema_registry.json_schema import JSONSerializer

    events = topic("events")
    serializer = JSONSerializer(json.dumps(EVENT_JSON), sr)
    good = ser(serializer, {"kind": "click", "size": 3}, events)
    assert produce(proxy.bootstrap, events, [good]) == [None]
    bad = framed(struct.unpack(">I", good[1:5])[0], b'{"kind": "click", "size": "big"}')
    [report] = produce(proxy.bootstrap, events, [bad])
    assert report.code() == INVALID_RECORD
    _, _, errors = answer(proxy.bootstrap, [(events, records(bad))])[events]
    assert errors[0][1].startswith('record 0: field size: "big" is not of type "integer"')


def test_avro_reference_to_another_subject(proxy: ProxyProcess, broker: EmbeddedBroker,
                                           sr: Any) -> None:
    from confluent_kafka.schema_registry import Schema, SchemaReference

    invoices = topic("invoices")
    customer_subject = f"sr{RUN}-shop.Customer"
    sr.register_schema(customer_subject, Schema(json.dumps(CUSTOMER), "AVRO"))
    invoice = Schema(json.dumps(INVOICE), "AVRO", [
        SchemaReference("shop.Customer", customer_subject, 1)])
    sr.register_schema(f"{invoices}-value", invoice)
    serializer = avro_serializer(sr, invoice, **{"auto.register.schemas": False,
                                                 "use.latest.version": True})
    good = ser(serializer, {"number": 7, "customer": {"name": "Ada"}}, invoices)
    assert produce(proxy.bootstrap, invoices, [good]) == [None]
    assert [m.value() for m in consume(broker.bootstrap, invoices, 1)] == [good]
    cut = good[:-2]
    [report] = produce(proxy.bootstrap, invoices, [cut])
    assert report.code() == INVALID_RECORD


def test_keys_values_and_tombstones(proxy: ProxyProcess, broker: EmbeddedBroker,
                                    sr: Any) -> None:
    keyed = topic("keyed")
    key_ser = avro_serializer(sr, CUSTOMER)
    value_ser = avro_serializer(sr, ORDER)
    key = ser(key_ser, {"name": "k1"}, keyed, key=True)
    value = ser(value_ser, {"id": "o", "amount": 1.0, "currency": "EUR"}, keyed)
    assert produce(proxy.bootstrap, keyed, [value], keys=[key]) == [None]
    assert [(m.key(), m.value()) for m in consume(broker.bootstrap, keyed, 1)] == [(key, value)]
    reports = produce(proxy.bootstrap, keyed, [value, None], keys=[b"plain key", key])
    assert [r.code() for r in reports] == [INVALID_RECORD, INVALID_RECORD]
    _, _, errors = answer(proxy.bootstrap, [(keyed, records(value, key=b"plain key"))])[keyed]
    assert errors[0][1].startswith("record 0: key: not framed with a schema id")
    _, _, errors = answer(proxy.bootstrap, [(keyed, records(None, key=key))])[keyed]
    assert errors == [(0, "record 0: null value (tombstone), which this topic refuses")]
    orders = topic("orders")  # tombstones pass where not refused
    assert produce(proxy.bootstrap, orders, [None]) == [None]


def test_rules_over_plain_json_without_a_registry_lookup(proxy: ProxyProcess) -> None:
    plain = topic("plain")
    assert produce(proxy.bootstrap, plain, [b'{"kind": "a"}']) == [None]
    _, _, errors = answer(proxy.bootstrap, [(plain, records(b'{"other": 1}'))])[plain]
    assert errors == [(0, "record 0: rule has_kind failed: has(value.kind) is false")]


def test_a_reload_changes_the_rules_without_dropping_the_connection(
        broker: EmbeddedBroker, registry_url: str, sr: Any, tmp_path: Path) -> None:
    from .test_reload import _http, _wait_generation

    orders = topic("orders")
    metrics = f"127.0.0.1:{free_port()}"
    config = tmp_path / "proxy.yaml"

    def write(rules: list[dict[str, str]]) -> None:
        config.write_text(json.dumps({
            "upstream": [broker.bootstrap], "metrics_listen": metrics,
            "interceptor": {"class": "schema_registry",
                            "config": interceptor_config(registry_url, rules=rules)}}))

    write([{"name": "positive_amount", "expr": "value.amount > 0.0"}])
    proxy = launch_proxy(broker.bootstrap, config_file=config)
    try:
        value = ser(avro_serializer(sr, ORDER), {"id": "r", "amount": 5.0, "currency": "EUR"},
                    orders)
        with RawClient(proxy.bootstrap) as client:
            def send() -> tuple[int, list[Any]]:
                client.send(RawClient.produce(9, [(orders, build_batch(records(value)))]))
                _, response = client.read_produce(9)
                [part] = response.responses[0].partition_responses
                return int(part.error_code), [e.batch_index_error_message
                                              for e in part.record_errors]

            assert send() == (0, [])
            write([{"name": "large_orders_only", "expr": "value.amount >= 10.0",
                    "message": "orders under 10 go to the small-orders topic"}])
            assert _http("POST", f"http://{metrics}/reload")[0] == 200
            _wait_generation(metrics, 2)
            assert send() == (INVALID_RECORD, [
                "record 0: rule large_orders_only failed: orders under 10 go to the "
                "small-orders topic"])
            _, scraped = _http("GET", f"http://{metrics}/metrics")
            assert ('kiproxy_interceptor_schema_registry_rule_rejections_total{'
                    'interceptor="schema_registry",rule="large_orders_only"} 1.0') in scraped
            assert "kiproxy_interceptor_schema_registry_cache_misses_total" in scraped
            write([{"name": "broken", "expr": "value.amount >"}])
            status, outcome = _http("POST", f"http://{metrics}/reload")
            assert status == 500 and "rules[0].expr" in json.dumps(outcome), outcome
            assert send()[0] == INVALID_RECORD  # the running rules stay
    finally:
        proxy.stop()


def test_replay_reports_exactly_the_records_the_proxy_refuses(
        proxy: ProxyProcess, broker: EmbeddedBroker, registry_url: str, sr: Any,
        tmp_path: Path) -> None:
    """`kiproxy replay` over a topic holding good and bad records lists exactly the bad
    ones, each with the record error the proxy gives the same record."""
    history = topic("history")
    order_ser = avro_serializer(sr, ORDER)
    good = ser(order_ser, {"id": "h", "amount": 3.0, "currency": "EUR"}, history)
    values = [good, b"legacy plain bytes", good, framed(4_242_424, good[5:]),
              ser(order_ser, {"id": "h", "amount": -1.0, "currency": "EUR"}, history), good]
    # History written straight to the broker, as it was before the proxy checked it.
    assert produce(broker.bootstrap, history, values) == [None] * len(values)

    report = tmp_path / "report"
    done = subprocess.run(
        [sys.executable, "-m", "kiproxy", "replay", "--bootstrap", broker.bootstrap,
         "--topic", history, "--interceptor", "schema_registry",
         "--interceptor-config", json.dumps(interceptor_config(registry_url)),
         "--report", str(report), "--no-progress"],
        capture_output=True, text=True, timeout=150,
        env=runtime_env(SPARK_LOCAL_IP="127.0.0.1"))
    assert done.returncode == 0, done.stderr[-3000:]
    replayed = sorted((r["offset"], r["error_code"], r["record_error"])
                      for f in (report / "rejected").glob("*.json")
                      for r in map(json.loads, f.read_text().splitlines()))
    assert [offset for offset, _, _ in replayed] == [1, 3, 4], replayed

    for offset, code, text in replayed:
        [(inline_code, _, errors)] = answer(proxy.bootstrap,
                                            [(history, records(values[offset]))]).values()
        assert (inline_code, errors) == (code, [(0, text)])


def test_registry_outage_cached_ids_flow_new_ids_follow_the_policy(
        broker: EmbeddedBroker, start_registry: Callable[[], Any]) -> None:
    """A registry of its own, stopped mid-stream and started again (in-memory storage:
    the schemas are registered again, in the same order, so they get the same ids)."""
    from confluent_kafka.schema_registry import Schema, SchemaRegistryClient

    registry = start_registry()
    url = registry.url
    strict, lenient = topic("outage-strict"), topic("outage-lenient")
    config = {"registry": {"url": url}, "topics": {strict: {"value": "payload"}}}
    lenient_config = {**config, "on_registry_unavailable": "pass",
                      "topics": {lenient: {"value": "payload"}}}
    _create_topics(broker.bootstrap, strict, lenient)
    proxies = [launch_proxy(broker.bootstrap, interceptor="schema_registry",
                            interceptor_config=c) for c in (config, lenient_config)]
    try:
        # Two versions of the strict topic's schema (the second adds a field with a
        # default: BACKWARD compatible), and the lenient topic's.
        order_v2 = {**ORDER, "fields": [*ORDER["fields"],
                                        {"name": "note", "type": "string", "default": ""}]}

        def register(client: Any) -> tuple[int, int]:
            order_id = client.register_schema(f"{strict}-value",
                                              Schema(json.dumps(ORDER), "AVRO"))
            client.register_schema(f"{lenient}-value", Schema(json.dumps(ORDER), "AVRO"))
            return order_id, client.register_schema(f"{strict}-value",
                                                    Schema(json.dumps(order_v2), "AVRO"))

        order_id, v2_id = register(SchemaRegistryClient({"url": url}))
        body = b"\x02x" + struct.pack("<d", 1.0) + b"\x06EUR"
        order, order_v2_value = framed(order_id, body), framed(v2_id, body + b"\x02!")
        assert produce(proxies[0].bootstrap, strict, [order]) == [None]  # order_id now cached
        registry.stop()

        assert produce(proxies[0].bootstrap, strict, [order]) == [None]  # cached: checked
        [(code, message, _)] = answer(proxies[0].bootstrap,
                                      [(strict, records(order_v2_value))]).values()
        assert code == 7 and "could not check" in message  # REQUEST_TIMED_OUT: retried
        # on_registry_unavailable: pass forwards it unchecked
        assert produce(proxies[1].bootstrap, lenient, [order_v2_value]) == [None]

        registry.start()  # the same port, empty storage
        assert register(SchemaRegistryClient({"url": url})) == (order_id, v2_id)
        assert produce(proxies[0].bootstrap, strict, [order_v2_value]) == [None]  # checked again
        stored = [m.value() for m in consume(broker.bootstrap, strict, 3)]
        assert stored == [order, order, order_v2_value]
        unknown = answer(proxies[0].bootstrap, [(strict, records(framed(31337, b"")))])
        assert unknown[strict][2] == [(0, "record 0: schema id 31337 is not registered")]
    finally:
        for p in proxies:
            p.stop()

