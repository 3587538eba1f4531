"""``SchemaRegistryValidator`` (``schema_registry``): data contracts checked at the door.

Refuses records that do not keep their topic's contract, checked against a
schema registry speaking the Confluent Schema Registry REST API (Confluent,
Apicurio's ``/apis/ccompat/v7``, Karapace, Redpanda), before they reach the log:

* the record carries a schema id (Confluent framing, or a header);
* the id is registered, under the subject the naming strategy gives;
* optionally, it is the subject's latest version;
* the payload decodes with that schema (Avro, Protobuf, JSON Schema);
* named CEL rules over the decoded record hold.

Config (``docs/builtin-settings.md`` has every key, ``docs/schema-registry.md`` what a
producer sees)::

    interceptor:
      class: schema_registry
      config:
        registry: {url: http://127.0.0.1:8081/apis/ccompat/v7}
        on_registry_unavailable: reject     # or pass
        topics:                             # topic name, or a regex matching the whole name
          orders:
            value: payload                  # none | id | subject | payload
            key: {check: id, allow_unframed: true}
            rules:
              - {name: positive_amount, expr: "value.amount > 0"}

A refused batch gets INVALID_RECORD (``error:``) with one ``record_errors``
entry per bad record ("record 3: schema id 17 is registered under
payments-value, not orders-value") and the batch message summarising. The
registry client (``registry.py``, its bounded HTTP requests in ``registry_http.py``)
caches schemas by id; this module owns the checks (``contract.py``, what they know of
the registry in ``lookups.py``; every cache is a ``lookup_cache.LookupCache``),
the payload formats (``avro.py``, ``protobuf.py``, ``json_payload.py``), the
framing (``wire.py``; Apicurio globalIds carried in headers are translated by
``apicurio_ids.py``), the rules (``rules.py``) and the settings (``settings.py``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import weakref
from collections.abc import Iterable
from typing import Any

from kiproxy.interceptors.api import (
    InterceptContext,
    MetricSample,
    ProduceRequestInterceptor,
    RecordBatch,
    RejectBatch,
)
from kiproxy.interceptors.builtin.schema_registry.contract import CHECKS, ContractCheck
from kiproxy.interceptors.builtin.schema_registry.lookups import Lookups
from kiproxy.interceptors.builtin.schema_registry.settings import (
    SchemaRegistrySettings,
    Settings,
)

__all__ = ["SchemaRegistryValidator"]

_LATEST: weakref.WeakValueDictionary[str, Lookups] = weakref.WeakValueDictionary()
"""The caches of the check configured last for each registry (by a digest of its
``registry`` settings): what a reload's new instance takes over (see ``configure``)."""


class _NoRegistry(Exception):
    """Never raised: the exception types of a configuration without a registry."""


class SchemaRegistryValidator(ProduceRequestInterceptor[SchemaRegistrySettings]):
    """Checks records against the schema registry and the topic's CEL rules."""

    def __init__(self) -> None:
        self._check: ContractCheck | None = None
        self._client: Any = None
        self._global_ids: Any = None

    def configure(self, config: SchemaRegistrySettings) -> None:
        """Take the validated settings. The registry is not contacted yet; what the
        instance configured last with the same ``registry`` settings knows of it (a
        reload's predecessor) is taken over, each answer with the lifetime it has left."""
        settings = Settings.of(config)
        client: Any = None
        unknown: type[Exception] = _NoRegistry
        unavailable: type[Exception] = _NoRegistry
        global_ids: Any = None
        registry = config.registry
        if registry is not None:
            from kiproxy.interceptors.builtin.schema_registry.registry import (
                RegistryUnavailable,
                SchemaRegistryClient,
                UnknownSchemaId,
            )
            client = SchemaRegistryClient(registry)
            unknown, unavailable = UnknownSchemaId, RegistryUnavailable
            if settings.global_ids:
                from kiproxy.interceptors.builtin.schema_registry.apicurio_ids import GlobalIds
                global_ids = GlobalIds(registry)
        self._client = client
        self._global_ids = global_ids
        lifetimes: dict[str, Any] = {}
        if registry is not None:
            lifetimes = {"cache_ttl_s": registry.cache_ttl_s,
                         "negative_ttl_s": registry.negative_ttl_s,
                         "compile_threads": registry.max_requests_in_flight}
        self._check = ContractCheck(settings, client, unknown_id=unknown,
                                    unavailable=unavailable, global_ids=global_ids,
                                    **lifetimes)
        if registry is not None:
            # A reload configures a new instance: with the same registry settings it takes
            # what the one it replaces knows (Lookups.adopt), so that producers whose ids
            # were served keep being served if the registry is unreachable right then.
            key = hashlib.sha256(registry.model_dump_json().encode()
                                 + (b"\0globalids" if settings.global_ids else b"")).hexdigest()
            earlier = _LATEST.get(key)
            if earlier is not None:
                self._check.lookups.adopt(earlier)
            _LATEST[key] = self._check.lookups

    async def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Return ``batch`` unchanged, or raise RejectBatch naming every bad record."""
        if self._check is None:
            raise RuntimeError("schema_registry: configure() was not called")
        refusal = await self._check.check(batch)
        if refusal is None:
            return batch
        raise RejectBatch(refusal.message, refusal.code, refusal.record_errors)

    def metrics(self) -> Iterable[MetricSample]:
        """Registry lookups, cache hits, misses, errors, latency; rejections by check and rule."""
        check = self._check
        if check is None:
            return
        for name in CHECKS:
            yield MetricSample(name="schema_registry_rejections", kind="counter",
                               help="Records refused by the schema_registry check they failed",
                               labels={"check": name}, value=check.rejections.get(name, 0))
        for rule, count in sorted(check.rule_rejections.items()):
            yield MetricSample(name="schema_registry_rule_rejections", kind="counter",
                               help="Records refused by a schema_registry CEL rule",
                               labels={"rule": rule}, value=count)
        yield MetricSample(name="schema_registry_unavailable_passed", kind="counter",
                           help="Records passed unchecked because the registry was "
                                "unavailable (on_registry_unavailable: pass)",
                           labels={}, value=check.unavailable_passed)
        yield MetricSample(name="schema_registry_uncompilable", kind="counter",
                           help="Schema lookups whose schema the proxy could not compile "
                                "(its records follow on_registry_unavailable)",
                           labels={}, value=check.lookups.uncompilable)
        if self._client is not None:
            stats = self._client.stats()
            if self._global_ids is not None:  # the globalId translations' requests count too
                more = self._global_ids.stats()
                stats = dataclasses.replace(
                    stats, requests=stats.requests + more.requests,
                    errors=stats.errors + more.errors,
                    latency_sum_s=stats.latency_sum_s + more.latency_sum_s,
                    latency_count=stats.latency_count + more.latency_count)
            yield from _client_samples(stats)

    async def close(self) -> None:
        """Close the registry client's connections and the compiling threads."""
        if self._check is not None:
            self._check.close()
        if self._client is not None:
            await self._client.close()
        if self._global_ids is not None:
            await self._global_ids.close()


_CLIENT_COUNTERS = {
    "lookups": ("schema_registry_lookups", "Lookups asked of the registry client"),
    "hits": ("schema_registry_cache_hits", "Lookups answered from the client's cache"),
    "misses": ("schema_registry_cache_misses", "Lookups that had to ask the registry"),
    "unknown": ("schema_registry_unknown", "Lookups the registry (or the negative cache) "
                "answered with: no such schema id or subject"),
    "stale": ("schema_registry_stale_hits", "Cached answers served past their TTL because "
              "the registry was unavailable"),
    "requests": ("schema_registry_requests", "HTTP requests made to the registry"),
    "errors": ("schema_registry_errors", "Registry requests that failed (unreachable, "
               "timeout, 5xx, refused credentials)"),
    "latency_sum_s": ("schema_registry_request_seconds", "Seconds spent in registry requests "
                      "(divide by schema_registry_requests for the mean)"),
}


def _client_samples(stats: Any) -> Iterable[MetricSample]:
    """The registry client's counters (``RegistryStats``)."""
    for field, (name, help_text) in _CLIENT_COUNTERS.items():
        value = getattr(stats, field, None)
        if isinstance(value, (int, float)):
            yield MetricSample(name=name, kind="counter", help=help_text, labels={},
                               value=float(value))
