"""Prometheus metrics, and the HTTP endpoint serving them with health checks.

``--metrics-listen HOST:PORT`` serves:

* ``/metrics`` - Prometheus text format (the metric names are listed in the README);
* ``/healthz`` - 200 while the process runs its event loop;
* ``/readyz`` - 200 when the interceptor is loaded and an upstream broker
  accepts a TCP connection, 503 with the reason otherwise;
* ``/livez`` - the same as ``/healthz`` (the Kubernetes name);
* ``POST /reload`` - reload the configuration (an admin action: see
  :mod:`proxy.observe.admin` for who may call it; others get 401 or 403):
  200 with the outcome as JSON when it was applied, 409 when it was refused
  (a setting that needs a restart), 500 when building it failed; the running
  configuration is unchanged unless the answer says ``"ok": true``;
* ``/config`` - the running configuration as JSON, secrets redacted, with its
  generation and hash.

The endpoint is a small HTTP/1.0 responder on the proxy's own event loop, so a
scrape costs no thread and a wedged loop shows up as a failing ``/healthz``.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
from collections.abc import Awaitable, Callable, Iterable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.exposition import CONTENT_TYPE_LATEST
from prometheus_client.registry import Collector

from kiproxy.proxy.observe.admin import AdminGuard

log = logging.getLogger("kiproxy.metrics")

__all__ = ["HealthServer", "Metrics"]


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
        self.interceptor_seconds = Histogram(
            "kiproxy_interceptor_duration_seconds", "Time the interceptor took per batch",
            buckets=(0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1,
                     0.25, 0.5, 1.0, 2.5, 5.0, 10.0), registry=r)
        self.interceptor_errors = Counter(
            "kiproxy_interceptor_errors", "Batches rejected because the interceptor raised, "
            "timed out or broke the record-count rule", ["reason"], registry=r)
        self.upstream_errors = Counter(
            "kiproxy_upstream_connection_errors", "Failed or broken connections to brokers",
            ["kind"], registry=r)
        self.client_errors = Counter(
            "kiproxy_client_protocol_errors", "Client connections closed for malformed or "
            "oversized frames", registry=r)
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
        self.dead_letter_written = Counter(
            "kiproxy_dead_letter_written", "Refused records copied to a dead-letter topic, by "
            "that topic", ["topic"], registry=r)
        self.dead_letter_dropped = Counter(
            "kiproxy_dead_letter_dropped", "Refused records not copied to their dead-letter "
            "topic, by reason (queue_full, topic_missing, not_authorized, refused, "
            "unavailable, closed)", ["reason"], registry=r)
        self.dead_letter_queued = Gauge(
            "kiproxy_dead_letter_queued_records", "Records waiting to be copied to a "
            "dead-letter topic now", registry=r)
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

    def watch_limits(self, hits: Callable[[], dict[str, int]],
                     used: Callable[[], dict[str, int]]) -> None:
        """Serve ``kiproxy_limit_hits_total{limit}`` and ``kiproxy_limit_used_bytes{limit}``
        from counters the limits keep themselves, read at scrape time."""
        self.registry.register(_LimitCollector(hits, used))

    def watch_interceptors(self, current: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        """Serve the running interceptors' own metrics (``metrics()``, see the plugin API's
        ``MetricSample``) as ``kiproxy_interceptor_<name>{interceptor=...}``, read at
        scrape time from ``current()``'s ``(name, interceptor)`` pairs."""
        self.registry.register(_InterceptorCollector(current))

    def render(self) -> bytes:
        """The registry in Prometheus text format."""
        return generate_latest(self.registry)


ReadinessCheck = Callable[[], Awaitable[str | None]]
"""Returns ``None`` when ready, else the reason it is not."""

ReloadAction = Callable[[str], Awaitable[tuple[int, dict[str, Any]]]]
"""Runs a reload (given the request's query string); returns the HTTP status and the
JSON answer."""

ConfigView = Callable[[], dict[str, Any]]
"""The running configuration, redacted, for ``/config``."""


class HealthServer:
    """Serves ``/metrics``, ``/healthz``, ``/readyz``, ``/config`` and ``/reload``."""

    def __init__(self, metrics: Metrics, ready: ReadinessCheck,
                 reload: ReloadAction | None = None, config: ConfigView | None = None,
                 guard: AdminGuard | None = None) -> None:
        self.metrics = metrics
        self.guard = guard or AdminGuard(None, metrics.admin_refused)
        self._ready = ready
        self._reload = reload
        self._config = config
        self._server: asyncio.Server | None = None
        self.started_at = time.time()

    async def start(self, host: str, port: int) -> None:
        """Open the listener."""
        self._server = await asyncio.start_server(self._serve, host, port, reuse_address=True)

    @property
    def address(self) -> str:
        """``host:port`` actually listened on."""
        assert self._server is not None
        host, port = self._server.sockets[0].getsockname()[:2]
        return f"{host}:{port}"

    async def stop(self) -> None:
        """Close the listener."""
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), 10)
            authorization: str | None = None
            for _ in range(100):  # the request headers: only Authorization is used
                line = await asyncio.wait_for(reader.readline(), 10)
                if line in (b"\r\n", b"\n", b""):
                    break
                name, _, value = line.decode("latin-1").partition(":")
                if name.strip().lower() == "authorization":
                    authorization = value.strip()
            parts = request_line.decode("latin-1").split()
            method, path = (parts[0], parts[1]) if len(parts) >= 2 else ("", "")
            path, _, query = path.partition("?")
            if path == "/reload" and method == "POST" and self._reload is not None:
                peer = str((writer.get_extra_info("peername") or ("",))[0])
                local = str((writer.get_extra_info("sockname") or ("",))[0])
                refusal = self.guard.check(peer, local, authorization)
            else:
                refusal = None
            extra = ""
            if refusal is not None:
                status, ctype = _STATUS[refusal[0]], "text/plain; charset=utf-8"
                body = f"{refusal[1]}\n".encode()
                if refusal[0] == 401:
                    extra = 'WWW-Authenticate: Bearer realm="kiproxy admin"\r\n'
            else:
                status, ctype, body = await self._answer(method, path, query)
            head = (f"HTTP/1.0 {status}\r\nContent-Type: {ctype}\r\n{extra}"
                    f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n")
            writer.write(head.encode("latin-1") + (b"" if method == "HEAD" else body))
            await writer.drain()
        except (TimeoutError, ConnectionError, UnicodeDecodeError):
            pass
        except Exception:
            log.exception("metrics endpoint: request failed")
        finally:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _answer(self, method: str, path: str,
                      query: str = "") -> tuple[str, str, bytes]:
        text = "text/plain; charset=utf-8"
        if path == "/reload" and self._reload is not None:
            if method != "POST":
                return "405 Method Not Allowed", text, b"POST /reload\n"
            status, answer = await self._reload(query)
            return _STATUS[status], "application/json", json.dumps(answer).encode() + b"\n"
        if method not in ("GET", "HEAD"):
            return "405 Method Not Allowed", text, b"only GET and HEAD\n"
        if path == "/config" and self._config is not None:
            body = json.dumps(self._config(), indent=2, sort_keys=True).encode() + b"\n"
            return "200 OK", "application/json", body
        if path == "/metrics":
            return "200 OK", CONTENT_TYPE_LATEST, self.metrics.render()
        if path in ("/healthz", "/livez"):
            return "200 OK", text, b"ok\n"
        if path == "/readyz":
            reason = await self._ready()
            if reason is None:
                return "200 OK", text, b"ready\n"
            return "503 Service Unavailable", text, f"not ready: {reason}\n".encode()
        return "404 Not Found", text, b"try /metrics, /healthz, /livez, /readyz or /config\n"


_STATUS = {200: "200 OK", 401: "401 Unauthorized", 403: "403 Forbidden", 409: "409 Conflict",
           500: "500 Internal Server Error"}


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


class _InterceptorCollector(Collector):
    """Plugins' ``MetricSample`` values as metric families; a failing plugin is skipped."""

    def __init__(self, current: Callable[[], Iterable[tuple[str, Any]]]) -> None:
        self._current = current

    def collect(self) -> Iterator[CounterMetricFamily | GaugeMetricFamily]:
        families: dict[str, CounterMetricFamily | GaugeMetricFamily] = {}
        label_names: dict[str, list[str]] = {}
        values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for name, interceptor in self._current():
            collect = getattr(interceptor, "metrics", None)
            if collect is None:
                continue
            try:
                samples = list(collect())
            except Exception:
                log.exception("interceptor %s: metrics() failed", name)
                continue
            for sample in samples:
                metric = f"kiproxy_interceptor_{sample.name}"
                labels = tuple(sorted({**sample.labels, "interceptor": name}.items()))
                if metric not in families:
                    kind = CounterMetricFamily if sample.kind == "counter" else GaugeMetricFamily
                    label_names[metric] = [k for k, _ in labels]
                    families[metric] = kind(metric, sample.help, labels=label_names[metric])
                values[(metric, labels)] = values.get((metric, labels), 0.0) + sample.value
        for (metric, labels), value in values.items():
            if [k for k, _ in labels] == label_names[metric]:  # one label set per name
                families[metric].add_metric([v for _, v in labels], value)
        yield from families.values()
