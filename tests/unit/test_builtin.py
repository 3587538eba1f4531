"""The four built-in interceptors, driven directly through the public API."""

from __future__ import annotations

import inspect
import json
import math
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kiproxy.interceptors import Header, InterceptContext, Record, RecordBatch, RejectBatch
from kiproxy.interceptors.builtin.headers import StampHeaders
from kiproxy.interceptors.builtin.json_schema import JsonSchemaValidator, _parse
from kiproxy.interceptors.builtin.route import TopicRouter
from kiproxy.interceptors.builtin.uppercase import Uppercase
from kiproxy.interceptors.loader import PluginLoadError, load_interceptor

PLUGINS = Path(__file__).resolve().parents[1] / "plugins"
STAMP = 1_700_000_000_123


@pytest.fixture(autouse=True)
def _isolate_imports(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Routes load plugins from tests/plugins, which edits sys.path and sys.modules."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    before = set(sys.modules)
    yield
    for name in set(sys.modules) - before:
        if name.startswith("tp_"):
            del sys.modules[name]


def _ctx(**kwargs: Any) -> InterceptContext:
    base: dict[str, Any] = {"client_id": "billing-app", "client_address": "10.1.2.3:40000",
                            "principal": None, "api_version": 9, "acks": -1,
                            "transactional_id": None, "deadline": time.monotonic() + 5,
                            "received_at_ms": STAMP, "proxy_host": "proxy-7"}
    base.update(kwargs)
    return InterceptContext(**base)


def _batch(values: list[bytes | None], topic: str = "orders", **kwargs: Any) -> RecordBatch:
    records = tuple(
        Record(key=f"k{i}".encode(), value=v, headers=(Header("h", b"1"), Header("h", b"2")),
               timestamp=STAMP + i, offset_delta=i)
        for i, v in enumerate(values)
    )
    return RecordBatch(topic=topic, partition=1, records=records, producer_id=77,
                       producer_epoch=2, base_sequence=10, compression="lz4", **kwargs)


def _facts(batch: RecordBatch) -> tuple[Any, ...]:
    return (batch.topic, batch.partition, batch.producer_id, batch.producer_epoch,
            batch.base_sequence, batch.transactional, batch.compression)


# ---------------------------------------------------------------------------- Uppercase


def test_uppercase_values() -> None:
    plugin = load_interceptor("kiproxy.interceptors.builtin.uppercase:Uppercase")
    batch = _batch([b"hello", None, b"MiXeD 123", b"", b"caf\xc3\xa9"])
    out = plugin.intercept(batch, _ctx())
    assert [r.value for r in out.records] == [b"HELLO", None, b"MIXED 123", b"", b"CAF\xc3\xa9"]
    assert [r.key for r in out.records] == [r.key for r in batch.records]  # keys untouched
    for before, after in zip(batch.records, out.records, strict=True):
        assert after.headers == before.headers
        assert after.timestamp == before.timestamp
        assert after.offset_delta == before.offset_delta
    assert _facts(out) == _facts(batch)
    assert len(out) == len(batch)


def test_uppercase_keys_when_configured() -> None:
    plugin = Uppercase()
    plugin.configure({"keys": True})
    batch = _batch([b"v"]).with_records([Record(key=b"key", value=b"v"), Record(key=None)])
    out = plugin.intercept(batch, _ctx())
    assert [(r.key, r.value) for r in out.records] == [(b"KEY", b"V"), (None, None)]


def test_uppercase_of_an_empty_batch() -> None:
    out = Uppercase().intercept(_batch([]), _ctx())
    assert out.records == ()


# ---------------------------------------------------------------------------- StampHeaders


def test_stamp_headers_appends_static_headers_then_the_stamps() -> None:
    plugin = load_interceptor("kiproxy.interceptors.builtin.headers:StampHeaders", None,
                              {"headers": {"env": "prod", "team": "payments", "none": None}})
    batch = _batch([b"a", None])
    out = plugin.intercept(batch, _ctx())
    for before, after in zip(batch.records, out.records, strict=True):
        assert after.headers[:2] == before.headers  # the record's own headers first, in order
        assert [(h.key, h.value) for h in after.headers[2:]] == [
            ("env", b"prod"), ("team", b"payments"), ("none", None),
            ("kiproxy-host", b"proxy-7"), ("kiproxy-client-id", b"billing-app"),
            ("kiproxy-received-ms", str(STAMP).encode()),
        ]
        assert (after.key, after.value, after.timestamp) == (before.key, before.value,
                                                             before.timestamp)
    assert _facts(out) == _facts(batch)


def test_stamp_headers_prefix_and_null_client_id() -> None:
    plugin = StampHeaders()
    plugin.configure({"prefix": "x-"})
    out = plugin.intercept(_batch([b"a"]), _ctx(client_id=None, received_at_ms=42,
                                                 proxy_host="h"))
    assert out.records[0].headers[2:] == (Header("x-host", b"h"), Header("x-client-id", None),
                                          Header("x-received-ms", b"42"))


def test_stamp_headers_without_stamps() -> None:
    plugin = StampHeaders()
    plugin.configure({"headers": {"env": "dev"}, "stamp": False})
    out = plugin.intercept(_batch([b"a"]), _ctx())
    assert out.records[0].headers == (Header("h", b"1"), Header("h", b"2"), Header("env", b"dev"))


def test_stamp_headers_defaults_stamp_only() -> None:
    out = load_interceptor("kiproxy.interceptors.builtin.headers:StampHeaders").intercept(
        _batch([b"a"]), _ctx())
    assert [h.key for h in out.records[0].headers] == [
        "h", "h", "kiproxy-host", "kiproxy-client-id", "kiproxy-received-ms"]


def test_stamp_headers_rejects_a_non_mapping() -> None:
    with pytest.raises(PluginLoadError, match="headers: expected a mapping, got a list"):
        load_interceptor("kiproxy.interceptors.builtin.headers:StampHeaders", None,
                         {"headers": ["env", "prod"]})


# ---------------------------------------------------------------------------- JsonSchemaValidator

ORDER_SCHEMA = {"type": "object", "required": ["id", "amount"],
                "properties": {"id": {"type": "integer"}, "amount": {"type": "number"}}}


def _validator(**config: Any) -> JsonSchemaValidator:
    plugin = load_interceptor("kiproxy.interceptors.builtin.json_schema:JsonSchemaValidator", None,
                              config)
    assert isinstance(plugin, JsonSchemaValidator)
    return plugin


def test_json_valid_batch_passes_unchanged() -> None:
    plugin = _validator(schemas={"orders": ORDER_SCHEMA})
    batch = _batch([b'{"id": 1, "amount": 9.5}', b'{"id": 2, "amount": 0}', None])
    assert plugin.intercept(batch, _ctx()) is batch


def test_json_non_json_and_schema_violations_name_the_record_index() -> None:
    plugin = _validator(schemas={"orders": ORDER_SCHEMA})
    batch = _batch([b'{"id": 1, "amount": 2}', b"not json", b'{"id": "x", "amount": 1}',
                    b'{"id": 3, "amount": 1}', b'{"id": 4}', b"\xff\xfe"])
    with pytest.raises(RejectBatch) as info:
        plugin.intercept(batch, _ctx())
    exc = info.value
    assert exc.error_code == 87  # INVALID_RECORD
    indices = [i for i, _ in exc.record_errors]
    assert indices == [1, 2, 4, 5]
    reasons = dict(exc.record_errors)
    assert reasons[1] is not None and "not JSON" in reasons[1]
    assert reasons[2] is not None and "schema violation at id" in reasons[2]
    assert reasons[2] is not None and 'is not of type "integer"' in reasons[2]
    assert reasons[4] == 'schema violation at (root): "amount" is a required property'
    assert reasons[5] is not None and "not JSON" in reasons[5]
    assert "4 record(s) of orders[1]" in exc.message and "record 1" in exc.message


def test_json_schema_is_per_topic() -> None:
    plugin = _validator(schemas={"orders": ORDER_SCHEMA, "tags": {"type": "array"}})
    tags = _batch([b'["a"]'], topic="tags")
    assert plugin.intercept(tags, _ctx()) is tags
    with pytest.raises(RejectBatch) as info:
        plugin.intercept(_batch([b'{"id": 1, "amount": 1}'], topic="tags"), _ctx())
    assert [i for i, _ in info.value.record_errors] == [0]
    with pytest.raises(RejectBatch):
        plugin.intercept(_batch([b'["a"]'], topic="orders"), _ctx())


def test_json_topic_without_schema_only_needs_json() -> None:
    plugin = _validator(schemas={"orders": ORDER_SCHEMA})
    other = _batch([b'"any json"', b"[1, 2]", b"null"], topic="logs")
    assert plugin.intercept(other, _ctx()) is other
    with pytest.raises(RejectBatch) as info:
        plugin.intercept(_batch([b"{}", b"plain text"], topic="logs"), _ctx())
    assert [i for i, _ in info.value.record_errors] == [1]


def test_json_require_schema_leaves_topics_without_one_alone() -> None:
    plugin = _validator(schemas={"orders": ORDER_SCHEMA}, require_schema=True)
    other = _batch([b"plain text"], topic="logs")
    assert plugin.intercept(other, _ctx()) is other
    with pytest.raises(RejectBatch):
        plugin.intercept(_batch([b"plain text"]), _ctx())


def test_json_default_schema_applies_to_other_topics() -> None:
    plugin = _validator(schemas={"orders": ORDER_SCHEMA}, default_schema={"type": "string"})
    ok = _batch([b'"text"'], topic="anything")
    assert plugin.intercept(ok, _ctx()) is ok
    with pytest.raises(RejectBatch):
        plugin.intercept(_batch([b"1"], topic="anything"), _ctx())


def test_json_schema_from_a_file(tmp_path: Path) -> None:
    schema = tmp_path / "order.schema.json"
    schema.write_text(json.dumps(ORDER_SCHEMA))
    plugin = _validator(schemas={"orders": str(schema)})
    with pytest.raises(RejectBatch):
        plugin.intercept(_batch([b'{"id": 1}']), _ctx())


def test_json_nulls_and_error_name() -> None:
    strict = _validator(schemas={"orders": ORDER_SCHEMA}, allow_null=False,
                        error="POLICY_VIOLATION")
    with pytest.raises(RejectBatch) as info:
        strict.intercept(_batch([b'{"id": 1, "amount": 1}', None]), _ctx())
    assert info.value.error_code == 44
    assert info.value.record_errors == ((1, "null value"),)


def test_json_reports_at_most_fifty_records() -> None:
    with pytest.raises(RejectBatch) as info:
        _validator().intercept(_batch([b"x"] * 80), _ctx())
    assert len(info.value.record_errors) == 50


def test_json_reason_names_the_path_and_counts_further_violations() -> None:
    plugin = _validator(default_schema={
        "type": "object", "required": ["id"],
        "properties": {"lines": {"type": "array", "items": {"type": "object", "properties": {
            "sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}}}}}})
    with pytest.raises(RejectBatch) as info:
        plugin.intercept(_batch([
            b'{"id": 1, "lines": [{"sku": "a", "qty": 1}, {"sku": "b", "qty": 0}]}',
            b'{"lines": [{"sku": 5}]}',
        ], topic="any"), _ctx())
    assert info.value.record_errors == (
        (0, "schema violation at lines/1/qty: 0 is less than the minimum of 1"),
        # The violation nearest the root is named first.
        (1, 'schema violation at (root): "id" is a required property (and 1 more)'),
    )


def test_json_nan_and_infinity_are_not_json() -> None:
    # Python's json reads them; JSON has no such values (and a schema engine sees null).
    plugin = _validator(default_schema={"type": "object"})
    with pytest.raises(RejectBatch) as info:
        plugin.intercept(_batch([b'{"x": NaN}', b'{"x": -Infinity}', b'{"x": 1.5}'],
                                topic="any"), _ctx())
    assert [(i, r.split(":")[0]) for i, r in info.value.record_errors] == [
        (0, "not JSON"), (1, "not JSON")]
    with pytest.raises(RejectBatch):  # also on topics that only need JSON
        _validator().intercept(_batch([b"NaN"], topic="any"), _ctx())


def test_json_lone_surrogate_is_a_record_error_not_a_crash() -> None:
    plugin = _validator(default_schema={"type": "string"})
    with pytest.raises(RejectBatch) as info:
        plugin.intercept(_batch([b'"ok"', b'"\\ud800"'], topic="any"), _ctx())
    [(index, reason)] = info.value.record_errors
    assert index == 1 and reason.startswith("not JSON")


def _standard_parse(value: bytes) -> Any:
    """``json`` on the UTF-8 text of ``value`` (no byte-order mark), without NaN,
    Infinity or a number that overflows to infinity."""
    def refuse(constant: str) -> None:
        raise ValueError(constant)

    def finite(text: str) -> float:
        if math.isinf(float(text)):
            raise ValueError(text)
        return float(text)
    if value.startswith(b"\xef\xbb\xbf"):
        raise ValueError("BOM")
    text = value.decode("utf-8")
    return json.JSONDecoder(parse_constant=refuse, parse_float=finite).decode(text)


def _verdict(parse: Any, value: bytes) -> tuple[str, Any]:
    try:
        return "ok", parse(value)
    except (ValueError, RecursionError):
        return "not JSON", None


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False)
    | st.text(),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner,
                                                                max_size=4),
    max_leaves=12)


@settings(max_examples=300, deadline=None)
@given(doc=_JSON, encoding=st.sampled_from(["utf-8", "utf-16-le", "utf-32-be", "utf-8-sig"]))
def test_json_parse_reads_every_json_document_as_json_does(doc: Any, encoding: str) -> None:
    value = json.dumps(doc, ensure_ascii=False).encode(encoding, "surrogatepass")
    assert _verdict(_parse, value) == _verdict(_standard_parse, value)


@settings(max_examples=300, deadline=None)
@given(value=st.binary(max_size=40) | st.sampled_from([
    b'{"x": NaN}', b"Infinity", b'"\\ud800"', b"[" * 1100 + b"]" * 1100, b"1e400",
    b'{"a": 1, "a": 2}', b"\xef\xbb\xbf{}", b'"\xed\xa0\x80"', b" 1 ", b"01"]))
def test_json_parse_accepts_and_refuses_what_json_does(value: bytes) -> None:
    assert _verdict(_parse, value) == _verdict(_standard_parse, value)


@pytest.mark.parametrize(("value", "reason"), [
    ('{"a": 1}'.encode("utf-16"), "not UTF-8 (invalid start byte at byte 0); JSON "
     "between systems is UTF-8 (RFC 8259), not UTF-16 or UTF-32"),
    ('{"a": "é"}'.encode("utf-16-be"), "not JSON"),
    ('{"a": 1}'.encode("utf-32"), "not UTF-8"),
    (b"\xef\xbb\xbf{}", "it starts with a byte-order mark"),
    (b'{"amount": 1e400}', "1e400 is beyond a double's range"),
    (b'{"amount": 1E+400}', "1E+400 is beyond a double's range"),
    (b'{"amount": ' + b"9" * 400 + b'.5}', "is beyond a double's range"),
    (b'{"amount": 1' + b"0" * 250 + b'e99}', "is beyond a double's range"),
    (b'{"a": "\xed\xa0\x80"}', "not UTF-8"),  # an encoded surrogate is not UTF-8
])
def test_json_that_is_not_utf_8_or_overflows_is_not_json(value: bytes, reason: str) -> None:
    """RFC 8259: JSON exchanged between systems is UTF-8; Python's json would read UTF-16
    and UTF-32 text, and 1e400 as infinity (a schema then saw null)."""
    plugin = _validator(default_schema={"type": "object"})
    with pytest.raises(RejectBatch) as caught:
        plugin.intercept(_batch([value], topic="any"), _ctx())
    ((_, message),) = caught.value.record_errors
    assert message is not None and message.startswith("not JSON: ") and reason in message


def test_json_format_is_an_annotation() -> None:
    # As with the Python jsonschema package before: format is not asserted (any draft).
    for draft in ("http://json-schema.org/draft-07/schema#",
                  "https://json-schema.org/draft/2020-12/schema"):
        plugin = _validator(default_schema={"$schema": draft, "type": "string",
                                            "format": "email"})
        batch = _batch([b'"not an address"'], topic="any")
        assert plugin.intercept(batch, _ctx()) is batch


@pytest.mark.parametrize(("config", "match"), [
    ({"schemas": {"orders": {"type": "no-such-type"}}}, "schemas.orders: invalid JSON Schema"),
    ({"schemas": {"orders": {"properties": {"id": {"minimum": "1"}}}}},
     "schemas.orders: invalid JSON Schema .at properties/id/minimum.: "),
    # $ref is never fetched: a schema that needs the network fails at start.
    ({"default_schema": {"$ref": "https://schemas.example.com/order.json"}},
     "default_schema: invalid JSON Schema: .*https://schemas.example.com/order.json"),
    ({"default_schema": {"$ref": "#/$defs/missing"}}, "default_schema: invalid JSON Schema"),
    ({"schemas": {"orders": "/nonexistent/schema.json"}}, "cannot read schema file"),
    ({"schemas": {"orders": 5}}, "a schema must be a mapping or a file path"),
    ({"schemas": ["orders"]}, "schemas: expected a mapping, got a list"),
    ({"error": "NOT_AN_ERROR"}, "NOT_AN_ERROR"),
])
def test_json_bad_config_fails_at_start(config: dict[str, Any], match: str) -> None:
    with pytest.raises(PluginLoadError, match=match):
        _validator(**config)


# ---------------------------------------------------------------------------- TopicRouter


def _router(routes: list[dict[str, Any]], **config: Any) -> TopicRouter:
    plugin = load_interceptor("kiproxy.interceptors.builtin.route:TopicRouter", PLUGINS,
                              {"routes": routes, **config})
    assert isinstance(plugin, TopicRouter)
    return plugin


ROUTES: list[dict[str, Any]] = [
    {"topic": "orders|payments",
     "interceptor": "kiproxy.interceptors.builtin.json_schema:JsonSchemaValidator",
     "config": {"schemas": {"orders": ORDER_SCHEMA}}},
    {"topic": "logs\\..*", "interceptor": "kiproxy.interceptors.builtin.uppercase:Uppercase"},
    {"topic": "logs\\.audit", "interceptor": "tp_reject:Reject"},  # shadowed by the route above
    {"topic": "shout-.*", "interceptor": "tp_package:Shout", "config": {"suffix": "!!"}},
]


def test_router_hands_each_topic_to_the_first_matching_route() -> None:
    router = _router(ROUTES)
    logs = router.intercept(_batch([b"a", None], topic="logs.app"), _ctx())
    assert isinstance(logs, RecordBatch)
    assert [r.value for r in logs.records] == [b"A", None]
    audit = router.intercept(_batch([b"b"], topic="logs.audit"), _ctx())
    assert isinstance(audit, RecordBatch)
    assert [r.value for r in audit.records] == [b"B"]  # first match wins, not tp_reject
    shout = router.intercept(_batch([b"hey"], topic="shout-x"), _ctx())
    assert isinstance(shout, RecordBatch)
    assert [r.value for r in shout.records] == [b"HEY!!"]  # plugin from the plugins dir
    with pytest.raises(RejectBatch):
        router.intercept(_batch([b"{}"], topic="orders"), _ctx())
    payments = _batch([b"{}"], topic="payments")  # JSON, no schema for payments
    assert router.intercept(payments, _ctx()) is payments


def test_router_matches_the_whole_topic_name() -> None:
    router = _router(ROUTES)
    for topic in ("orders-eu", "my-orders", "xlogs.app", "logs", "payments2"):
        batch = _batch([b"not json"], topic=topic)
        assert router.intercept(batch, _ctx()) is batch, topic


def test_router_unmatched_topics_pass_untouched() -> None:
    router = _router(ROUTES)
    batch = _batch([b"lower", None], topic="metrics")
    assert router.intercept(batch, _ctx()) is batch


async def test_router_returns_an_async_routes_awaitable() -> None:
    router = _router([{"topic": "slow", "interceptor": "tp_slow:SlowAsync",
                       "config": {"sleep_ms": 1}}])
    batch = _batch([b"a"], topic="slow")
    result = router.intercept(batch, _ctx())
    assert inspect.isawaitable(result)
    assert await result is batch


def test_router_close_closes_every_route(monkeypatch: pytest.MonkeyPatch) -> None:
    closed: list[str] = []
    router = _router(ROUTES)
    for _, plugin in router.routes:
        name = type(plugin).__name__
        monkeypatch.setattr(plugin, "close", lambda name=name: closed.append(name),
                            raising=False)
    router.close()
    assert closed == ["JsonSchemaValidator", "Uppercase", "Reject", "Shout"]


def test_router_uses_its_own_plugins_dir_setting(tmp_path: Path) -> None:
    (tmp_path / "tp_local.py").write_text(
        "from kiproxy.interceptors import ProduceRequestInterceptor\n\n\n"
        "class Local(ProduceRequestInterceptor):\n"
        "    def intercept(self, batch, ctx):\n"
        "        return batch.with_records(r.with_value(b'local') for r in batch.records)\n")
    router = _router([{"topic": ".*", "interceptor": "tp_local:Local"}],
                     plugins_dir=str(tmp_path))
    out = router.intercept(_batch([b"a"]), _ctx())
    assert isinstance(out, RecordBatch)
    assert [r.value for r in out.records] == [b"local"]


@pytest.mark.parametrize(("config", "match"), [
    ({}, "routes: required key is missing"),
    ({"routes": []}, r"routes: needs at least 1 item\(s\), got an empty list"),
    ({"routes": [{"interceptor": "uppercase"}]}, r"routes\[0\]\.topic: required key is missing"),
    ({"routes": [{"topic": "a"}]}, r"routes\[0\]\.interceptor: required key is missing"),
    ({"routes": [{"topic": "(", "interceptor": "uppercase"}]},
     r"routes\[0\]\.topic: '\(' is not a regular expression"),
    ({"routes": [{"topic": "a", "interceptor": "tp_no_such_plugin:X"}]}, "tp_no_such_plugin"),
    ({"routes": [{"topic": "a", "interceptor": "tp_bad_configure:BadConfigure"}]},
     "'limit' must be a positive integer"),
])
def test_router_bad_config_fails_at_start(config: dict[str, Any], match: str) -> None:
    with pytest.raises(PluginLoadError, match=match):
        load_interceptor("kiproxy.interceptors.builtin.route:TopicRouter", PLUGINS, config)
