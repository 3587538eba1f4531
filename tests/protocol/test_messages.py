"""Messages through kio: every version of every message the proxy reads or rewrites
parses back to the value it was built from and re-serializes to the same bytes.

Instances come from hypothesis (``from_type`` on kio's schema dataclasses; kio
registers strategies for its primitive types), so optional, nullable and tagged
fields get exercised in every version. Hand-built messages then pin the fields the
proxy depends on: broker addresses and KIP-951 ``node_endpoints``.
"""

from __future__ import annotations

import dataclasses
import datetime
import struct
import sys
from typing import Any

import pytest
from fetch_responses import fetch_responses
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kio.schema.errors import ErrorCode
from kio.schema.index import schema_name_map
from kio.static.primitive import Records, i32Timedelta

from kiproxy.protocol.errors import MalformedMessage, UnsupportedVersion
from kiproxy.protocol.messages import (
    API_NAMES,
    ApiKey,
    api_name,
    parse_request,
    parse_response,
    request_type,
    response_tags,
    response_type,
    serialize,
)
from kiproxy.protocol.records import Record, build_batch, decode_batches

# kio registers strategies for its primitive types but leaves ``Records`` (a
# partition's record batches, opaque bytes to kio) without one. Arbitrary bytes are
# what kio sees; a couple of real batches make Produce and Fetch messages realistic.
_SAMPLE_BATCHES = [
    build_batch([Record(key=b"k", value=b"v", headers=[("h", None)], timestamp=1)]),
    build_batch([Record(value=b"x" * 100, timestamp=2)] * 3, producer_id=5, producer_epoch=0,
                base_sequence=0),
]
st.register_type_strategy(
    Records, st.one_of(st.binary(max_size=40), st.sampled_from(_SAMPLE_BATCHES)).map(Records)
)

EXAMPLES = settings(
    max_examples=8, deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)

API_KEYS = {
    "api_versions": ApiKey.API_VERSIONS,
    "metadata": ApiKey.METADATA,
    "find_coordinator": ApiKey.FIND_COORDINATOR,
    "describe_cluster": ApiKey.DESCRIBE_CLUSTER,
    "produce": ApiKey.PRODUCE,
    "fetch": ApiKey.FETCH,
    "share_fetch": ApiKey.SHARE_FETCH,
    "share_acknowledge": ApiKey.SHARE_ACKNOWLEDGE,
}
BOTH_DIRECTIONS = ("api_versions", "metadata", "find_coordinator", "describe_cluster", "produce")
RESPONSES_ONLY = ("fetch", "share_fetch", "share_acknowledge")


def versions(name: str) -> list[int]:
    """Every version kio ships a schema for."""
    return sorted(schema_name_map[name])


def _cases() -> list[Any]:
    out = []
    for name in BOTH_DIRECTIONS + RESPONSES_ONLY:
        for version in versions(name):
            kinds = ("response",) if name in RESPONSES_ONLY else ("request", "response")
            for kind in kinds:
                out.append(pytest.param(kind, API_KEYS[name], version,
                                        id=f"{name}-v{version}-{kind}"))
    return out


def _type(kind: str, api_key: int, api_version: int) -> Any:
    return (request_type if kind == "request" else response_type)(api_key, api_version)


def _parse(kind: str, api_key: int, api_version: int, data: bytes, offset: int = 0) -> Any:
    parse = parse_request if kind == "request" else parse_response
    return parse(api_key, api_version, data, offset)


def _nested(message_type: Any, name: str) -> Any:
    """A nested entity class of a kio message (they live in the message's module)."""
    return getattr(sys.modules[message_type.__module__], name)


def round_trip(kind: str, api_key: int, api_version: int, message: Any) -> tuple[bytes, Any]:
    """Serialize, parse, re-serialize; assert both equalities; return (bytes, parsed)."""
    data = serialize(message)
    parsed = _parse(kind, api_key, api_version, data)
    assert parsed == message
    assert serialize(parsed) == data
    return data, parsed


# ------------------------------------------------------------- every version


def test_kio_covers_the_versions_the_proxy_needs() -> None:
    assert set(range(3, 14)) <= set(versions("produce"))
    assert set(range(0, 5)) <= set(versions("api_versions"))
    assert set(range(0, 13)) <= set(versions("metadata"))
    assert set(range(0, 7)) <= set(versions("find_coordinator"))
    assert set(range(0, 2)) <= set(versions("describe_cluster"))
    assert set(range(16, 18)) <= set(versions("fetch"))


@pytest.mark.parametrize(("kind", "api_key", "api_version"), _cases())
@EXAMPLES
@given(data=st.data())
def test_every_version_round_trips(kind: str, api_key: int, api_version: int,
                                   data: st.DataObject) -> None:
    message_type = _type(kind, api_key, api_version)
    assert message_type.__api_key__ == api_key
    assert message_type.__version__ == api_version
    message = data.draw(st.from_type(message_type))

    body, _ = round_trip(kind, api_key, api_version, message)
    # The body may follow a header: parsing from an offset reads the same message.
    prefix = b"\x00\x00\x00\x2a\x00"
    assert _parse(kind, api_key, api_version, prefix + body, len(prefix)) == message


# ------------------------------------------------------------- broker addresses

ENDPOINTS = [(111, "broker-111.internal", 9092, "rack-a"), (2, "10.0.0.2", 19092, None)]


@pytest.mark.parametrize(
    ("api_key", "api_version"),
    [(ApiKey.PRODUCE, v) for v in versions("produce") if v >= 10]
    + [(ApiKey.FETCH, v) for v in versions("fetch") if v >= 16]
    + [(ApiKey.SHARE_FETCH, v) for v in versions("share_fetch")]
    + [(ApiKey.SHARE_ACKNOWLEDGE, v) for v in versions("share_acknowledge")],
)
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_node_endpoints_round_trip(api_key: int, api_version: int, data: st.DataObject) -> None:
    message_type = response_type(api_key, api_version)
    node_endpoint = _nested(message_type, "NodeEndpoint")
    endpoints = tuple(node_endpoint(node_id=n, host=h, port=p, rack=r) for n, h, p, r in ENDPOINTS)
    message = dataclasses.replace(data.draw(st.from_type(message_type)), node_endpoints=endpoints)

    body, parsed = round_trip("response", api_key, api_version, message)
    assert [(e.node_id, e.host, e.port, e.rack) for e in parsed.node_endpoints] == ENDPOINTS
    assert b"broker-111.internal" in body

    # Rewriting the addresses (what the proxy does) changes exactly those fields.
    rewritten = dataclasses.replace(
        parsed, node_endpoints=tuple(dataclasses.replace(e, host="proxy", port=30000 + e.node_id)
                                     for e in parsed.node_endpoints))
    _, reparsed = round_trip("response", api_key, api_version, rewritten)
    assert [(e.host, e.port) for e in reparsed.node_endpoints] == [("proxy", 30111),
                                                                     ("proxy", 30002)]
    assert b"broker-111.internal" not in serialize(rewritten)


_TAGGED_ENDPOINTS = ([(ApiKey.PRODUCE, v) for v in versions("produce") if v >= 10]
                     + [(ApiKey.FETCH, v) for v in versions("fetch") if v >= 16])


@pytest.mark.parametrize(("api_key", "api_version"), _TAGGED_ENDPOINTS)
@settings(max_examples=12, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_response_tags_name_the_tagged_fields_a_full_parse_finds(
        api_key: int, api_version: int, data: st.DataObject) -> None:
    message = data.draw(st.from_type(response_type(api_key, api_version)))
    if data.draw(st.booleans()):
        message = dataclasses.replace(message, node_endpoints=())
    body = serialize(message)
    tags = response_tags(api_key, api_version, body)
    assert (0 in tags) == bool(parse_response(api_key, api_version, body).node_endpoints)
    # What a full parse refuses, the scan refuses too.
    with pytest.raises(MalformedMessage):
        response_tags(api_key, api_version, body + b"\x00")
    with pytest.raises(MalformedMessage):
        response_tags(api_key, api_version, body[:-1])


@pytest.mark.parametrize(("api_key", "api_version"), _TAGGED_ENDPOINTS)
@settings(max_examples=3, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(data=st.data())
def test_an_answer_without_node_endpoints_is_forwarded_as_it_came(
        api_key: int, api_version: int, data: st.DataObject) -> None:
    from kiproxy.proxy.brokers.addresses import rewrite_response_frame

    message_type = response_type(api_key, api_version)
    message = data.draw(st.from_type(message_type))
    header = struct.pack(">i", 7) + b"\x00"  # correlation id, no tagged fields (header v1)
    plain = header + serialize(dataclasses.replace(message, node_endpoints=()))
    seen: list[int] = []

    def advertise(node_id: int, host: str, port: int) -> tuple[str, int]:
        seen.append(node_id)
        return "proxy", 30000 + node_id

    assert rewrite_response_frame(api_key, api_version, plain, advertise) is plain
    endpoint = _nested(message_type, "NodeEndpoint")
    named = header + serialize(dataclasses.replace(message, node_endpoints=tuple(
        endpoint(node_id=n, host=h, port=p, rack=r) for n, h, p, r in ENDPOINTS)))
    out = rewrite_response_frame(api_key, api_version, named, advertise)
    assert seen == [111, 2]
    assert b"broker-111.internal" not in out
    assert [(e.host, e.port) for e in parse_response(api_key, api_version, out, 5)
            .node_endpoints] == [("proxy", 30111), ("proxy", 30002)]
    with pytest.raises(MalformedMessage):
        rewrite_response_frame(api_key, api_version, plain[:-2], advertise)


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(case=fetch_responses(versions=(16, 17, 18)))
def test_fetch_endpoints_are_rewritten_without_building_the_topics(
        case: tuple[int, Any]) -> None:
    # the bytes a full parse, rewrite and write give, with endpoints, without, or empty
    from kiproxy.proxy.brokers.addresses import rewrite_message, rewrite_response_frame

    api_version, message = case
    header = struct.pack(">i", 7) + b"\x00"  # correlation id, no tagged fields
    frame = header + serialize(message)

    def advertise(node_id: int, host: str, port: int) -> tuple[str, int]:
        return "proxy", 30000 + node_id % 1000

    whole = parse_response(ApiKey.FETCH, api_version, frame, len(header))
    expected = header + serialize(rewrite_message(ApiKey.FETCH, whole, advertise))
    out = rewrite_response_frame(ApiKey.FETCH, api_version, frame, advertise)
    assert out == expected
    empty = header + serialize(dataclasses.replace(message, node_endpoints=()))
    assert rewrite_response_frame(ApiKey.FETCH, api_version, empty, advertise) is empty


@pytest.mark.parametrize("api_version", versions("metadata"))
@settings(max_examples=4, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_metadata_brokers(api_version: int, data: st.DataObject) -> None:
    message_type = response_type(ApiKey.METADATA, api_version)
    broker = _nested(message_type, "MetadataResponseBroker")
    has_rack = "rack" in {f.name for f in dataclasses.fields(broker)}  # v1+
    brokers = tuple(broker(node_id=n, host=h, port=p, **({"rack": r} if has_rack else {}))
                    for n, h, p, r in ENDPOINTS)
    message = dataclasses.replace(data.draw(st.from_type(message_type)), brokers=brokers)
    _, parsed = round_trip("response", ApiKey.METADATA, api_version, message)
    assert [(b.node_id, b.host, b.port) for b in parsed.brokers] == [e[:3] for e in ENDPOINTS]
    if has_rack:
        assert [b.rack for b in parsed.brokers] == [e[3] for e in ENDPOINTS]


@pytest.mark.parametrize("api_version", versions("find_coordinator"))
def test_find_coordinator_addresses(api_version: int) -> None:
    message_type = response_type(ApiKey.FIND_COORDINATOR, api_version)
    throttle = i32Timedelta.parse(datetime.timedelta(milliseconds=0))
    if api_version < 4:
        # v0-v3 name one coordinator at the top level.
        kwargs: dict[str, Any] = {"error_code": ErrorCode.none, "node_id": 111,
                                  "host": "broker-111.internal", "port": 9092}
        if api_version >= 1:
            kwargs.update(throttle_time=throttle, error_message=None)
        _, parsed = round_trip("response", ApiKey.FIND_COORDINATOR, api_version,
                               message_type(**kwargs))
        assert (parsed.node_id, parsed.host, parsed.port) == (111, "broker-111.internal", 9092)
    else:
        # v4+ answer a list of coordinators, one per key.
        coordinator = _nested(message_type, "Coordinator")
        coordinators = tuple(
            coordinator(key=f"group-{n}", node_id=n, host=h, port=p, error_code=ErrorCode.none,
                        error_message=None)
            for n, h, p, _r in ENDPOINTS)
        _, parsed = round_trip("response", ApiKey.FIND_COORDINATOR, api_version,
                               message_type(throttle_time=throttle, coordinators=coordinators))
        assert [(c.node_id, c.host, c.port) for c in parsed.coordinators] == [
            e[:3] for e in ENDPOINTS]


@pytest.mark.parametrize("api_version", versions("describe_cluster"))
@settings(max_examples=4, deadline=None)
@given(data=st.data())
def test_describe_cluster_brokers(api_version: int, data: st.DataObject) -> None:
    message_type = response_type(ApiKey.DESCRIBE_CLUSTER, api_version)
    broker = _nested(message_type, "DescribeClusterBroker")
    # Later versions add fields (is_fenced); draw them and pin the address fields.
    brokers = tuple(dataclasses.replace(data.draw(st.from_type(broker)), broker_id=n, host=h,
                                        port=p, rack=r)
                    for n, h, p, r in ENDPOINTS)
    message = dataclasses.replace(data.draw(st.from_type(message_type)), brokers=brokers)
    _, parsed = round_trip("response", ApiKey.DESCRIBE_CLUSTER, api_version, message)
    assert [(b.broker_id, b.host, b.port, b.rack) for b in parsed.brokers] == ENDPOINTS


# ------------------------------------------------------------- produce and api versions


@pytest.mark.parametrize("api_version", [v for v in versions("produce") if v < 13])
def test_produce_request_carries_record_batches_untouched(api_version: int) -> None:
    message_type = request_type(ApiKey.PRODUCE, api_version)
    topic_data = _nested(message_type, "TopicProduceData")
    partition_data = _nested(message_type, "PartitionProduceData")
    records = _SAMPLE_BATCHES[0] + _SAMPLE_BATCHES[1]
    message = message_type(
        transactional_id=None, acks=-1,
        timeout=i32Timedelta.parse(datetime.timedelta(milliseconds=30_000)),
        topic_data=(topic_data(name="orders", partition_data=(
            partition_data(index=0, records=Records(records)),
            partition_data(index=1, records=None),
        )),),
    )
    body, parsed = round_trip("request", ApiKey.PRODUCE, api_version, message)
    assert body.count(records) == 1
    [topic] = parsed.topic_data
    assert topic.name == "orders"
    first, second = topic.partition_data
    assert first.records == records
    assert second.records is None
    assert [len(b.records) for b in decode_batches(first.records)] == [1, 3]


@pytest.mark.parametrize("api_version", versions("api_versions"))
def test_api_versions_response_with_unsupported_version_error(api_version: int) -> None:
    message_type = response_type(ApiKey.API_VERSIONS, api_version)
    api_version_entry = _nested(message_type, "ApiVersion")
    keys = (api_version_entry(api_key=0, min_version=0, max_version=11),
            api_version_entry(api_key=18, min_version=0, max_version=4))
    kwargs: dict[str, Any] = {"error_code": ErrorCode.unsupported_version, "api_keys": keys}
    if api_version >= 1:
        kwargs["throttle_time"] = i32Timedelta.parse(datetime.timedelta(0))
    _, parsed = round_trip("response", ApiKey.API_VERSIONS, api_version, message_type(**kwargs))
    assert parsed.error_code == ErrorCode.unsupported_version == 35
    assert [(k.api_key, k.min_version, k.max_version) for k in parsed.api_keys] == [
        (0, 0, 11), (18, 0, 4)]


def test_api_versions_v0_response_bytes() -> None:
    message_type = response_type(ApiKey.API_VERSIONS, 0)
    entry = _nested(message_type, "ApiVersion")
    message = message_type(error_code=ErrorCode.unsupported_version,
                           api_keys=(entry(api_key=18, min_version=0, max_version=3),))
    assert serialize(message) == struct.pack(">hi hhh".replace(" ", ""), 35, 1, 18, 0, 3)


# ------------------------------------------------------------- refusals


def test_unknown_versions_are_unsupported() -> None:
    with pytest.raises(UnsupportedVersion, match="Produce request v2"):
        request_type(ApiKey.PRODUCE, 2)
    with pytest.raises(UnsupportedVersion, match="Metadata response v999"):
        response_type(ApiKey.METADATA, 999)
    with pytest.raises(UnsupportedVersion):
        parse_request(32_000, 0, b"")


def test_trailing_bytes_after_a_body_are_malformed() -> None:
    body = serialize(response_type(ApiKey.API_VERSIONS, 0)(error_code=ErrorCode.none,
                                                           api_keys=()))
    assert parse_response(ApiKey.API_VERSIONS, 0, body).api_keys == ()
    with pytest.raises(MalformedMessage, match="1 unread bytes"):
        parse_response(ApiKey.API_VERSIONS, 0, body + b"\x00")


@pytest.mark.parametrize("cut", [1, 3, 6])
def test_truncated_body_is_malformed(cut: int) -> None:
    message_type = response_type(ApiKey.API_VERSIONS, 0)
    entry = _nested(message_type, "ApiVersion")
    body = serialize(message_type(error_code=ErrorCode.none,
                                  api_keys=(entry(api_key=0, min_version=3, max_version=9),)))
    with pytest.raises(MalformedMessage, match="ApiVersions response v0"):
        parse_response(ApiKey.API_VERSIONS, 0, body[:-cut])


# A null is length -1 (int32/int16) or compact length 0. Kafka's schemas say per
# version which fields may be null (nullableVersions); kio's types mirror them as
# ``X | None``. kio's reader hands back None for any null array, so the parser refuses
# one where the schema does not allow it, naming the field as Kafka's parsers do.


def test_a_null_in_a_nullable_field_is_accepted() -> None:
    # Metadata v1+ topics: null asks for every topic (nullableVersions 1+).
    assert parse_request(ApiKey.METADATA, 1, struct.pack(">i", -1)).topics is None
    # The same field, flexible: compact null; then three bools and no tagged fields.
    assert parse_request(ApiKey.METADATA, 9, b"\x00\x01\x00\x00\x00").topics is None
    # Produce transactional_id (a nullable string) with empty topic_data.
    produce = parse_request(ApiKey.PRODUCE, 3, struct.pack(">hhii", -1, 1, 1000, 0))
    assert produce.transactional_id is None
    assert produce.topic_data == ()


@pytest.mark.parametrize(("kind", "api_key", "api_version", "body", "field"), [
    # Metadata v0 topics: not nullable before v1, the same bytes as above.
    ("request", ApiKey.METADATA, 0, struct.pack(">i", -1), "MetadataRequest.topics"),
    ("request", ApiKey.PRODUCE, 3, struct.pack(">hhii", -1, 1, 1000, -1),
     "ProduceRequest.topic_data"),
    ("request", ApiKey.PRODUCE, 9, b"\x00\x00\x01\x00\x00\x03\xe8\x00\x00",
     "ProduceRequest.topic_data"),
    ("request", ApiKey.FIND_COORDINATOR, 4, b"\x00\x02\x00\x00",
     "an element of FindCoordinatorRequest.coordinator_keys"),
    ("response", ApiKey.METADATA, 1, struct.pack(">iii", -1, 1, 0),
     "MetadataResponse.brokers"),
    ("response", ApiKey.API_VERSIONS, 0, struct.pack(">hi", 0, -1),
     "ApiVersionsResponse.api_keys"),
    # A tagged field (node_endpoints, tag 0) is no more nullable than a plain one.
    ("response", ApiKey.PRODUCE, 10, b"\x01\x00\x00\x00\x00" + b"\x01\x00\x01\x00",
     "ProduceResponse.node_endpoints"),
], ids=["metadata-v0-request", "produce-v3-request", "produce-v9-request",
        "find-coordinator-v4-request-element", "metadata-v1-response",
        "api-versions-v0-response", "produce-v10-response-tagged"])
def test_a_null_in_a_non_nullable_field_is_refused(kind: str, api_key: int, api_version: int,
                                                   body: bytes, field: str) -> None:
    name = api_name(api_key)
    with pytest.raises(MalformedMessage) as info:
        _parse(kind, api_key, api_version, body)
    assert str(info.value).startswith(f"{name} {kind} v{api_version} does not parse")
    assert f"non-nullable field {field} was serialized as null" in str(info.value)


def test_api_names() -> None:
    assert api_name(ApiKey.PRODUCE) == "Produce"
    assert api_name(ApiKey.API_VERSIONS) == "ApiVersions"
    assert api_name(ApiKey.FIND_COORDINATOR) == "FindCoordinator"
    assert api_name(31_999) == "ApiKey(31999)"
    assert API_NAMES[ApiKey.METADATA] == "Metadata"
