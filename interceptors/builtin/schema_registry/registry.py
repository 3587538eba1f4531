"""``SchemaRegistryClient``: schemas by ID from a Confluent Schema Registry API (Confluent's
registry, Apicurio Registry's ``/apis/ccompat/v7``, Karapace, Redpanda), over aiohttp.

Contract:
* ``schema_by_id`` returns the schema with its type (``schemaType``; absent means AVRO)
  and its references resolved recursively (``GET /schemas/ids/{id}``, then
  ``GET /subjects/{subject}/versions/{version}`` per reference). An ID the registry does
  not know raises :class:`UnknownSchemaId` (and is remembered for ``negative_ttl_s``).
* Answers are kept in :class:`~.lookup_cache.LookupCache` caches (``cache_size`` keys
  each): a schema for ``cache_ttl_s``, an ID's subjects and a subject's latest ID for
  ``subject_ttl_s``; past that, the next lookup refreshes it in the background while the
  old answer serves. While one lookup of a key is in flight, every other caller awaits
  the same one: N concurrent lookups of a new ID make one HTTP request. A referenced
  version's lookup in flight is joined too, unless it waits (through the references it
  joined) on the joiner: two IDs entering a reference cycle at two points at once would
  then wait for each other for good, so the joiner asks on its own account and finds
  the cycle.
* When the registry cannot be reached (timeout, refused, 5xx, refused credentials, an
  answer over ``max_response_bytes`` or not JSON), an answer still in the cache keeps
  serving, even past its TTL (counted as ``stale``), and is tried again after
  ``negative_ttl_s``; any other lookup raises :class:`RegistryUnavailable` naming the URL,
  the cause and the setting to check.
* Each HTTP request is bounded in time, size and concurrency (``registry_http.py``:
  ``timeout_ms``, ``max_response_bytes``, ``max_requests_in_flight``; large answers
  parsed on a worker thread), so a burst of new IDs or a misbehaving registry puts only
  a little work at a time on the event loop, and the connections whose schemas are
  cached keep being served between them.
* No module-level event-loop state: one client object serves any number of successive
  loops (a Spark executor's fresh loop).

Why aiohttp: a lookup's CPU is spent on the proxy's event loop, beside every other
connection's. aiohttp (its HTTP parser in C) spent about 380 us of CPU per registry
request where httpx (pure-Python h11) spent about 1,100 us, measured against Apicurio
Registry on one machine; the difference is what a burst of new IDs costs the other
connections.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any, Literal, TypeVar
from urllib.parse import quote

from .lookup_cache import CacheCounts, LookupCache
from .registry_config import RegistrySettings
from .registry_http import RegistryHttp, RegistryUnavailable

__all__ = [
    "RegisteredSchema", "RegistryStats", "RegistryUnavailable", "SchemaReference",
    "SchemaRegistryClient", "UnknownSchemaId", "UnknownSubject",
]

SchemaType = Literal["AVRO", "PROTOBUF", "JSON"]
MAX_REFERENCE_DEPTH = 32
_SCHEMA_TYPES: dict[str, SchemaType] = {"AVRO": "AVRO", "PROTOBUF": "PROTOBUF", "JSON": "JSON"}


@dataclass(frozen=True, slots=True, kw_only=True)
class SchemaReference:
    """A schema another one uses: the name the referencing schema uses for it
    (the import path of a ``.proto``, an Avro full name), where it is registered,
    and the schema itself, resolved."""

    name: str
    subject: str
    version: int
    schema: RegisteredSchema


@dataclass(frozen=True, slots=True, kw_only=True)
class RegisteredSchema:
    """A registered schema: its ID, type, text as the registry returns it, references."""

    schema_id: int
    schema_type: SchemaType
    schema: str
    references: tuple[SchemaReference, ...]


class UnknownSchemaId(Exception):
    """The registry answered that no schema has this ID."""


class UnknownSubject(UnknownSchemaId):
    """The registry answered that the subject (or its version) does not exist (a kind of
    :class:`UnknownSchemaId`, so one ``except`` takes every "the registry has no such
    thing" answer)."""


@dataclass(frozen=True, slots=True)
class RegistryStats:
    """Counters since the client was made, for metrics.

    ``lookups`` = ``hits`` + ``misses`` + ``unknown`` (lookups answered by the negative
    cache); ``stale`` are hits served past their TTL (a refresh running, or the registry
    unavailable); ``requests`` are HTTP requests made, ``errors`` those that failed,
    ``latency_sum_s``/``latency_count`` their durations."""

    lookups: int = 0
    hits: int = 0
    misses: int = 0
    unknown: int = 0
    stale: int = 0
    errors: int = 0
    requests: int = 0
    latency_sum_s: float = 0.0
    latency_count: int = 0
    cached: int = 0


_V = TypeVar("_V")


class SchemaRegistryClient:
    """A caching client of one registry (see the module docstring for the contract)."""

    def __init__(self, settings: RegistrySettings) -> None:
        self.settings = settings
        self._base = settings.url.rstrip("/")
        self.http = RegistryHttp(settings)
        """The bounded HTTP GETs (shared with ``apicurio_ids.GlobalIds``' own client)."""
        self._counts = CacheCounts()
        s = settings

        def cache(ttl: float, counts: CacheCounts | None = None) -> LookupCache[Any]:
            return LookupCache(size=s.cache_size, ttl_s=ttl, negative_ttl_s=s.negative_ttl_s,
                               remember=(UnknownSchemaId,), keep_stale_on=(RegistryUnavailable,),
                               counts=counts or self._counts)

        self._ids: LookupCache[RegisteredSchema] = cache(s.cache_ttl_s)
        self._subjects: LookupCache[tuple[tuple[str, int], ...]] = cache(s.subject_ttl_s)
        self._latest: LookupCache[int] = cache(s.subject_ttl_s)
        self._versions: LookupCache[RegisteredSchema] = cache(s.cache_ttl_s, CacheCounts())
        """Referenced schemas by (subject, version); not counted as lookups."""
        self._waiting: dict[asyncio.Task[Any], asyncio.Task[Any]] = {}
        """Task resolving references -> the lookup of a referenced version it joined."""

    # -- public API ---------------------------------------------------------------------

    async def schema_by_id(self, schema_id: int, *, fresh: bool = False) -> RegisteredSchema:
        """The schema registered under ``schema_id``, references resolved; ``fresh`` asks
        the registry now and keeps nothing here, for a caller that keeps what it made of
        the answer (the contract check's compiled schemas: one copy of a large schema, not
        two).

        Raises :class:`UnknownSchemaId` or :class:`RegistryUnavailable`."""
        if fresh:
            self._counts.lookups += 1
            self._counts.misses += 1
            return await self._fetch_id(schema_id)
        return await self._ids.get(("id", schema_id), lambda: self._fetch_id(schema_id))

    async def subjects_of(self, schema_id: int, *, fresh: bool = False,
                          ) -> tuple[tuple[str, int], ...]:
        """The (subject, version) pairs ``schema_id`` is registered under
        (``GET /schemas/ids/{id}/versions``), kept ``subject_ttl_s`` (a schema may be
        registered under more subjects later); ``fresh`` asks the registry now.
        Raises :class:`UnknownSchemaId` or :class:`RegistryUnavailable`."""
        return await self._lookup(self._subjects, ("subjects", schema_id), fresh,
                                  lambda: self._fetch_subjects(schema_id))

    async def latest_id(self, subject: str, *, fresh: bool = False) -> int:
        """The schema ID of ``subject``'s latest version, kept ``subject_ttl_s``;
        ``fresh`` asks the registry now.

        Raises :class:`UnknownSubject` or :class:`RegistryUnavailable`."""
        async def fetch() -> int:
            body = await self.http.get_json(
                f"/subjects/{quote(subject, safe='')}/versions/latest",
                what=f"the latest version of {subject}",
                unknown=lambda: UnknownSubject(f"subject {subject!r} is not registered"))
            return _int_field(body, "id", self._base)

        return await self._lookup(self._latest, ("latest", subject), fresh, fetch)

    def stats(self) -> RegistryStats:
        """The counters so far (a snapshot)."""
        c, h = self._counts, self.http.counts
        return RegistryStats(lookups=c.lookups, hits=c.hits, misses=c.misses,
                             unknown=c.unknown, stale=c.stale, errors=h.errors,
                             requests=h.requests, latency_sum_s=h.latency_sum_s,
                             latency_count=h.latency_count, cached=len(self._ids))

    async def close(self) -> None:
        """Close the HTTP client (when called in the loop that made it; otherwise drop it)."""
        await self.http.close()

    # -- lookups ------------------------------------------------------------------------

    @staticmethod
    async def _lookup(cache: LookupCache[_V], key: Hashable, fresh: bool,
                      fetch: Callable[[], Awaitable[_V]]) -> _V:
        if fresh:
            cache.drop(key)
        return await cache.get(key, fetch)

    async def _fetch_id(self, schema_id: int) -> RegisteredSchema:
        body = await self.http.get_json(
            f"/schemas/ids/{int(schema_id)}", what=f"schema id {schema_id}",
            unknown=lambda: UnknownSchemaId(
                f"schema id {schema_id} is not registered in {self._base}"))
        try:
            return await self._build(schema_id, body, depth=0)
        except UnknownSubject as exc:
            # The registry names a reference it does not hold: not the ID's fault.
            raise RegistryUnavailable(f"schema registry {self._base}: schema {schema_id}: "
                                      f"{exc}") from exc

    async def _fetch_subjects(self, schema_id: int) -> tuple[tuple[str, int], ...]:
        body = await self.http.get_json(f"/schemas/ids/{int(schema_id)}/versions",
                                        what=f"the subjects of schema id {schema_id}",
                                        unknown=lambda: UnknownSchemaId(
                                   f"schema id {schema_id} is not registered in {self._base}"))
        if not isinstance(body, list):
            raise RegistryUnavailable(f"schema registry {self._base}: /schemas/ids/{schema_id}"
                                      f"/versions answered {type(body).__name__}, not a list")
        return tuple((str(item["subject"]), int(item["version"])) for item in body
                     if isinstance(item, dict) and "subject" in item and "version" in item)

    async def _version(self, subject: str, version: int, depth: int,
                       chain: tuple[tuple[str, int], ...]) -> RegisteredSchema:
        if (subject, version) in chain:
            # Its lookup is the one in flight up the chain: joining it would wait for itself.
            cycle = " -> ".join(f"{s} v{v}" for s, v in (*chain, (subject, version)))
            raise RegistryUnavailable(f"schema registry {self._base}: references form a "
                                      f"cycle: {cycle}")

        async def fetch() -> RegisteredSchema:
            body = await self.http.get_json(
                f"/subjects/{quote(subject, safe='')}/versions/{int(version)}",
                what=f"{subject} version {version}",
                unknown=lambda: UnknownSubject(
                    f"referenced subject {subject!r} version {version} is not registered"))
            return await self._build(_int_field(body, "id", self._base), body, depth,
                                     (*chain, (subject, version)))

        key = ("version", subject, version)
        found = self._versions.flight(key, fetch)
        if not isinstance(found, asyncio.Task):
            return found
        me = asyncio.current_task()
        if me is None or self._waits_on(found, me):
            # That lookup waits on this one (two ids entering a reference cycle at two
            # points at once): joining it would wait for good, so ask on our own.
            return await self._versions.get_own(key, fetch)
        self._waiting[me] = found
        try:
            return await asyncio.shield(found)
        finally:
            del self._waiting[me]

    def _waits_on(self, task: asyncio.Task[Any], me: asyncio.Task[Any]) -> bool:
        """Whether ``task`` waits, through the reference lookups it joined, on ``me``."""
        seen: set[asyncio.Task[Any]] = set()
        at: asyncio.Task[Any] | None = task
        while at is not None and at not in seen:
            if at is me:
                return True
            seen.add(at)
            at = self._waiting.get(at)
        return False

    async def _build(self, schema_id: int, body: Any, depth: int,
                     chain: tuple[tuple[str, int], ...] = ()) -> RegisteredSchema:
        if not isinstance(body, dict) or not isinstance(body.get("schema"), str):
            raise RegistryUnavailable(f"schema registry {self._base}: schema {schema_id}: the "
                                      "answer has no `schema` text")
        raw_type = body.get("schemaType") or "AVRO"
        schema_type = _SCHEMA_TYPES.get(raw_type) if isinstance(raw_type, str) else None
        if schema_type is None:
            raise RegistryUnavailable(f"schema registry {self._base}: schema {schema_id} has "
                                      f"the unknown schemaType {raw_type!r}")
        refs: list[SchemaReference] = []
        for ref in body.get("references") or ():
            if depth >= MAX_REFERENCE_DEPTH:
                raise RegistryUnavailable(
                    f"schema registry {self._base}: schema {schema_id}: references nest deeper "
                    f"than {MAX_REFERENCE_DEPTH} (a cycle?)")
            try:
                name, subject, version = str(ref["name"]), str(ref["subject"]), int(ref["version"])
            except (TypeError, KeyError, ValueError) as exc:
                raise RegistryUnavailable(f"schema registry {self._base}: schema {schema_id}: "
                                          f"a reference is not name/subject/version: {ref!r}"
                                          ) from exc
            refs.append(SchemaReference(name=name, subject=subject, version=version,
                                        schema=await self._version(subject, version, depth + 1,
                                                                   chain)))
        return RegisteredSchema(schema_id=schema_id, schema_type=schema_type,
                                schema=body["schema"], references=tuple(refs))


def _int_field(body: Any, name: str, base: str) -> int:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, int):
        raise RegistryUnavailable(f"schema registry {base}: the answer has no integer `{name}`")
    return value

