"""One configuration generation: everything a configuration makes, built in one place.

Contract:

- :func:`build_generation` turns a validated :class:`ProxyConfig` into a
  :class:`Generation`: the produce pipeline with every route's chain of
  interceptors loaded and configured (or their isolation workers started;
  :mod:`kiproxy.proxy.routes.runtime`), the fetch pipeline running the same
  routes' fetch-side hooks (:mod:`kiproxy.proxy.fetch.pipeline`), the observers (audit log,
  observer plugins) opened, and the per-client limits. It either returns a
  complete generation or raises (``PluginLoadError``, ``ConfigError``,
  ``OSError``) having closed whatever it had already opened; nothing is ever
  half built.
- The side-copy sinks (:func:`dead_letter_sink`, :func:`audit_sink`) belong to the
  process, not to a generation: the server makes each when a configuration first
  needs it, hands it to every generation, and closes it at shutdown.
- A generation is immutable. The server swaps the current one atomically
  (:class:`GenerationCell`); a request runs entirely under the generation it
  started with, so a batch already inside an interceptor finishes there.
- :func:`close_generation` runs the interceptor's ``close()`` and closes the
  observers; the server calls it once no request of that generation is left.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
import uuid
from dataclasses import dataclass, field
from typing import Any

from kiproxy.interceptors.loader import load_observer
from kiproxy.proxy.brokers.api_versions import PRODUCE_MAX_VERSION
from kiproxy.proxy.config.clients import KafkaSinkSettings
from kiproxy.proxy.config.model import ConfigError, ProxyConfig
from kiproxy.proxy.config.networks import Network
from kiproxy.proxy.fetch.pipeline import FETCH_VERSIONS, FetchPipeline
from kiproxy.proxy.net.proxy_protocol import trusted_networks
from kiproxy.proxy.net.tls import client_context, upstream_context
from kiproxy.proxy.observe.audit import AuditLog, AuditTopic
from kiproxy.proxy.observe.hub import ObserverHub
from kiproxy.proxy.observe.kafka_sink import KafkaSink
from kiproxy.proxy.observe.metrics import Metrics
from kiproxy.proxy.produce.offload import BatchOffload
from kiproxy.proxy.produce.pipeline import ProducePipeline
from kiproxy.proxy.routes.runtime import load_routes

log = logging.getLogger("kiproxy")

__all__ = ["Generation", "GenerationCell", "build_generation", "close_generation"]


@dataclass(frozen=True, slots=True, kw_only=True)
class Generation:
    """The configuration in force and what it built; swapped whole on reload."""

    number: int
    """1 at start, one more per applied reload."""
    config: ProxyConfig
    """The settings this generation was built from."""
    produce: ProducePipeline
    """The produce pipeline with this generation's interceptor."""
    fetch: FetchPipeline = field(default_factory=lambda: FetchPipeline(None, topic_names={}))
    """The fetch-side hooks of this generation's routes (sharing the produce pipeline's
    loaded routes and topic ids)."""
    observers: ObserverHub
    """This generation's observers (audit log, observer plugins)."""
    client_tls: ssl.SSLContext | None
    """The listeners' TLS context (certificate, key, client CA), when TLS is on."""
    proxy_trusted: tuple[Network, ...] = ()
    """``listener.proxy_protocol_trusted`` as networks: who may send a PROXY header."""

    @property
    def tallies(self) -> bool:
        """Responses are observed or metered, so produce requests are tallied."""
        return self.produce.tallies


class GenerationCell:
    """The current generation, and how many requests still run under each older one.

    A connection takes the current generation with :meth:`acquire` when it reads a
    request and gives it back with :meth:`release` once the request's answer has left
    (or none is owed); :meth:`retire` waits until a replaced generation has no request
    left.
    """

    def __init__(self, generation: Generation) -> None:
        self.current = generation
        self._users: dict[int, int] = {}
        self._idle: dict[int, asyncio.Event] = {}

    def acquire(self) -> Generation:
        """The current generation, counted as in use by one more request."""
        generation = self.current
        self._users[generation.number] = self._users.get(generation.number, 0) + 1
        return generation

    def release(self, generation: Generation) -> None:
        """One request of ``generation`` is done."""
        left = self._users.get(generation.number, 0) - 1
        if left > 0:
            self._users[generation.number] = left
            return
        self._users.pop(generation.number, None)
        idle = self._idle.get(generation.number)
        if idle is not None:
            idle.set()

    def in_use(self, generation: Generation) -> int:
        """Requests still running under ``generation``."""
        return self._users.get(generation.number, 0)

    def switch(self, generation: Generation) -> Generation:
        """Make ``generation`` current; return the one it replaces."""
        old, self.current = self.current, generation
        return old

    async def retire(self, generation: Generation, timeout: float) -> bool:
        """Wait until no request runs under ``generation`` (at most ``timeout`` seconds);
        False if some still did then."""
        if not self.in_use(generation):
            return True
        idle = self._idle.setdefault(generation.number, asyncio.Event())
        try:
            await asyncio.wait_for(idle.wait(), timeout)
        except TimeoutError:
            return False
        finally:
            self._idle.pop(generation.number, None)
        return True


def build_observers(config: ProxyConfig, metrics: Metrics | None,
                    audit_sink: KafkaSink | None = None) -> ObserverHub:
    """Open the audit log and load the configured observers; ``audit.topic`` sends its
    events through ``audit_sink`` (the process's, see :func:`audit_sink`)."""
    observers: list[tuple[str, Any]] = []
    audit = config.audit
    try:
        if audit.path is not None:
            log_ = AuditLog()
            try:
                log_.configure(audit.model_dump())
            except (OSError, ValueError) as exc:
                raise ConfigError(f"audit.path: cannot open {audit.path}: {exc}") from None
            observers.append(("audit", log_))
        if audit.topic is not None:
            if audit_sink is None:
                raise ConfigError("audit.topic: no audit sink was made for this process")
            observers.append(("audit-kafka", AuditTopic(audit_sink, audit.topic,
                                                        requests=audit.requests)))
        for item in config.observers:
            observers.append((item.class_name,
                              load_observer(item.class_name, config.plugins_dir, item.config)))
    except BaseException:
        ObserverHub(observers).close(timeout=5)
        raise
    return ObserverHub(observers, metrics=metrics, queue_size=config.observer_queue_size)


def uses_dead_letter(config: ProxyConfig) -> bool:
    """Some route of ``config`` copies refused records to a dead-letter topic."""
    return any(route.dead_letter is not None for route in config.every_route)


def dead_letter_sink(config: ProxyConfig, metrics: Metrics | None) -> KafkaSink:
    """The process's dead-letter sink, from ``dead_letter_sink``; it never creates a topic."""
    return _kafka_sink("dead_letter", config.dead_letter_sink, config, metrics,
                       creates_topics=False)


def uses_audit_topic(config: ProxyConfig) -> bool:
    """``config`` sends the audit events to a topic."""
    return config.audit.topic is not None


def audit_sink(config: ProxyConfig, metrics: Metrics | None) -> KafkaSink:
    """The process's audit sink, from ``audit_sink``; the cluster may create the topic."""
    return _kafka_sink("audit", config.audit_sink, config, metrics, creates_topics=True)


def _kafka_sink(name: str, settings: KafkaSinkSettings, config: ProxyConfig,
                metrics: Metrics | None, *, creates_topics: bool) -> KafkaSink:
    # Bootstrap and TLS default to the upstream cluster's; counters go to ``metrics``.
    bootstrap, tls = settings.connection(config.upstream, config.upstream_tls)
    return KafkaSink(name, settings, bootstrap=bootstrap,
                     tls=upstream_context(tls, f"{name}_sink.tls") if tls is not None else None,
                     metrics=metrics if metrics is not None else Metrics(),
                     creates_topics=creates_topics,
                     max_request_bytes=config.max_frame_size)  # what a producer may send


def build_generation(config: ProxyConfig, number: int, *, metrics: Metrics | None,
                     offload: BatchOffload | None = None,
                     topic_names: dict[uuid.UUID, str] | None = None,
                     previous: Generation | None = None,
                     dead_letter: KafkaSink | None = None,
                     audit_sink: KafkaSink | None = None) -> Generation:
    """Everything ``config`` needs, complete, or an exception and nothing left open.

    With ``previous`` (a reload), its observers are kept when the observer and
    audit settings did not change: one audit file has one writer. ``dead_letter`` and
    ``audit_sink`` are the process's sinks (they outlive the generation).
    """
    client_tls = client_context(config.tls)  # first: a bad certificate opens nothing
    if previous is not None and _same_observers(previous.config, config):
        observers = previous.observers
    else:
        observers = build_observers(config, metrics, audit_sink)
    try:
        routes = load_routes(config)
    except BaseException:
        if previous is None or observers is not previous.observers:
            observers.close(timeout=5)
        raise
    for warning in config.route_warnings():
        log.warning("routes: %s", warning)
    # Produce v13 names topics by id; with several workers a process may not have
    # seen the Metadata that maps an id, so v13 is neither offered nor accepted.
    produce = ProducePipeline(
        None, routes=routes,
        compression_levels=config.interceptor.compression.levels(),
        max_version=12 if config.workers > 1 else PRODUCE_MAX_VERSION,
        metrics=metrics, tallies=observers.active or metrics is not None,
        offload=offload, topic_names=topic_names, dead_letter=dead_letter,
    )
    fetch = FetchPipeline(
        routes, topic_names=produce.topic_names, proxy_host=produce.partitions.proxy_host,
        compression_levels=produce.compression_levels, offload=produce.offload,
        metrics=metrics, max_version=12 if config.workers > 1 else FETCH_VERSIONS[1])
    return Generation(number=number, config=config, produce=produce, fetch=fetch,
                      observers=observers, client_tls=client_tls,
                      proxy_trusted=trusted_networks(config.listener.proxy_protocol_trusted))


def _same_observers(old: ProxyConfig, new: ProxyConfig) -> bool:
    return (old.audit == new.audit and old.observers == new.observers
            and old.observer_queue_size == new.observer_queue_size
            and old.plugins_dir == new.plugins_dir)


async def close_generation(generation: Generation, *, keep_observers: bool = False) -> None:
    """Close the interceptor and (unless the next generation kept them) the observers of
    a generation no request uses any more."""
    await generation.produce.close()
    if not keep_observers:
        await asyncio.to_thread(generation.observers.close)
