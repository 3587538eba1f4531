"""``LookupCache``: answers of an outside service by key, each kept for a lifetime, at most
one lookup in flight per key. Every cache of the schema registry built-in is one of these
(the client's schemas, subjects and latest versions; the check's compiled schemas,
subjects, latest ids and Apicurio globalIds).

Contract, for :meth:`LookupCache.get` (``fetch`` asks the service):

* A fresh answer is returned as it is; a fresh *negative* answer (an exception of a type
  in ``remember``: "no such id", "cannot be compiled here", "the registry did not answer")
  is raised again, without asking, for ``negative_ttl_s``; after that the key is asked
  again and the caller waits for the answer.
* An answer past ``ttl_s`` keeps serving while one refresh runs in the background
  (stale-while-revalidate): the caller never waits for a refresh. A refresh that fails
  with an exception in ``keep_stale_on`` (the service is down) keeps the old answer and
  tries again after ``negative_ttl_s``; one that fails otherwise replaces it.
  :meth:`LookupCache.refresh` asks now and waits, for a caller that must know.
* While a lookup of a key is in flight, every caller of the same key awaits that one
  (:meth:`LookupCache.flight` hands it over instead, for a caller that must not join it,
  which then asks on its own account with :meth:`LookupCache.get_own`). A caller that is
  cancelled does not cancel the lookup.
* At most ``size`` keys are kept, the least recently used going first.

:meth:`LookupCache.peek` is the synchronous view of the same rules for code that judges
what it can without awaiting: the fresh or stale answer (a refresh started when stale),
a remembered negative answer as the exception (not raised), or ``None`` when the caller
must await :meth:`get`.

No event-loop state outlives a loop: a lookup in flight in a loop that is no longer the
running one is ignored (a Spark executor runs successive loops with one cache).
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable, Hashable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

__all__ = ["CacheCounts", "LookupCache"]

_V = TypeVar("_V")


@dataclass(slots=True)
class CacheCounts:
    """Counters of one or more caches (they may share one)."""

    lookups: int = 0
    """``hits`` + ``misses`` + ``unknown``."""
    hits: int = 0
    """Answered from the cache (``stale`` among them) or by joining a lookup in flight."""
    misses: int = 0
    """Started a lookup of the service and waited for it."""
    unknown: int = 0
    """Answered by a remembered negative answer."""
    stale: int = 0
    """Answered past their lifetime, a refresh running or the service down."""
    refreshes: int = 0
    """Background refreshes started."""


class _Entry(Generic[_V]):
    __slots__ = ("expires", "value")

    def __init__(self, value: _V | BaseException, expires: float) -> None:
        self.value = value
        self.expires = expires


class LookupCache(Generic[_V]):
    """A bounded map of key -> answer with lifetimes and single flight (see the module)."""

    def __init__(self, *, size: int, ttl_s: float, negative_ttl_s: float,
                 remember: tuple[type[BaseException], ...] = (),
                 keep_stale_on: tuple[type[BaseException], ...] = (),
                 counts: CacheCounts | None = None) -> None:
        self.size = size
        self.ttl_s = ttl_s
        self.negative_ttl_s = negative_ttl_s
        self._remember = remember
        self._keep_stale_on = keep_stale_on
        self.counts = counts if counts is not None else CacheCounts()
        self._data: OrderedDict[Hashable, _Entry[_V]] = OrderedDict()
        self._inflight: dict[Hashable, asyncio.Task[_V]] = {}

    def __len__(self) -> int:
        return len(self._data)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._data

    def peek(self, key: Hashable, fetch: Callable[[], Awaitable[_V]]) -> _V | BaseException | None:
        """The answer known now (see the module): a value, a remembered exception, or None."""
        entry = self._data.get(key)
        if entry is None:
            return None
        now = time.monotonic()
        if isinstance(entry.value, BaseException):
            if entry.expires > now:
                return entry.value
            return None
        self._data.move_to_end(key)
        if entry.expires <= now:
            self._refresh(key, fetch)
        return entry.value

    async def get(self, key: Hashable, fetch: Callable[[], Awaitable[_V]]) -> _V:
        """The answer for ``key``, from the cache or from ``fetch`` (see the module)."""
        found = self.flight(key, fetch)
        if isinstance(found, asyncio.Task):
            return await asyncio.shield(found)
        return found

    def flight(self, key: Hashable, fetch: Callable[[], Awaitable[_V]]
               ) -> _V | asyncio.Task[_V]:
        """:meth:`get` up to the wait: the answer known now (a remembered negative one
        raised), else the lookup in flight, started if there is none, for the caller to
        await (through :func:`asyncio.shield`) or to leave for :meth:`get_own`."""
        counts = self.counts
        counts.lookups += 1
        entry = self._data.get(key)
        now = time.monotonic()
        if entry is not None:
            value = entry.value
            if isinstance(value, BaseException):
                if entry.expires > now:
                    counts.unknown += 1
                    raise value
            else:
                self._data.move_to_end(key)
                counts.hits += 1
                if entry.expires <= now:
                    counts.stale += 1
                    self._refresh(key, fetch)
                return value
        if self._live(key) is None:
            counts.misses += 1
        else:
            counts.hits += 1  # joins the lookup in flight: no request of its own
        return self._task(key, fetch)

    async def get_own(self, key: Hashable, fetch: Callable[[], Awaitable[_V]]) -> _V:
        """Ask the service on the caller's own account, not by joining the lookup in
        flight (which may be waiting on the caller), and keep the answer as :meth:`get`
        keeps it."""
        return await self._settle(key, fetch)

    async def refresh(self, key: Hashable, fetch: Callable[[], Awaitable[_V]]) -> _V:
        """Ask the service now (joining a lookup in flight) and wait for its answer, which
        replaces the cached one; a failure is raised even when the old answer is kept."""
        return await asyncio.shield(self._task(key, fetch))

    def put(self, key: Hashable, value: _V | BaseException, ttl_s: float | None = None) -> None:
        """Keep ``value`` (or a negative answer) for ``ttl_s`` (default: its kind's lifetime)."""
        if ttl_s is None:
            ttl_s = self.negative_ttl_s if isinstance(value, BaseException) else self.ttl_s
        self._data[key] = _Entry(value, time.monotonic() + ttl_s)
        self._data.move_to_end(key)
        while len(self._data) > self.size:
            self._data.popitem(last=False)

    def adopt(self, other: LookupCache[_V]) -> None:
        """Take ``other``'s answers that this cache has none of, each with the lifetime it
        has left - not its negative ones, which are asked again (see :meth:`Lookups.adopt
        <kiproxy.interceptors.builtin.schema_registry.lookups.Lookups.adopt>`)."""
        for key, entry in other._data.items():
            if key not in self._data and not isinstance(entry.value, BaseException):
                self._data[key] = _Entry(entry.value, entry.expires)
        while len(self._data) > self.size:
            self._data.popitem(last=False)

    def drop(self, key: Hashable) -> None:
        """Forget ``key``'s answer: the next lookup asks the service."""
        self._data.pop(key, None)

    def clear(self) -> None:
        """Forget every answer (lookups in flight still settle into the cache)."""
        self._data.clear()

    # -- lookups ------------------------------------------------------------------------

    def _refresh(self, key: Hashable, fetch: Callable[[], Awaitable[_V]]) -> None:
        if self._live(key) is None:
            self.counts.refreshes += 1
            self._task(key, fetch)

    def _live(self, key: Hashable) -> asyncio.Task[_V] | None:
        task = self._inflight.get(key)
        if task is None or task.done():
            return None
        try:
            if task.get_loop() is not asyncio.get_running_loop():
                return None
        except RuntimeError:
            return None
        return task

    def _task(self, key: Hashable, fetch: Callable[[], Awaitable[_V]]) -> asyncio.Task[_V]:
        task = self._live(key)
        if task is None:
            task = asyncio.get_running_loop().create_task(self._settle(key, fetch))
            self._inflight[key] = task
            task.add_done_callback(lambda t: self._forget(key, t))
        return task

    async def _settle(self, key: Hashable, fetch: Callable[[], Awaitable[_V]]) -> _V:
        try:
            value = await fetch()
        except self._keep_stale_on as exc:
            old = self._data.get(key)
            if old is not None and not isinstance(old.value, BaseException):
                old.expires = time.monotonic() + self.negative_ttl_s  # try again then
            elif isinstance(exc, self._remember):
                self.put(key, exc)
            raise
        except self._remember as exc:
            self.put(key, exc)
            raise
        self.put(key, value)
        return value

    def _forget(self, key: Hashable, task: asyncio.Task[Any]) -> None:
        if self._inflight.get(key) is task:
            del self._inflight[key]
        if not task.cancelled():
            task.exception()  # retrieved, so a refresh nobody awaits is not logged
