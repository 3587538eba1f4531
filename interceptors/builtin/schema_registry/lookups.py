"""``Lookups``: what the contract check knows of the registry, each answer with its lifetime.

Contract: four :class:`~.lookup_cache.LookupCache` caches, one lookup in flight per key
in each, answered without waiting when known (``compiled``, ``global_id``, ``subjects``,
``latest``: None means "look it up") and by awaiting otherwise:

* compiled schemas by id, ``cache_ttl_s``, then refreshed in the background while the
  old one serves; the schema is fetched anew from the registry for each refresh and
  compiled on at most ``compile_threads`` worker threads, never on the event loop;
* an id's subjects and a subject's latest id, ``lookup_ttl_s``, likewise;
* an Apicurio globalId's id on the Confluent-compatible API, for good (a globalId names
  one immutable version);
* negative answers, ``negative_ttl_s``, then asked again: an id the registry does not
  know (:class:`Missing`, the record's fault), and an id the registry could not be asked
  about or whose schema cannot be compiled here (:class:`Unavailable`, not the record's
  fault: ``on_registry_unavailable`` decides). An uncompilable schema is counted
  (``uncompilable``) and logged at WARNING with the id and the compiler's message, at
  most every 10 seconds per id.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, TypeVar

from kiproxy.interceptors.builtin.schema_registry.formats import (
    CompiledSchema,
    GlobalIdLookup,
    SchemaCompileError,
    SchemaLookup,
    SchemaSource,
)
from kiproxy.interceptors.builtin.schema_registry.lookup_cache import LookupCache
from kiproxy.interceptors.log_limit import MORE_IN_INTERVAL, RateLimitedLog

__all__ = ["Lookups", "Missing", "Unavailable"]

_T = TypeVar("_T")

log = logging.getLogger("kiproxy.schema_registry")


@dataclass(frozen=True, slots=True)
class Missing:
    """The registry has no such thing: the record is refused under ``check``."""

    check: str
    text: str


class Unavailable(Exception):
    """A lookup the registry could not answer, or a schema the proxy cannot compile;
    carries the message."""


class _Uncompilable(Exception):
    """The registry's schema for an id cannot be compiled here; carries why."""


class Lookups:
    """The check's caches of registry answers (see the module docstring)."""

    def __init__(self, client: SchemaLookup | None, global_ids: GlobalIdLookup | None, *,
                 unknown_id: type[Exception], unavailable: type[Exception],
                 compile: Callable[[SchemaSource], CompiledSchema], size: int,
                 cache_ttl_s: float, lookup_ttl_s: float, negative_ttl_s: float,
                 compile_threads: int) -> None:
        self.client = client
        self.global_ids = global_ids
        self._unknown_id = unknown_id
        self._unavailable = unavailable
        self._compile = compile
        self._compiled: LookupCache[CompiledSchema] = LookupCache(
            size=size, ttl_s=cache_ttl_s, negative_ttl_s=negative_ttl_s,
            remember=(unknown_id, unavailable, _Uncompilable),
            keep_stale_on=(unavailable, _Uncompilable))
        self._global: LookupCache[int] = LookupCache(
            size=size, ttl_s=math.inf, negative_ttl_s=negative_ttl_s,
            remember=(unknown_id, unavailable), keep_stale_on=(unavailable,))
        self._subjects: LookupCache[tuple[frozenset[str], float]] = LookupCache(
            size=size, ttl_s=lookup_ttl_s, negative_ttl_s=negative_ttl_s,
            remember=(unavailable,), keep_stale_on=(unavailable,))
        """id -> (subjects, fetched at)."""
        self._latest: LookupCache[int] = LookupCache(
            size=size, ttl_s=lookup_ttl_s, negative_ttl_s=negative_ttl_s,
            remember=(unavailable,), keep_stale_on=(unavailable,))
        self._compile_threads = compile_threads
        self._threads: ThreadPoolExecutor | None = None
        self._warn = RateLimitedLog(log)
        self.uncompilable = 0
        """Lookups whose schema could not be compiled here."""

    def adopt(self, earlier: Lookups) -> None:
        """Take what ``earlier`` (a check of the same registry, replaced by a reload) knows:
        its compiled schemas, subjects, latest ids and globalIds, each with the lifetime
        it has left, so a reload while the registry is unreachable keeps serving what was
        served before it; a stale answer is refreshed in the background as any other.
        Its negative answers are not taken: they are asked again."""
        self._compiled.adopt(earlier._compiled)
        self._global.adopt(earlier._global)
        self._subjects.adopt(earlier._subjects)
        self._latest.adopt(earlier._latest)

    def close(self) -> None:
        """Stop the compiling threads (a compile under way finishes on its own)."""
        threads, self._threads = self._threads, None
        if threads is not None:
            threads.shutdown(wait=False)

    # -- compiled schemas by id --------------------------------------------------------

    def compiled(self, schema_id: int) -> CompiledSchema | Missing | Unavailable | None:
        """What is known of ``schema_id`` now, without waiting (None: look it up)."""
        found: CompiledSchema | Missing | Unavailable | None = self._answer(
            schema_id, self._compiled.peek(schema_id, lambda: self._load(schema_id)))
        return found

    async def lookup(self, schema_id: int) -> CompiledSchema | Missing | Unavailable:
        """The compiled schema of ``schema_id``, or why there is none."""
        try:
            return await self._compiled.get(schema_id, lambda: self._load(schema_id))
        except (self._unknown_id, self._unavailable, _Uncompilable) as exc:
            return self._answer(schema_id, exc)  # type: ignore[no-any-return]

    async def relook(self, schema_id: int, looked: dict[int, Any]) -> None:
        """:meth:`lookup` into ``looked``."""
        looked[schema_id] = await self.lookup(schema_id)

    def _answer(self, schema_id: object, found: Any) -> Any:
        """What a cache holds for ``schema_id`` (or a subject), as the check reads it: a
        value, None, :class:`Missing` (an id the registry does not know) or
        :class:`Unavailable` (a failure remembered for ``negative_ttl_s``)."""
        if isinstance(found, self._unknown_id):
            return Missing("unknown_id", f"schema id {schema_id} is not registered")
        if isinstance(found, BaseException):
            return Unavailable(str(found))
        return found

    async def _read(self, what: str, answer: Awaitable[_T]) -> _T:
        """``answer``, a lookup of ``what`` from the registry; what else it raises than the
        registry's own answers (no such id, unavailable) is an answer the proxy cannot
        read (a field of the wrong type, nesting past Python's recursion limit): the
        registry is taken as unavailable, which producers retry and the caches remember
        for ``registry.negative_ttl_s``, rather than the records' fault."""
        try:
            return await answer
        except (self._unknown_id, self._unavailable):
            raise
        except Exception as exc:
            raise self._unavailable(
                f"schema registry: {what}: the registry's answer cannot be read "
                f"({type(exc).__name__}: {exc})") from exc

    async def _load(self, schema_id: int) -> CompiledSchema:
        assert self.client is not None
        # fresh: this cache keeps the compiled schema; a second copy in the client's
        # cache would double a large schema's memory and outlive this cache's lifetimes
        source = await self._read(f"schema id {schema_id}",
                                  self.client.schema_by_id(schema_id, fresh=True))
        if self._threads is None:
            self._threads = ThreadPoolExecutor(self._compile_threads,
                                               thread_name_prefix="schema-compile")
        loop = asyncio.get_running_loop()
        try:
            return await loop.run_in_executor(self._threads, self._compile, source)
        except Exception as exc:  # SchemaCompileError, or what a compiler let out
            if not isinstance(exc, SchemaCompileError):  # nesting too deep, a bad name...
                exc = SchemaCompileError(f"{type(exc).__name__}: {exc}")
            self.uncompilable += 1
            self._warn.warning(("uncompilable", schema_id),
                               "schema registry: schema id %d cannot be compiled by the "
                               "proxy, so records carrying it cannot be checked (they follow "
                               "on_registry_unavailable; it is fetched again after "
                               "registry.negative_ttl_s): %s", schema_id, exc,
                               more=MORE_IN_INTERVAL)
            raise _Uncompilable(f"the proxy cannot compile its schema ({exc})") from None

    # -- Apicurio globalIds ------------------------------------------------------------

    def global_id(self, global_id: int) -> int | Missing | Unavailable | None:
        """The registry's id of an Apicurio globalId if known now (None: look it up)."""
        found = self._global.peek(global_id, lambda: self._load_global(global_id))
        if isinstance(found, self._unknown_id):
            return Missing("unknown_id", str(found))
        if isinstance(found, BaseException):
            return Unavailable(str(found))
        return found

    async def lookup_global(self, global_id: int) -> int | Missing | Unavailable:
        """The registry's id of an Apicurio globalId, or why there is none."""
        try:
            return await self._global.get(global_id, lambda: self._load_global(global_id))
        except self._unknown_id as exc:
            return Missing("unknown_id", str(exc))
        except self._unavailable as exc:
            return Unavailable(str(exc))

    async def relook_global(self, global_id: int, looked: dict[int, Any]) -> None:
        """:meth:`lookup_global` into ``looked``."""
        looked[global_id] = await self.lookup_global(global_id)

    async def _load_global(self, global_id: int) -> int:
        assert self.global_ids is not None
        return await self._read(f"globalId {global_id}",
                                self.global_ids.registry_id(global_id))

    # -- subjects and latest versions --------------------------------------------------

    def subjects(self, schema_id: int) -> tuple[frozenset[str], float] | Unavailable | None:
        """``schema_id``'s subjects and when they were fetched, if known now; or why the
        registry could not say, remembered for ``negative_ttl_s`` (not asked again
        meanwhile, as for an id)."""
        found = self._subjects.peek(schema_id, lambda: self._load_subjects(schema_id))
        return found if isinstance(found, tuple) else self._answer(schema_id, found)

    async def fetch_subjects(self, schema_id: int, down: dict[tuple[str, object], str]
                             ) -> None:
        """Ask the registry for ``schema_id``'s subjects now; its failure into ``down``."""
        try:
            await self._subjects.refresh(schema_id, lambda: self._load_subjects(schema_id))
        except self._unavailable as exc:
            down[("subjects", schema_id)] = str(exc)

    async def _load_subjects(self, schema_id: int) -> tuple[frozenset[str], float]:
        # Asked of the registry (fresh): these lookups are the cache, kept lookup_ttl_s;
        # the client's own cache under them would keep an old answer as long again.
        assert self.client is not None
        try:
            pairs = await self._read(f"the subjects of schema id {schema_id}",
                                     self.client.subjects_of(schema_id, fresh=True))
        except self._unknown_id:
            pairs = ()
        return frozenset(s for s, _ in pairs), time.monotonic()

    def latest(self, subject: str) -> int | Unavailable | None:
        """The id of ``subject``'s latest version (-1: none), if known now; or why the
        registry could not say, remembered as :meth:`subjects` remembers it."""
        found = self._latest.peek(subject, lambda: self._load_latest(subject))
        return found if isinstance(found, int) else self._answer(subject, found)

    async def fetch_latest(self, subject: str, down: dict[tuple[str, object], str]) -> None:
        """Ask the registry for ``subject``'s latest id now; its failure into ``down``."""
        try:
            await self._latest.refresh(subject, lambda: self._load_latest(subject))
        except self._unavailable as exc:
            down[("latest", subject)] = str(exc)

    async def _load_latest(self, subject: str) -> int:
        assert self.client is not None
        try:
            return await self._read(f"the latest version of {subject!r}",
                                    self.client.latest_id(subject, fresh=True))
        except self._unknown_id:
            return -1  # no version at all: no id is the latest
