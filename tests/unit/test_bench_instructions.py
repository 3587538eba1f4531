"""bench.instructions: the answer it measures is a real Produce answer, left as it came."""

from __future__ import annotations

import support.bench  # noqa: F401 - bench/ is not an installed package: this makes it importable

from bench.instructions import CASES, _produce_answer
from kiproxy.protocol.framing import parse_response_header
from kiproxy.protocol.messages import ApiKey, parse_response
from kiproxy.proxy.brokers.addresses import rewrite_response_frame


def test_the_measured_answer_parses_and_names_no_endpoints() -> None:
    frame = _produce_answer(3)
    correlation_id, body = parse_response_header(frame, 1)
    answer = parse_response(ApiKey.PRODUCE, 11, frame, body)
    assert correlation_id == 7
    assert [p.index for t in answer.responses for p in t.partition_responses] == [0, 1, 2]
    assert answer.node_endpoints == ()
    # The case measures the path every such answer takes: scanned, forwarded as it came.
    seen: list[int] = []

    def advertise(node_id: int, host: str, port: int) -> tuple[str, int]:
        seen.append(node_id)
        return "proxy", port

    assert rewrite_response_frame(ApiKey.PRODUCE, 11, frame, advertise) is frame
    assert seen == []
    assert "produce answer" in CASES


def test_the_measured_answer_passes_the_pipelines_rewriter_as_it_came() -> None:
    from kiproxy.proxy.produce.pipeline import _node_rewriter

    frame = _produce_answer(3)
    rewrite = _node_rewriter(11, lambda node, host, port: ("proxy", port))
    assert rewrite is not None and rewrite(frame) is frame


def test_the_round_trip_case_carries_requests_through_a_proxy_connection() -> None:
    import asyncio

    from bench.round_trip import produce_frames, round_trips
    from kiproxy.protocol.framing import parse_request_header

    request, answer = produce_frames(11)
    header = parse_request_header(request)
    assert (header.api_key, header.api_version, header.client_id) == (0, 11, "bench")
    assert parse_response(ApiKey.PRODUCE, 11, b"\x00\x00\x00\x01" + answer, 5).responses

    async def trips() -> None:
        send = await round_trips()
        await asyncio.wait_for(send(5), 10)  # each waits for its answer through the proxy

    asyncio.run(trips())
    assert "round trip" in CASES
