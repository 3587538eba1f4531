"""The routes of one configuration generation, loaded, and one batch run through a route.

Contract:

- :func:`load_routes` compiles ``RouteTable.from_config(config)`` (the ``interceptor:``
  shorthand is one catch-all route named ``default``) and loads every chain
  link's interceptor once, in order: inline with the loader (plugins dir
  first), or as an :class:`~kiproxy.proxy.isolation.pool.IsolatedInterceptor` pool
  for ``isolation: process`` (``interceptor.workers`` workers each). It returns
  a complete :class:`LoadedRoutes` or raises (``PluginLoadError``) having
  closed every link it had loaded.
- :attr:`LoadedRoutes.single` is the one link when the table is exactly one
  catch-all route with one link and no ``default`` (the shorthand, or the same
  written as a route): the produce pipeline then takes the single-interceptor
  path, with no per-batch selection at all.
- :func:`run_route` hands a batch to a route's chain
  (:func:`~kiproxy.proxy.routes.chain.run_chain` with the one verdict function,
  :func:`~kiproxy.interceptors.verdict.judge`, so the record-count rule is
  checked after each link) and answers with the verdict the pipeline acts on:
  ``Unchanged``, ``Transformed`` or ``Rejected`` (with the rejecting link's name).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiproxy.interceptors.api import InterceptContext, RecordBatch
from kiproxy.interceptors.loader import load_interceptor
from kiproxy.interceptors.verdict import (
    AcknowledgementHook,
    Rejected,
    Transformed,
    Unchanged,
    acknowledgement_hook,
    judge,
)
from kiproxy.proxy.isolation.pool import IsolatedInterceptor
from kiproxy.proxy.routes.chain import LoadedLink, run_chain
from kiproxy.proxy.routes.table import CompiledMatch, Route, RouteTable

if TYPE_CHECKING:
    from kiproxy.proxy.config.model import ProxyConfig
    from kiproxy.proxy.config.routes import ChainLinkSettings

log = logging.getLogger("kiproxy")

__all__ = ["LoadedChain", "LoadedRoutes", "RouteVerdict", "load_routes", "run_route"]


@dataclass(frozen=True, slots=True)
class LoadedChain:
    """One route with its chain's interceptors loaded."""

    route: Route
    links: tuple[LoadedLink, ...]
    hooks: tuple[AcknowledgementHook, ...]
    """The links' ``on_acknowledgement`` hooks (those that override the base class's)."""

    @property
    def name(self) -> str:
        """The route's name (the ``route`` label, audit field and log field)."""
        return self.route.name


@dataclass(frozen=True, slots=True)
class RouteVerdict:
    """What a route's chain made of one batch: a verdict, and which link decided it."""

    verdict: Unchanged | Transformed | Rejected
    link: str
    """The rejecting link's ``class`` (for a rejection), else the last link's."""


class LoadedRoutes:
    """Every route of a generation with its chain loaded; see the module docstring."""

    __slots__ = ("_chains", "single", "table")

    def __init__(self, table: RouteTable, chains: dict[int, LoadedChain]) -> None:
        self.table = table
        """The compiled routes (selection, per-client cache)."""
        self._chains = chains
        self.single: LoadedChain | None = None
        """The only chain, when it is one link on a catch-all route and there is no default."""
        only = table.routes[0] if len(table.routes) == 1 else None
        if (only is not None and table.default is None and _matches_everything(only.match)
                and len(chains[only.index].links) == 1):
            self.single = chains[only.index]

    def chain(self, route: Route) -> LoadedChain:
        """The loaded chain of ``route`` (a route of :attr:`table`)."""
        return self._chains[route.index]

    @property
    def chains(self) -> tuple[LoadedChain, ...]:
        """Every loaded chain, routes in order, then the default."""
        return tuple(self._chains.values())

    def interceptors(self) -> tuple[tuple[str, Any], ...]:
        """``(link name, interceptor)`` of every link of every route, for their metrics."""
        return tuple((link.name, link.interceptor) for chain in self._chains.values()
                     for link in chain.links)

    async def close(self) -> None:
        """Run every link's ``close()`` (isolation pools stop their workers)."""
        for chain in self._chains.values():
            for link in chain.links:
                await close_interceptor(link.interceptor, link.name)


async def close_interceptor(interceptor: Any, name: str) -> None:
    """``interceptor.close()``, awaited if it is a coroutine; a failure is logged."""
    close = getattr(interceptor, "close", None)
    if close is None:
        return
    try:
        result = close()
        if inspect.isawaitable(result):
            await result
    except Exception:
        log.exception("interceptor %s: close() failed", name)


def _matches_everything(match: CompiledMatch) -> bool:
    return all(getattr(match, f.name) is None for f in dataclasses.fields(match))


def _load_link(config: ProxyConfig, link: ChainLinkSettings, where: str) -> LoadedLink:
    spec = link.class_name
    if link.isolation == "process":
        pool = IsolatedInterceptor(spec, config.plugins_dir, link.config,
                                   workers=config.interceptor.workers,
                                   log_setup=(config.log_level, config.log_format))
        pool.start()  # a plugin that cannot load raises PluginLoadError here
        log.info("%sinterceptor %s loaded in %d worker processes (pids %s)", where, spec,
                 len(pool.pids), ", ".join(map(str, pool.pids)))
        return LoadedLink(spec, pool, link.timeout_ms / 1000)
    interceptor = load_interceptor(spec, config.plugins_dir, link.config)
    log.info("%sinterceptor %s loaded", where, spec)
    return LoadedLink(spec, interceptor, link.timeout_ms / 1000)


def load_routes(config: ProxyConfig) -> LoadedRoutes | None:
    """Every route's chain loaded (see the module docstring); None when there is no route
    and no default (every batch passes through)."""
    table = RouteTable.from_config(config)
    routes = [*table.routes, *([table.default] if table.default is not None else [])]
    if not routes:
        return None
    shorthand = config.interceptor.class_name is not None
    loaded: list[LoadedLink] = []
    chains: dict[int, LoadedChain] = {}
    try:
        for route in routes:
            where = "" if shorthand else f"route {route.name}: "
            links = []
            for link in route.links:
                links.append(_load_link(config, link, where))
                loaded.append(links[-1])
            hooks = tuple(hook for hook in map(acknowledgement_hook,
                                               (x.interceptor for x in links))
                          if hook is not None)
            chains[route.index] = LoadedChain(route, tuple(links), hooks)
    except BaseException:
        _close_now(loaded)
        raise
    return LoadedRoutes(table, chains)


def _close_now(links: list[LoadedLink]) -> None:
    """Close links loaded before a later one failed: ``close()`` of inline plugins, and
    isolation pools' workers killed (no event loop is needed for either)."""
    for link in links:
        if isinstance(link.interceptor, IsolatedInterceptor):
            link.interceptor.stop_now()
            continue
        close = getattr(link.interceptor, "close", None)
        try:
            result = close() if close is not None else None
            if inspect.iscoroutine(result):
                try:
                    asyncio.get_running_loop()
                except RuntimeError:  # a reload builds on a thread of its own: no loop
                    asyncio.run(result)
                else:  # at start, on the loop: an async close() cannot be awaited here
                    result.close()
        except Exception:
            log.exception("interceptor %s: close() failed", link.name)


async def run_route(chain: LoadedChain, batch: RecordBatch,
                    ctx: InterceptContext) -> RouteVerdict:
    """Run ``batch`` through ``chain``; see the module docstring.

    ``ctx.deadline`` must be the first link's (now + its ``timeout_ms``): a chain of
    one link, the common case, is judged with ``ctx`` as it is.
    """
    if len(chain.links) == 1:
        link = chain.links[0]
        verdict = await judge(link.interceptor, batch, ctx, name=link.name,
                              timeout=link.timeout)
        return RouteVerdict(verdict, link.name)
    result = await run_chain(chain.name, chain.links, batch, ctx, judge)
    if result.rejected_by is not None:
        assert isinstance(result.rejection, Rejected)
        return RouteVerdict(result.rejection, chain.links[result.rejected_by].name)
    verdict = Transformed(result.batch) if result.changed else Unchanged(result.batch)
    return RouteVerdict(verdict, chain.links[-1].name)
