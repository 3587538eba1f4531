"""Prometheus metrics: the proxy's counters, gauges and histograms, in a registry of their
own, and the collectors that read the limits' and plugins' own numbers at scrape time.

The metrics listener that serves them (``/metrics``, health checks, admin actions) is
:mod:`kiproxy.proxy.admin.http`.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Callable, Iterable, Iterator, Mapping
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from kiproxy.interceptors.api import MetricSample
from kiproxy.protocol.log_limit import RateLimitedLog

log = logging.getLogger("kiproxy.metrics")

__all__ = ["Metrics"]


class Metrics:
    """kiproxy's metrics, in a registry of their own (no process-global state)."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry()
        self.messages = Counter(
            "kiproxy_messages", "Kafka requests and responses carried, by direction and API",
            ["direction", "api"], registry=r)
        self.bytes = Counter(
            "kiproxy_bytes", "Bytes of Kafka requests and responses carried (without the "
            "length prefix), by direction and API", ["direction", "api"], registry=r)
        self.active_connections = Gauge(
            "kiproxy_active_connections", "Client connections open now", registry=r)
        self.connections = Counter(
            "kiproxy_connections", "Client connections accepted", registry=r)
        self.refused_connections = Counter(
            "kiproxy_refused_connections", "Client connections closed on accept because "
            "max_connections was reached", registry=r)
        self.produce_batches = Counter(
            "kiproxy_produce_batches", "Produced record batches by topic and outcome "
            "(forwarded, transformed, rejected, broker_error)", ["topic", "outcome"], registry=r)
        self.produce_records = Counter(
            "kiproxy_produce_records", "Produced records by topic and outcome",
            ["topic", "outcome"], registry=r)
        self.produce_bytes = Counter(
            "kiproxy_produce_bytes", "Produced record-batch bytes (as sent by the producer) "
            "by topic and outcome", ["topic", "outcome"], registry=r)
        self.fetch_batches = Counter(
            "kiproxy_fetch_batches", "Fetched record batches on topics with a fetch-side hook, "
            "by topic and outcome (unchanged, transformed, refused, legacy: old format, "
            "passed undecoded, deferred: left for the next fetch when the answer's hooks "
            "had their time)", ["topic", "outcome"], registry=r)
        self.fetch_records = Counter(
            "kiproxy_fetch_records", "Fetched records on topics with a fetch-side hook, by "
            "topic and outcome", ["topic", "outcome"], registry=r)
        self.interceptor_seconds = Histogram(
            "kiproxy_interceptor_duration_seconds", "Time the interceptor (a route's chain) "
            "took per batch, by route", ["route"],
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 0.5, 1.0, 2.5, 5.0, 10.0), registry=r)
        self.interceptor_errors = Counter(
            "kiproxy_interceptor_errors", "Batches rejected because of the plugin, by reason "
            "(raised, timeout, return_type, record_count, output_size, crashed) and route",
            ["reason", "route"], registry=r)
        self.upstream_errors = Counter(
            "kiproxy_upstream_connection_errors", "Failed or broken connections to brokers",
            ["kind"], registry=r)
        self.client_errors = Counter(
            "kiproxy_client_protocol_errors", "Client connections closed for malformed or "
            "oversized frames", registry=r)
        self.client_tls_failures = Counter(
            "kiproxy_client_tls_failures", "Client TLS handshakes the listeners refused, by "
            "OpenSSL's reason", ["reason"], registry=r)
        self.observer_errors = Counter(
            "kiproxy_observer_errors", "Observer calls that raised", ["observer"], registry=r)
        self.observer_dropped = Counter(
            "kiproxy_observer_dropped_events", "Events dropped because an observer's queue "
            "was full", ["observer"], registry=r)
        self.rejected_batches = Counter(
            "kiproxy_rejected_batches", "Record batches the proxy refused, by reason "
            "(interceptor, decompression_limit, corrupt, unsupported_compression, "
            "old_format, unknown_topic_id)", ["reason"], registry=r)
        self.route_batches = Counter(
            "kiproxy_route_batches", "Produced record batches a route handled, by route and "
            "outcome (forwarded, transformed, rejected, broker_error)", ["route", "outcome"],
            registry=r)
        self.route_records = Counter(
            "kiproxy_route_records", "Produced records a route handled, by route and outcome",
            ["route", "outcome"], registry=r)
        self.route_rejections = Counter(
            "kiproxy_route_rejections", "Topic-partition batches a route refused, by route and "
            "Kafka error name (POLICY_VIOLATION, INVALID_RECORD, ...)", ["route", "error"],
            registry=r)
        self.would_reject_batches = Counter(
            "kiproxy_would_reject_batches", "Batches a route or link in observe mode would "
            "have refused (they were forwarded), by route, link and reason (the Kafka error "
            "name, or the plugin fault)", ["route", "link", "reason"], registry=r)
        self.would_reject_records = Counter(
            "kiproxy_would_reject_records", "Records in the batches a route or link in observe "
            "mode would have refused, by route, link and reason", ["route", "link", "reason"],
            registry=r)
        self.would_transform_batches = Counter(
            "kiproxy_would_transform_batches", "Batches a route or link in observe mode would "
            "have changed (they were forwarded as received), by route and link",
            ["route", "link"], registry=r)
        self.would_transform_records = Counter(
            "kiproxy_would_transform_records", "Records in the batches a route or link in "
            "observe mode would have changed, by route and link", ["route", "link"], registry=r)
        self.sink_written = Counter(
            "kiproxy_sink_written", "Records a side-copy sink wrote, by sink (dead_letter, "
            "audit) and topic", ["sink", "topic"], registry=r)
        self.sink_dropped = Counter(
            "kiproxy_sink_dropped", "Records a side-copy sink did not write, by sink and reason "
            "(queue_full, topic_missing, not_authorized, refused, unavailable, closed)",
            ["sink", "reason"], registry=r)
        self.sink_queued_records = Gauge(
            "kiproxy_sink_queued_records", "Records waiting in a side-copy sink's queue now",
            ["sink"], registry=r)
        self.sink_queued_bytes = Gauge(
            "kiproxy_sink_queued_bytes", "Bytes (keys, values, headers) waiting in a side-copy "
            "sink's queue now", ["sink"], registry=r)
        self.request_latency = Histogram(
            "kiproxy_request_latency_seconds", "From reading a request to writing its "
            "response, by API", ["api"],
            buckets=(0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0, 10.0, 30.0), registry=r)
        self.config_reloads = Counter(
            "kiproxy_config_reloads", "Configuration reloads by result (ok, failed)",
            ["result"], registry=r)
        self.config_generation = Gauge(
            "kiproxy_config_generation", "The running configuration generation (1 at start, "
            "one more per applied reload)", registry=r)
        self.config_last_reload = Gauge(
            "kiproxy_config_last_reload_success_timestamp_seconds",
            "When the last reload was applied (Unix time; 0 before the first)", registry=r)
        self.admin_refused = Counter(
            "kiproxy_admin_refused", "Admin requests (POST /reload) refused, by reason "
            "(not_local, bad_token, no_token_file)", ["reason"], registry=r)
        self.config_generation.set(1)
        self._interceptors: _InterceptorCollector | None = None

    def watch_limits(self, hits: Callable[[], dict[str, int]],
                     used: Callable[[], dict[str, int]]) -> None:
        """Serve ``kiproxy_limit_hits_total{limit}`` and ``kiproxy_limit_used_bytes{limit}``
        from counters the limits keep themselves, read at scrape time."""
        self.registry.register(_LimitCollector(hits, used))

    def watch_interceptors(self, current: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        """Serve the running interceptors' own metrics (``metrics()``, see the plugin API's
        ``MetricSample``) as ``kiproxy_interceptor_<name>{interceptor=...}``, read at
        scrape time from ``current()``'s ``(name, interceptor)`` pairs."""
        self._interceptors = _InterceptorCollector(current)
        self.registry.register(self._interceptors)

    def interceptors_replaced(self, old: Iterable[tuple[str, Any]]) -> None:
        """A reload replaced these ``(name, interceptor)`` pairs: they go on counting
        until they close (requests they had still run), and their counters are then
        carried over (:meth:`interceptors_closed`)."""
        if self._interceptors is not None:
            self._interceptors.replaced(old)

    def interceptors_closed(self, old: Iterable[tuple[str, Any]]) -> None:
        """The replaced pairs are about to close: their counters' last values are added to
        those of the interceptors of the same name from now on, so that a plugin's counter
        goes on from its total across reloads instead of starting again at 0."""
        if self._interceptors is not None:
            self._interceptors.closed(old)

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)


class _LimitCollector(Collector):
    def __init__(self, hits: Callable[[], dict[str, int]],
                 used: Callable[[], dict[str, int]]) -> None:
        self._hits = hits
        self._used = used

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        hits = CounterMetricFamily(
            "kiproxy_limit_hits", "Times a resource limit held a client back or refused it: "
            "max_decode_memory (a decode waited for the budget), max_client_buffered_bytes "
            "(a connection's reads paused), max_frame_size (a client closed)",
            labels=["limit"])
        for name, value in self._hits().items():
            hits.add_metric([name], value)
        used = GaugeMetricFamily(
            "kiproxy_limit_used_bytes", "Bytes counted against a process-wide limit now",
            labels=["limit"])
        for name, value in self._used().items():
            used.add_metric([name], value)
        yield hits
        yield used


_Series = tuple[str, tuple[tuple[str, str], ...]]
"""A metric's name and its sorted label pairs."""


class _InterceptorCollector(Collector):
    """Plugins' ``MetricSample`` values as metric families; a failing plugin is skipped.

    A counter is a total: an instance a reload replaced is read with the current ones
    until it closes, and the last values of its counters are then kept and added to
    the same series (the same interceptor name and labels) for as long as an
    interceptor of that name runs. Gauges are what the running instances say now.
    """

    def __init__(self, current: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        self._current = current
        self._replaced: dict[int, tuple[str, Any]] = {}
        """Instances a reload replaced that have not closed: ``id`` -> (name, instance)."""
        self._carried: dict[_Series, tuple[str, float]] = {}
        """Closed instances' counter totals: series -> (help, value)."""

    def replaced(self, old: Iterable[tuple[str, Any]]) -> None:
        self._replaced = {**self._replaced, **{id(i): (n, i) for n, i in old}}

    def closed(self, old: Iterable[tuple[str, Any]]) -> None:
        carried, replaced = dict(self._carried), dict(self._replaced)
        for name, interceptor in old:
            replaced.pop(id(interceptor), None)
            for sample in _samples(name, interceptor):
                if sample.kind == "counter":
                    series = _series(name, sample)
                    help_text, value = carried.get(series, (sample.help, 0.0))
                    carried[series] = (help_text, value + float(sample.value))
        self._carried, self._replaced = carried, replaced

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        label_names: dict[str, list[str]] = {}
        values: dict[_Series, float] = {}

        def add(series: _Series, kind: str, help_text: str, value: float) -> None:
            metric, labels = series
            if metric not in families:
                family = CounterMetricFamily if kind == "counter" else GaugeMetricFamily
                label_names[metric] = [k for k, _ in labels]
                families[metric] = family(metric, help_text, labels=label_names[metric])
            values[series] = values.get(series, 0.0) + value

        current = list(self._current())
        names = {name for name, _ in current}
        running = {id(i) for _, i in current}
        replaced = [pair for key, pair in self._replaced.items() if key not in running]
        for name, interceptor in current:
            for sample in _samples(name, interceptor):
                add(_series(name, sample), sample.kind, sample.help, float(sample.value))
        for name, interceptor in replaced:
            for sample in _samples(name, interceptor):
                if sample.kind == "counter" and name in names:
                    add(_series(name, sample), "counter", sample.help, float(sample.value))
        for series, (help_text, value) in self._carried.items():
            if dict(series[1])["interceptor"] in names:
                add(series, "counter", help_text, value)
        for (metric, labels), value in values.items():
            if [k for k, _ in labels] == label_names[metric]:  # one label set per name
                families[metric].add_metric([v for _, v in labels], value)
        yield from families.values()


def _samples(name: str, interceptor: Any) -> list[Any]:
    """The ``MetricSample``s of ``interceptor`` (none when it has no ``metrics()`` or it
    fails: logged)."""
    collect = getattr(interceptor, "metrics", None)
    if collect is None:
        return []
    try:
        samples = list(collect())
    except Exception:
        log.exception("interceptor %s: metrics() failed", name)
        return []
    kept = []
    for sample in samples:
        wrong = _wrong(sample)
        if wrong is None:
            kept.append(sample)
            continue
        # A scrape every few seconds: said once per plugin per interval, the rest served.
        _refused_samples.warning(name, "interceptor %s: metrics() gave %s; left out of "
                                 "/metrics (give MetricSample(name, kind, help, labels, "
                                 "value))", name, wrong)
    return kept


_refused_samples = RateLimitedLog(log, 60.0)
# Prometheus' own rules: what would break /metrics for every scraper is left out, no
# more (the API asks for lower case; upper case still renders).
_METRIC_NAME = re.compile(r"[a-zA-Z_:][a-zA-Z0-9_:]*")
_LABEL_NAME = re.compile(r"[a-zA-Z_][a-zA-Z0-9_]*")


def _wrong(sample: Any) -> str | None:
    """What is wrong with one item a plugin's ``metrics()`` gave, or None."""
    if not isinstance(sample, MetricSample):
        return f"a {type(sample).__name__}, not a MetricSample"
    if not isinstance(sample.name, str) or not _METRIC_NAME.fullmatch(sample.name):
        return f"the metric name {sample.name!r} (Prometheus takes {_METRIC_NAME.pattern})"
    if not isinstance(sample.help, str):
        return f"the help {sample.help!r} for {sample.name} (a str)"
    if sample.kind not in ("counter", "gauge"):
        return f"the kind {sample.kind!r} for {sample.name} (counter or gauge)"
    labels = sample.labels
    if not isinstance(labels, Mapping) or not all(
            isinstance(k, str) and _LABEL_NAME.fullmatch(k) and isinstance(v, str)
            for k, v in labels.items()):
        return f"labels {labels!r} for {sample.name} (names {_LABEL_NAME.pattern}, values str)"
    try:
        float(sample.value)
    except (TypeError, ValueError):
        return f"the value {sample.value!r} for {sample.name} (a number)"
    return None


def _series(name: str, sample: Any) -> _Series:
    return (f"kiproxy_interceptor_{sample.name}",
            tuple(sorted({**sample.labels, "interceptor": name}.items())))
