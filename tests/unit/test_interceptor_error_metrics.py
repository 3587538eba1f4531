"""``kiproxy_interceptor_errors_total`` and ``kiproxy_interceptor_duration_seconds``, by
route, through the produce pipeline without sockets: every batch a plugin fault rejects is
counted under the fault's name, a wrong return type included, and the route names the
chain that failed."""

from __future__ import annotations

import asyncio
from typing import Any

from support.client import Client
from support.produce_requests import produce_frame

from kiproxy.interceptors import InterceptContext, ProduceRequestInterceptor, RecordBatch
from kiproxy.protocol.framing import parse_request_header
from kiproxy.protocol.records import Record, build_batch
from kiproxy.proxy.config.routes import MatchSettings
from kiproxy.proxy.observe.metrics import Metrics
from kiproxy.proxy.produce.pipeline import ProducePipeline
from kiproxy.proxy.routes.chain import LoadedLink
from kiproxy.proxy.routes.runtime import LoadedChain, LoadedRoutes
from kiproxy.proxy.routes.table import CompiledMatch, Route, RouteTable


class ReturnsNone(ProduceRequestInterceptor):
    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> Any:
        return None  # a wrong return type: the batch is rejected


class Raises(ProduceRequestInterceptor):
    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        raise ValueError("boom")


class UnencodableHeader(ProduceRequestInterceptor):
    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        return batch.with_records(Record(key=None, value=r.value, timestamp=r.timestamp,
                                         offset_delta=r.offset_delta,
                                         headers=[("\ud800", b"x")])  # not UTF-8
                                  for r in batch.records)


class Same(ProduceRequestInterceptor):
    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        return batch


def _frame() -> bytes:
    return produce_frame(build_batch(
        [Record(key=None, value=b"v%d" % i, timestamp=1) for i in range(3)],
        producer_id=7, producer_epoch=0, base_sequence=0))


def _produce(route_name: str, plugin: ProduceRequestInterceptor, metrics: Metrics,
             times: int = 1) -> None:
    route = Route(index=0, name=route_name, match=CompiledMatch.of(MatchSettings()), links=())
    chain = LoadedChain(route, (LoadedLink(type(plugin).__name__, plugin, 5.0),), ())
    pipeline = ProducePipeline(routes=LoadedRoutes(RouteTable([route]), {0: chain}),
                               metrics=metrics)
    frame = _frame()

    async def run() -> None:
        for _ in range(times):
            await pipeline.handle(Client(), parse_request_header(frame), frame,
                                  None)  # type: ignore[arg-type]

    asyncio.run(run())


def _errors(metrics: Metrics, reason: str, route: str) -> float:
    return metrics.registry.get_sample_value(
        "kiproxy_interceptor_errors_total", {"reason": reason, "route": route}) or 0.0


def test_a_wrong_return_type_is_counted_as_return_type_under_its_route() -> None:
    metrics = Metrics()
    _produce("payments", ReturnsNone(), metrics, times=3)
    assert _errors(metrics, "return_type", "payments") == 3


def test_records_that_cannot_be_encoded_are_counted_as_return_type() -> None:
    metrics = Metrics()
    _produce("payments", UnencodableHeader(), metrics)
    assert _errors(metrics, "return_type", "payments") == 1


def test_each_route_counts_its_own_faults_and_time() -> None:
    metrics = Metrics()
    _produce("orders", Raises(), metrics, times=2)
    _produce("audit", Same(), metrics, times=4)
    assert _errors(metrics, "raised", "orders") == 2
    assert _errors(metrics, "raised", "audit") == 0
    duration = "kiproxy_interceptor_duration_seconds_count"
    assert metrics.registry.get_sample_value(duration, {"route": "audit"}) == 4
