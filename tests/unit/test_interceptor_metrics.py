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


class Tally(ProduceRequestInterceptor):
    """Counts what it is told to; its gauge says how many it holds now."""

    def __init__(self, seen: float, holding: float = 0.0, broken: bool = False) -> None:
        self.seen, self.holding, self.broken = seen, holding, broken

    def intercept(self, batch: RecordBatch, ctx: Any) -> RecordBatch:
        return batch

    def metrics(self) -> Iterable[MetricSample]:
        if self.broken:
            raise RuntimeError("closing")
        yield MetricSample(name="tally_seen", kind="counter", help="Seen", labels={},
                           value=self.seen)
        yield MetricSample(name="tally_holding", kind="gauge", help="Held", labels={},
                           value=self.holding)


def _value(metrics: Metrics, series: str) -> float | None:
    for line in metrics.render().decode().splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_a_replaced_instances_counters_are_carried_over_and_its_gauges_are_not() -> None:
    metrics = Metrics()
    old = Tally(5, holding=7)
    links: list[tuple[str, Any]] = [("tally", old)]
    metrics.watch_interceptors(lambda: links)
    seen = 'kiproxy_interceptor_tally_seen_total{interceptor="tally"}'
    holding = 'kiproxy_interceptor_tally_holding{interceptor="tally"}'
    assert _value(metrics, seen) == 5

    new = Tally(1, holding=2)
    links[:] = [("tally", new)]  # a reload: the old one still runs its last requests
    metrics.interceptors_replaced([("tally", old)])
    old.seen = 6
    assert _value(metrics, seen) == 7  # 1 + 6: the old instance is still read
    assert _value(metrics, holding) == 2  # a gauge is what the running instance says
    metrics.interceptors_closed([("tally", old)])
    old.seen = 100  # closed: no longer read
    assert _value(metrics, seen) == 7
    new.seen = 4
    assert _value(metrics, seen) == 10

    newer = Tally(0)  # a second reload carries both
    links[:] = [("tally", newer)]
    metrics.interceptors_replaced([("tally", new)])
    metrics.interceptors_closed([("tally", new)])
    assert _value(metrics, seen) == 10

    links.clear()  # a reload that drops the plugin drops its series
    assert _value(metrics, seen) is None


def test_an_instance_whose_metrics_fail_at_close_carries_nothing_and_breaks_nothing() -> None:
    metrics = Metrics()
    old, new = Tally(5, broken=True), Tally(2)
    links: list[tuple[str, Any]] = [("tally", new)]
    metrics.watch_interceptors(lambda: links)
    metrics.interceptors_replaced([("tally", old)])
    metrics.interceptors_closed([("tally", old)])
    assert _value(metrics, 'kiproxy_interceptor_tally_seen_total{interceptor="tally"}') == 2


class Careless(ProduceRequestInterceptor):
    """Gives what a plugin should not, beside one good sample."""

    def intercept(self, batch: RecordBatch, ctx: Any) -> RecordBatch:
        return batch

    def metrics(self) -> Iterable[Any]:
        yield {"name": "as_a_dict", "value": 1}
        yield "just a string"
        yield MetricSample(name="bad-name", kind="counter", help="x", labels={}, value=1)
        yield MetricSample(name="odd_kind", kind="histogram", help="x",  # type: ignore[arg-type]
                           labels={}, value=1)
        yield MetricSample(name="odd_labels", kind="gauge", help="x",
                           labels={"n": 3}, value=1)  # type: ignore[dict-item]
        yield MetricSample(name="odd_value", kind="gauge", help="x", labels={},
                           value="many")  # type: ignore[arg-type]
        yield MetricSample(name="fine", kind="gauge", help="Fine", labels={}, value=4)


def test_what_a_plugins_metrics_get_wrong_is_left_out_and_the_rest_is_served(
        caplog: Any) -> None:
    import logging

    metrics = Metrics()
    links: list[tuple[str, Any]] = [("careless", Careless()), ("counting", Counting())]
    metrics.watch_interceptors(lambda: links)
    with caplog.at_level(logging.WARNING, "kiproxy.metrics"):
        text = metrics.render().decode()
        metrics.render()  # scraped again: not said again
    assert 'kiproxy_interceptor_fine{interceptor="careless"} 4.0' in text
    assert ('kiproxy_interceptor_widgets_seen_total{colour="red",interceptor="counting"} 3.0'
            in text)
    for name in ("as_a_dict", "bad-name", "odd_kind", "odd_labels", "odd_value"):
        assert name not in text
    said = [r.getMessage() for r in caplog.records]
    assert len(said) == 1 and "interceptor careless: metrics() gave a dict" in said[0], said


def test_what_prometheus_takes_is_served_as_it_was() -> None:
    from decimal import Decimal

    class Loose(ProduceRequestInterceptor):
        def intercept(self, batch: RecordBatch, ctx: Any) -> RecordBatch:
            return batch

        def metrics(self) -> Iterable[MetricSample]:
            yield MetricSample(name="Seen_Upper", kind="gauge", help="h", labels={"A": "x"},
                               value=Decimal("2.5"))  # type: ignore[arg-type]

    metrics = Metrics()
    metrics.watch_interceptors(lambda: [("loose", Loose())])
    assert ('kiproxy_interceptor_Seen_Upper{A="x",interceptor="loose"} 2.5'
            in metrics.render().decode())
