"""Requests the proxy cannot carry are refused up front, with an error that says why.

A Produce version without a schema (v14+, negative), and a request whose answer
names brokers at a version the proxy cannot read, raise
:class:`kiproxy.protocol.errors.UnsupportedVersion` (the connection closes the client
with one warning, as a broker does for a version it cannot parse); a Produce
body cut short before ``acks`` raises a ProtocolError; the ApiVersions cut never
offers what would be refused.
"""

from __future__ import annotations

import asyncio
import typing
from typing import Any

import pytest
from kio.schema.errors import ErrorCode
from support.client import Client

from kiproxy.protocol.errors import ProtocolError, UnsupportedVersion
from kiproxy.protocol.framing import (
    encode_request_header,
    encode_response_header,
    parse_request_header,
    request_header_version,
)
from kiproxy.protocol.messages import ApiKey, parse_response, response_type, serialize
from kiproxy.protocol.produce_request import read_acks
from kiproxy.proxy.brokers.addresses import rewritable, rewrite_response_frame
from kiproxy.proxy.brokers.api_versions import PRODUCE_MAX_VERSION, cut_api_versions_frame
from kiproxy.proxy.config.model import ProxyConfig
from kiproxy.proxy.produce.disposition import Forward
from kiproxy.proxy.produce.pipeline import ProducePipeline
from kiproxy.proxy.server import ProxyServer

_Client = Client

def _handle(server: ProxyServer, api_key: int, api_version: int, body: bytes = b"",
            way: str = "dispatch") -> Any:
    """The dispatcher's decision; ``way="at_once"``: the one the connection asks for first
    (no coroutine), which must decide (or refuse) a request forwarded as opaque bytes
    exactly as ``dispatch`` does."""
    header_version = request_header_version(api_key, api_version) or 1
    frame = encode_request_header(api_key, api_version, 5, "unit", header_version) + body
    header = parse_request_header(frame)
    if way == "at_once":
        return server.dispatcher.at_once(_Client(), server.generation, header, frame)  # type: ignore[arg-type]
    return asyncio.run(server.dispatcher.dispatch(_Client(), server.generation, header, frame))  # type: ignore[arg-type]


WAYS = pytest.mark.parametrize("way", ["dispatch", "at_once"])


@pytest.fixture
def server() -> ProxyServer:
    return ProxyServer(ProxyConfig(upstream=["127.0.0.1:9"]))


# ------------------------------------------------------------------ Produce


@pytest.mark.parametrize("version", [PRODUCE_MAX_VERSION + 1, 99, -1])
def test_produce_at_a_version_without_a_schema_is_refused(server: ProxyServer,
                                                          version: int) -> None:
    with pytest.raises(UnsupportedVersion) as info:
        _handle(server, ApiKey.PRODUCE, version, b"\x00" * 20)
    assert str(info.value).startswith(f"Produce request v{version} refused")
    assert f"Produce v3-v{PRODUCE_MAX_VERSION}" in str(info.value)


def test_with_several_workers_produce_v13_is_neither_offered_nor_accepted() -> None:
    """v13 names topics by id, which a worker process may not have learned."""
    workers = ProxyServer(ProxyConfig(upstream=["127.0.0.1:9"], workers=2))
    with pytest.raises(UnsupportedVersion, match=r"Produce request v13 refused.*v3-v12"):
        _handle(workers, ApiKey.PRODUCE, 13, b"\x00" * 20)
    rewriter = workers.dispatcher.rewriter(workers.generation, parse_request_header(
        encode_request_header(ApiKey.API_VERSIONS, 3, 1, "unit", 2)))
    assert rewriter is not None and rewriter.keywords["produce_max"] == 12


def test_produce_at_a_known_version_is_still_forwarded(server: ProxyServer) -> None:
    # v9 (flexible): null transactional_id, acks 1, timeout 1000, no topics.
    outcome = _handle(server, ApiKey.PRODUCE, 9, b"\x00\x00\x01\x00\x00\x03\xe8\x01\x00")
    assert isinstance(outcome, Forward)
    assert outcome.expect_response


@pytest.mark.parametrize("body", [
    b"",  # nothing after the header
    b"\x85",  # transactional_id length varint cut after one byte
    b"\xff\xff\xff\xff\xff\x01",  # a varint longer than 5 bytes
    b"\x03ab",  # transactional_id "ab" but no acks after it
    b"\x03ab\x00",  # acks cut after one byte
])
def test_read_acks_of_a_flexible_body_cut_short_raises_protocol_error(body: bytes) -> None:
    frame = encode_request_header(ApiKey.PRODUCE, 10, 5, "unit", 2) + body
    offset = parse_request_header(frame).body_offset
    assert offset is not None
    with pytest.raises(ProtocolError, match="Produce request"):
        read_acks(frame, offset, flexible=True)


def test_read_acks_of_a_whole_flexible_body() -> None:
    frame = encode_request_header(ApiKey.PRODUCE, 10, 5, "unit", 2) + b"\x03ab\xff\xff"
    offset = parse_request_header(frame).body_offset
    assert offset is not None
    assert read_acks(frame, offset, flexible=True) == -1


def test_the_pipeline_refuses_without_a_server() -> None:
    pipeline = ProducePipeline(None, proxy_host="unit")
    frame = encode_request_header(ApiKey.PRODUCE, 99, 5, "unit", 1)
    with pytest.raises(UnsupportedVersion):
        asyncio.run(pipeline.handle(_Client(), parse_request_header(frame),  # type: ignore[arg-type]
                                    frame, None))


# ------------------------------------------------------------------ answers that name brokers


@pytest.mark.parametrize(("api_key", "version"), [
    (ApiKey.METADATA, 99), (ApiKey.METADATA, -1), (ApiKey.FIND_COORDINATOR, 99),
    (ApiKey.DESCRIBE_CLUSTER, 99), (ApiKey.FETCH, 99), (ApiKey.SHARE_FETCH, 0),
    (ApiKey.SHARE_ACKNOWLEDGE, 99),
])
@WAYS
def test_a_request_whose_answer_cannot_be_rewritten_is_refused(
        server: ProxyServer, api_key: int, version: int, way: str) -> None:
    assert not rewritable(api_key, version)
    with pytest.raises(UnsupportedVersion) as info:
        _handle(server, api_key, version, b"\x00" * 20, way)
    message = str(info.value)
    assert f"request v{version} refused" in message
    assert "broker addresses" in message and "it reads" in message


@pytest.mark.parametrize(("api_key", "version"), [
    (ApiKey.METADATA, 12), (ApiKey.FETCH, 3), (ApiKey.FETCH, 16), (ApiKey.DESCRIBE_CLUSTER, 0),
    (ApiKey.FIND_COORDINATOR, 6),
])
@WAYS
def test_requests_the_proxy_can_carry_are_forwarded(server: ProxyServer, api_key: int,
                                                    version: int, way: str) -> None:
    assert rewritable(api_key, version)
    forward = _handle(server, api_key, version, way=way)
    assert isinstance(forward, Forward) and forward.expect_response
    assert (forward.on_response is None) == (api_key == ApiKey.FETCH and version < 12)


@WAYS
@pytest.mark.parametrize("api_key", [32_000, 999, 7])  # 7: ControlledShutdown, brokers'
def test_a_request_with_an_api_key_the_proxy_has_no_schema_for_is_refused(
        server: ProxyServer, api_key: int, way: str) -> None:
    """ApiVersions never offers it; forwarded, the broker hung up on the connection and
    the proxy counted that as the broker failing."""
    assert rewritable(api_key, 0)  # its answer would name no broker: not the reason
    with pytest.raises(UnsupportedVersion, match=f"a request with API key {api_key} "
                       "refused: the proxy has no schema for that API"):
        _handle(server, api_key, 0, way=way)


def test_rewriting_a_response_at_an_unknown_version_raises_unsupported_version() -> None:
    with pytest.raises(UnsupportedVersion, match="Metadata response v99 has no schema"):
        rewrite_response_frame(ApiKey.METADATA, 99, b"\x00\x00\x00\x05" + b"\x00" * 20,
                               seen=lambda node_id, host, port: ("proxy", 1))


# ------------------------------------------------------------------ the ApiVersions cut


def test_the_cut_drops_versions_older_than_every_schema_when_answers_name_brokers() -> None:
    response_cls = response_type(ApiKey.API_VERSIONS, 0)
    entry_cls = typing.get_args(typing.get_type_hints(response_cls)["api_keys"])[0]
    offered = {ApiKey.PRODUCE: (0, 11), ApiKey.FETCH: (0, 17), ApiKey.METADATA: (0, 12),
               ApiKey.SHARE_FETCH: (0, 0), ApiKey.SHARE_ACKNOWLEDGE: (0, 1)}
    message = response_cls(error_code=ErrorCode.none, api_keys=tuple(
        entry_cls(api_key=k, min_version=lo, max_version=hi) for k, (lo, hi) in offered.items()))
    frame = encode_response_header(5, 0) + serialize(message)
    cut = parse_response(ApiKey.API_VERSIONS, 0, cut_api_versions_frame(0, frame), 4)
    got = {e.api_key: (e.min_version, e.max_version) for e in cut.api_keys}
    assert got == {
        ApiKey.PRODUCE: (0, 11),  # v0-v2 are answered by the proxy, never rewritten
        ApiKey.FETCH: (0, 17),  # v0-v3 name no brokers: forwarded untouched
        ApiKey.METADATA: (0, 12),
        ApiKey.SHARE_ACKNOWLEDGE: (1, 1),  # v0 would name brokers and has no schema
    }
    for key, (lo, hi) in got.items():
        assert all(rewritable(key, v) for v in range(lo, hi + 1)), key


@pytest.mark.parametrize("api_key", [ApiKey.API_VERSIONS, ApiKey.SASL_HANDSHAKE,
                                     ApiKey.SASL_AUTHENTICATE])
def test_requests_with_a_handler_of_their_own_are_left_to_dispatch(
        server: ProxyServer, api_key: int) -> None:
    assert _handle(server, api_key, 1, way="at_once") is None
