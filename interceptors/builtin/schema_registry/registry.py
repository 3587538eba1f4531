"""``SchemaRegistryClient``: schemas by ID from a Confluent Schema Registry API (Confluent's
registry, Apicurio Registry's ``/apis/ccompat/v7``, Karapace, Redpanda), over aiohttp.

Contract:
* ``schema_by_id`` returns the schema with its type (``schemaType``; absent means AVRO)
  and its references resolved recursively (``GET /schemas/ids/{id}``, then
  ``GET /subjects/{subject}/versions/{version}`` per reference). An ID the registry does
  not know raises :class:`UnknownSchemaId` (and is remembered for ``negative_ttl_s``).
* Answers are kept in a bounded LRU cache (``cache_size`` IDs, re-fetched after
  ``cache_ttl_s``). While one lookup of an ID is in flight, every other caller awaits
  the same one: N concurrent lookups of a new ID make one HTTP request.
* When the registry cannot be reached (timeout, refused, 5xx, refused credentials),
  an ID still in the cache keeps answering, even past its TTL (counted as ``stale``);
  any other lookup raises :class:`RegistryUnavailable` naming the URL and the cause.
* At most ``max_requests_in_flight`` HTTP requests are in flight at once (per client and
  loop); other lookups wait their turn without touching the HTTP client, at most
  ``timeout_ms`` (then :class:`RegistryUnavailable`). A burst of new IDs thus
  puts only a few registry callbacks at a time on the event loop, and the connections
  whose schemas are cached keep being served between them.
* No module-level event-loop state: the HTTP client is created in the loop that first
  uses it and replaced when a later call runs in another loop (a Spark executor's fresh
  loop), so one client object serves any number of successive loops.

Why aiohttp: a lookup's CPU is spent on the proxy's event loop, beside every other
connection's. aiohttp (its HTTP parser in C) spent about 380 us of CPU per registry
request where httpx (pure-Python h11) spent about 1,100 us, measured against Apicurio
Registry on one machine; the difference is what a burst of new IDs costs the other
connections.
"""

from __future__ import annotations

import asyncio
import base64
import json
import ssl
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Literal, TypeVar
from urllib.parse import quote

import aiohttp

from .registry_config import RegistrySettings

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


class RegistryUnavailable(Exception):
    """The registry could not answer (timeout, connection refused, 5xx, refused
    credentials, an answer that is not the API's): the message names the URL and cause."""


@dataclass(frozen=True, slots=True)
class RegistryStats:
    """Counters since the client was made, for metrics.

    ``lookups`` = ``hits`` + ``misses`` (+ lookups answered by the negative cache, which
    count as ``unknown``); ``stale`` are hits served past their TTL because the registry
    was unavailable; ``requests`` are HTTP requests made, ``errors`` those that failed,
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


class _Entry(Generic[_V]):
    __slots__ = ("expires", "value")

    def __init__(self, value: _V | BaseException, expires: float) -> None:
        self.value = value
        self.expires = expires


class _LruCache(Generic[_V]):
    """An LRU map of key -> (value or remembered error, expiry), at most ``size`` entries."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._data: OrderedDict[Hashable, _Entry[_V]] = OrderedDict()

    def get(self, key: Hashable) -> _Entry[_V] | None:
        entry = self._data.get(key)
        if entry is not None:
            self._data.move_to_end(key)
        return entry

    def put(self, key: Hashable, value: _V | BaseException, ttl: float) -> None:
        self._data[key] = _Entry(value, time.monotonic() + ttl)
        self._data.move_to_end(key)
        while len(self._data) > self.size:
            self._data.popitem(last=False)

    def drop(self, key: Hashable) -> None:
        self._data.pop(key, None)

    def __len__(self) -> int:
        return len(self._data)


@dataclass(slots=True)
class _LoopState:
    """What belongs to one event loop: the HTTP client and the lookups in flight."""

    loop: asyncio.AbstractEventLoop
    http: aiohttp.ClientSession
    gate: asyncio.Semaphore
    """At most ``max_requests_in_flight`` HTTP requests at once; the others wait here,
    as one parked future each, not as requests queued in the client's pool."""
    inflight: dict[Hashable, asyncio.Task[Any]] = field(default_factory=dict)


class SchemaRegistryClient:
    """A caching client of one registry (see the module docstring for the contract)."""

    def __init__(self, settings: RegistrySettings) -> None:
        self.settings = settings
        self._base = settings.url.rstrip("/")
        self._ids: _LruCache[RegisteredSchema] = _LruCache(settings.cache_size)
        self._subjects: _LruCache[tuple[tuple[str, int], ...]] = _LruCache(settings.cache_size)
        self._latest: _LruCache[int] = _LruCache(settings.cache_size)
        self._versions: _LruCache[RegisteredSchema] = _LruCache(settings.cache_size)
        self._state: _LoopState | None = None
        self._token_cache: tuple[float, str] | None = None
        self._counts = dict.fromkeys(
            ("lookups", "hits", "misses", "unknown", "stale", "errors", "requests",
             "latency_count"), 0)
        self._latency_sum = 0.0

    # -- public API ---------------------------------------------------------------------

    async def schema_by_id(self, schema_id: int) -> RegisteredSchema:
        """The schema registered under ``schema_id``, references resolved.

        Raises :class:`UnknownSchemaId` or :class:`RegistryUnavailable`."""
        return await self._cached(self._ids, ("id", schema_id), self.settings.cache_ttl_s,
                                  lambda: self._fetch_id(schema_id))

    async def subjects_of(self, schema_id: int, *, fresh: bool = False,
                          ) -> tuple[tuple[str, int], ...]:
        """The (subject, version) pairs ``schema_id`` is registered under
        (``GET /schemas/ids/{id}/versions``), kept ``subject_ttl_s`` (a schema may be
        registered under more subjects later); ``fresh`` asks the registry now.
        Raises :class:`UnknownSchemaId` or :class:`RegistryUnavailable`."""
        key = ("subjects", schema_id)
        if fresh:
            self._subjects.drop(key)
        return await self._cached(self._subjects, key, self.settings.subject_ttl_s,
                                  lambda: self._fetch_subjects(schema_id))

    async def latest_id(self, subject: str) -> int:
        """The schema ID of ``subject``'s latest version, kept ``subject_ttl_s``.

        Raises :class:`UnknownSubject` or :class:`RegistryUnavailable`."""
        async def fetch() -> int:
            body = await self._get(f"/subjects/{quote(subject, safe='')}/versions/latest",
                                   unknown=lambda: UnknownSubject(
                                       f"subject {subject!r} is not registered"))
            return _int_field(body, "id", self._base)

        return await self._cached(self._latest, ("latest", subject),
                                  self.settings.subject_ttl_s, fetch)

    def stats(self) -> RegistryStats:
        """The counters so far (a snapshot)."""
        return RegistryStats(latency_sum_s=self._latency_sum, cached=len(self._ids),
                             **self._counts)

    async def close(self) -> None:
        """Close the HTTP client (when called in the loop that made it; otherwise drop it)."""
        state, self._state = self._state, None
        if state is not None and not state.loop.is_closed():
            try:
                running = asyncio.get_running_loop()
            except RuntimeError:
                return
            if running is state.loop:
                await state.http.close()

    # -- caching and single flight ------------------------------------------------------

    async def _cached(self, cache: _LruCache[_V], key: Hashable, ttl: float,
                      fetch: Callable[[], Awaitable[_V]]) -> _V:
        self._counts["lookups"] += 1
        entry = cache.get(key)
        now = time.monotonic()
        if entry is not None and entry.expires > now:
            if isinstance(entry.value, BaseException):
                self._counts["unknown"] += 1
                raise entry.value
            self._counts["hits"] += 1
            return entry.value
        state = self._loop_state()
        task = state.inflight.get(key)
        if task is None:
            self._counts["misses"] += 1
            task = state.loop.create_task(self._refresh(cache, key, ttl, fetch))
            state.inflight[key] = task
            task.add_done_callback(lambda t: _forget(state.inflight, key, t))
        try:
            return await asyncio.shield(task)
        except RegistryUnavailable:
            if entry is not None and not isinstance(entry.value, BaseException):
                self._counts["stale"] += 1
                return entry.value
            raise

    async def _refresh(self, cache: _LruCache[_V], key: Hashable, ttl: float,
                       fetch: Callable[[], Awaitable[_V]]) -> _V:
        try:
            value = await fetch()
        except UnknownSchemaId as exc:
            cache.put(key, exc, self.settings.negative_ttl_s)
            raise
        cache.put(key, value, ttl)
        return value

    def _loop_state(self) -> _LoopState:
        loop = asyncio.get_running_loop()
        state = self._state
        if state is None or state.loop is not loop:
            state = self._state = _LoopState(
                loop, self._new_http(), asyncio.Semaphore(self.settings.max_requests_in_flight))
        return state

    # -- HTTP ---------------------------------------------------------------------------

    def _new_http(self) -> aiohttp.ClientSession:
        s = self.settings
        tls: ssl.SSLContext | bool = True
        if s.url.startswith("https://"):
            ctx = ssl.create_default_context(cafile=s.ca_file)
            if s.cert_file is not None:
                ctx.load_cert_chain(s.cert_file, s.key_file)
            tls = ctx
        headers = {"Accept": "application/vnd.schemaregistry.v1+json, application/json"}
        if s.basic_auth is not None:
            password = s.basic_auth.password
            if password is None and s.basic_auth.password_file is not None:
                password = Path(s.basic_auth.password_file).read_text().strip()
            pair = f"{s.basic_auth.username}:{password or ''}".encode()
            headers["Authorization"] = "Basic " + base64.b64encode(pair).decode("ascii")
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(ssl=tls, limit=s.max_connections),
            timeout=aiohttp.ClientTimeout(total=s.timeout_s), headers=headers)

    def _bearer(self) -> str | None:
        s = self.settings
        if s.bearer_token is not None:
            return s.bearer_token
        if s.bearer_token_file is None:
            return None
        path = Path(s.bearer_token_file)
        try:
            mtime = path.stat().st_mtime
            if self._token_cache is None or self._token_cache[0] != mtime:
                self._token_cache = (mtime, path.read_text().strip())
        except OSError as exc:
            raise RegistryUnavailable(
                f"schema registry {self._base}: cannot read registry.bearer_token_file "
                f"{s.bearer_token_file!r}: {exc}") from exc
        return self._token_cache[1]

    async def _get(self, path: str, *, unknown: Callable[[], Exception]) -> Any:
        url = self._base + path
        headers = {}
        token = self._bearer()
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        state = self._loop_state()
        await self._take_slot(state.gate, url)
        self._counts["requests"] += 1
        started = time.perf_counter()
        try:
            async with state.http.get(url, headers=headers) as resp:
                status, reason = resp.status, resp.reason or ""
                body = await resp.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            # OSError: ssl.SSLError among them; a TLS 1.3 server refusing the client's
            # certificate says so only once the first response is read.
            self._counts["errors"] += 1
            cause = str(exc) or type(exc).__name__
            raise RegistryUnavailable(f"schema registry {url}: {cause}") from exc
        finally:
            state.gate.release()
            self._latency_sum += time.perf_counter() - started
            self._counts["latency_count"] += 1
        if status == 404:
            raise unknown()
        if status != 200:
            self._counts["errors"] += 1
            hint = {401: " (check registry.basic_auth / registry.bearer_token)",
                    403: " (the credentials may not read schemas)"}.get(status, "")
            text = body[:200].decode("utf-8", "replace")
            raise RegistryUnavailable(
                f"schema registry {url}: HTTP {status} {reason}{hint}: {text}")
        try:
            return json.loads(body)
        except ValueError as exc:
            self._counts["errors"] += 1
            raise RegistryUnavailable(f"schema registry {url}: the answer is not JSON "
                                      "(is registry.url the API's base URL?)") from exc

    async def _take_slot(self, gate: asyncio.Semaphore, url: str) -> None:
        """Wait for one of the ``max_requests_in_flight`` slots, at most ``timeout_ms`` (as
        long as a request may take), so lookups queued behind a registry that stopped
        answering fail as unavailable in about that time instead of one timeout after
        another."""
        try:
            async with asyncio.timeout(self.settings.timeout_s):
                await gate.acquire()
        except TimeoutError:
            self._counts["errors"] += 1
            s = self.settings
            raise RegistryUnavailable(
                f"schema registry {url}: no request slot free within {s.timeout_ms} ms "
                f"({s.max_requests_in_flight} requests in flight, "
                "registry.max_requests_in_flight): the registry answers slowly") from None

    async def _fetch_id(self, schema_id: int) -> RegisteredSchema:
        body = await self._get(f"/schemas/ids/{int(schema_id)}", unknown=lambda: UnknownSchemaId(
            f"schema id {schema_id} is not registered in {self._base}"))
        try:
            return await self._build(schema_id, body, depth=0)
        except UnknownSubject as exc:
            # The registry names a reference it does not hold: not the ID's fault.
            raise RegistryUnavailable(f"schema registry {self._base}: schema {schema_id}: "
                                      f"{exc}") from exc

    async def _fetch_subjects(self, schema_id: int) -> tuple[tuple[str, int], ...]:
        body = await self._get(f"/schemas/ids/{int(schema_id)}/versions",
                               unknown=lambda: UnknownSchemaId(
                                   f"schema id {schema_id} is not registered in {self._base}"))
        if not isinstance(body, list):
            raise RegistryUnavailable(f"schema registry {self._base}: /schemas/ids/{schema_id}"
                                      f"/versions answered {type(body).__name__}, not a list")
        return tuple((str(item["subject"]), int(item["version"])) for item in body
                     if isinstance(item, dict) and "subject" in item and "version" in item)

    async def _version(self, subject: str, version: int, depth: int) -> RegisteredSchema:
        key = ("version", subject, version)
        entry = self._versions.get(key)
        if entry is not None and not isinstance(entry.value, BaseException):
            return entry.value
        body = await self._get(
            f"/subjects/{quote(subject, safe='')}/versions/{int(version)}",
            unknown=lambda: UnknownSubject(
                f"referenced subject {subject!r} version {version} is not registered"))
        schema = await self._build(_int_field(body, "id", self._base), body, depth)
        self._versions.put(key, schema, self.settings.cache_ttl_s)
        return schema

    async def _build(self, schema_id: int, body: Any, depth: int) -> RegisteredSchema:
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
                                        schema=await self._version(subject, version, depth + 1)))
        return RegisteredSchema(schema_id=schema_id, schema_type=schema_type,
                                schema=body["schema"], references=tuple(refs))


def _int_field(body: Any, name: str, base: str) -> int:
    value = body.get(name) if isinstance(body, dict) else None
    if not isinstance(value, int):
        raise RegistryUnavailable(f"schema registry {base}: the answer has no integer `{name}`")
    return value


def _forget(inflight: dict[Hashable, asyncio.Task[Any]], key: Hashable,
            task: asyncio.Task[Any]) -> None:
    if inflight.get(key) is task:
        del inflight[key]
    if not task.cancelled():
        task.exception()  # retrieved here, so a lookup nobody awaited any more is not logged
