"""The produce pipeline in observe mode, without sockets: the request is forwarded byte for
byte, whatever the rule or the proxy's own decoding would have done."""

from __future__ import annotations

import asyncio
from typing import Any

from support.client import Client
from support.produce_requests import produce_frame

from kiproxy.interceptors import (
    InterceptContext,
    ProduceRequestInterceptor,
    RecordBatch,
    RejectBatch,
)
from kiproxy.protocol.framing import parse_request_header
from kiproxy.protocol.records import Header, Record, build_batch
from kiproxy.proxy.config.routes import MatchSettings
from kiproxy.proxy.observe.metrics import Metrics
from kiproxy.proxy.produce.disposition import Forward
from kiproxy.proxy.produce.pipeline import ProducePipeline
from kiproxy.proxy.routes.chain import LoadedLink
from kiproxy.proxy.routes.runtime import LoadedChain, LoadedRoutes
from kiproxy.proxy.routes.table import CompiledMatch, Route, RouteTable


class Upper(ProduceRequestInterceptor):
    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        return batch.with_records(r.with_value((r.value or b"").upper()) for r in batch.records)


def _frame(corrupt: bool = False) -> bytes:
    batch = build_batch([Record(key=None, value=b"v%d" % i, timestamp=1) for i in range(3)],
                        producer_id=7, producer_epoch=0, base_sequence=0)
    if corrupt:  # a CRC that does not match: enforcing refuses it as CORRUPT_MESSAGE
        batch = batch[:-1] + bytes([batch[-1] ^ 0xFF])
    return produce_frame(batch)


class Refuse(ProduceRequestInterceptor):
    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        raise RejectBatch("no")


def _pipeline(observe: bool, metrics: Metrics,
              links: tuple[LoadedLink, ...] = (LoadedLink("upper", Upper(), 5.0),)
              ) -> ProducePipeline:
    route = Route(index=0, name="watch", match=CompiledMatch.of(MatchSettings()), links=(),
                  observe=observe)
    chain = LoadedChain(route, links, ())
    return ProducePipeline(routes=LoadedRoutes(RouteTable([route]), {0: chain}),
                           metrics=metrics, tallies=True)


def _handle(pipeline: ProducePipeline, frame: bytes) -> Forward:
    outcome = asyncio.run(pipeline.handle(Client(), parse_request_header(frame), frame,
                                          None))  # type: ignore[arg-type]
    assert isinstance(outcome, Forward)
    return outcome


def _sample(metrics: Metrics, name: str, **labels: str) -> float:
    return metrics.registry.get_sample_value(name, labels) or 0.0


def test_a_transforming_rule_in_observe_mode_forwards_the_request_as_it_came() -> None:
    frame, metrics = _frame(), Metrics()
    assert _handle(_pipeline(True, metrics), frame).frame == frame
    assert _handle(_pipeline(False, Metrics()), frame).frame != frame  # enforced: changed
    assert _sample(metrics, "kiproxy_would_transform_records_total", route="watch",
                   link="upper") == 3


def test_what_decoding_would_refuse_is_forwarded_as_received_in_observe_mode() -> None:
    frame, metrics = _frame(corrupt=True), Metrics()
    outcome = _handle(_pipeline(True, metrics), frame)
    assert outcome.frame == frame and outcome.produce is not None
    [tally] = outcome.produce
    assert (tally.outcome, tally.observed_outcome, tally.observed_link) == (
        "forwarded", "rejected", "(decode)")
    assert _sample(metrics, "kiproxy_would_reject_batches_total", route="watch",
                   link="(decode)", reason="corrupt") == 1


def test_the_first_link_that_would_refuse_is_the_one_named_in_observe_mode() -> None:
    """Link 0's index read as false, so the last link was named instead: in the tally,
    the would_reject metric's ``link`` label and the observed dead-letter copy."""
    metrics = Metrics()
    links = (LoadedLink("refuser", Refuse(), 5.0), LoadedLink("upper", Upper(), 5.0))
    outcome = _handle(_pipeline(True, metrics, links), _frame())
    assert outcome.produce is not None
    [tally] = outcome.produce
    assert (tally.observed_outcome, tally.observed_link) == ("rejected", "refuser")
    assert _sample(metrics, "kiproxy_would_reject_batches_total", route="watch",
                   link="refuser", reason="POLICY_VIOLATION") == 1


class _BadHeaderKey(ProduceRequestInterceptor):
    """Returns records whose header key cannot be encoded (a lone surrogate)."""

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        return batch.with_records(r.with_headers((Header("\ud800", b"x"),))
                                  for r in batch.records)


class _Sink:
    def __init__(self) -> None:
        self.copies: list[Any] = []

    def offer(self, copy: Any) -> None:
        self.copies.append(copy)


def test_a_partition_refused_for_unencodable_records_is_copied_to_the_dead_letter_topic(
        ) -> None:
    """The route copies every partition it refuses; this one was refused (INVALID_RECORD)
    and not copied."""
    route = Route(index=0, name="r", match=CompiledMatch.of(MatchSettings()), links=(),
                  dead_letter="refused")
    chain = LoadedChain(route, (LoadedLink("bad", _BadHeaderKey(), 5.0),), ())
    sink = _Sink()
    pipeline = ProducePipeline(routes=LoadedRoutes(RouteTable([route]), {0: chain}),
                               tallies=True, dead_letter=sink)  # type: ignore[arg-type]
    frame = _frame()
    outcome = asyncio.run(pipeline.handle(Client(), parse_request_header(frame), frame,
                                          None))  # type: ignore[arg-type]
    [tally] = outcome.produce or ()
    assert tally.outcome == "rejected"
    [copy] = sink.copies
    assert (copy.topic, copy.link, copy.error_name) == ("refused", "bad", "INVALID_RECORD")
    assert [r.value for r in copy.records] == [b"v0", b"v1", b"v2"]  # as the producer sent


def test_an_unencodable_refusal_of_a_chain_of_two_names_no_link() -> None:
    """A chain's records are encoded once every link has run, so which link returned
    what cannot be encoded is not known: the copy names none, rather than the first."""
    from kiproxy.interceptors.builtin.uppercase import Uppercase

    route = Route(index=0, name="r", match=CompiledMatch.of(MatchSettings()), links=(),
                  dead_letter="refused")
    chain = LoadedChain(route, (LoadedLink("first", Uppercase(), 5.0),
                                LoadedLink("bad", _BadHeaderKey(), 5.0)), ())
    sink = _Sink()
    pipeline = ProducePipeline(routes=LoadedRoutes(RouteTable([route]), {0: chain}),
                               tallies=True, dead_letter=sink)  # type: ignore[arg-type]
    frame = _frame()
    asyncio.run(pipeline.handle(Client(), parse_request_header(frame), frame,
                                None))  # type: ignore[arg-type]
    [copy] = sink.copies
    assert (copy.link, copy.error_name) == (None, "INVALID_RECORD")
    assert "cannot be encoded" in copy.reason
