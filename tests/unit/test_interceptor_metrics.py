"""A plugin's own metrics (``metrics()`` -> ``MetricSample``) on the proxy's /metrics."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from kiproxy.interceptors import MetricSample, ProduceRequestInterceptor, RecordBatch
from kiproxy.proxy.observe.metrics import Metrics


class Counting(ProduceRequestInterceptor):
    def intercept(self, batch: RecordBatch, ctx: Any) -> RecordBatch:
        return batch

    def metrics(self) -> Iterable[MetricSample]:
        yield MetricSample(name="widgets_seen", kind="counter", help="Widgets seen",
                           labels={"colour": "red"}, value=3)
        yield MetricSample(name="widgets_open", kind="gauge", help="Widgets open",
                           labels={}, value=2)


class Broken(ProduceRequestInterceptor):
    def intercept(self, batch: RecordBatch, ctx: Any) -> RecordBatch:
        return batch

    def metrics(self) -> Iterable[MetricSample]:
        raise RuntimeError("boom")


def test_plugin_metrics_are_served_with_the_interceptor_label() -> None:
    metrics = Metrics()
    links: list[tuple[str, Any]] = [("counting", Counting()), ("broken", Broken()),
                                    ("plain", object())]
    metrics.watch_interceptors(lambda: links)
    text = metrics.render().decode()
    assert ('kiproxy_interceptor_widgets_seen_total{colour="red",interceptor="counting"} 3.0'
            in text)
    assert 'kiproxy_interceptor_widgets_open{interceptor="counting"} 2.0' in text
    links.clear()  # a reload that dropped the plugin drops its metrics
    assert "widgets_seen" not in metrics.render().decode()
