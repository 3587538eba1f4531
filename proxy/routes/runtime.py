"""The routes of one configuration generation, loaded, and one batch run through a route.

Contract:

- :func:`load_routes` compiles ``RouteTable.from_config(config)`` (the ``interceptor:``
  shorthand is one catch-all route named ``default``) and loads every chain
  link's interceptor once, in order: inline with the loader (plugins dir
  first), or as an :class:`~kiproxy.proxy.isolation.pool.IsolatedInterceptor` pool
  for ``isolation: process`` (``interceptor.workers`` workers each). It returns
  a complete :class:`LoadedRoutes` or raises (``PluginLoadError``) having
  closed every link it had loaded. A link is named by its ``class``; a chain that
  has one class twice or more names the second ``CLASS#2``, and so on
  (:func:`link_names`), so that logs, metrics and audit events tell them apart.
- :attr:`LoadedRoutes.single` is the chain when the table is exactly one
  catch-all route and no ``default`` (the shorthand, or the same written as a
  route): the produce pipeline then skips the per-batch selection; the chain
  runs the same way (:func:`~kiproxy.proxy.routes.chain.run_chain`) either way.
- :func:`one_interceptor` is the same one-link catch-all route for an
  interceptor built in code (the benches, tests, an embedding program).
"""

from __future__ import annotations

import asyncio
import dataclasses
import inspect
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kiproxy.interceptors.consume import consume_hook, produce_hook
from kiproxy.interceptors.loader import PluginLoadError, load_interceptor, resolve_class
from kiproxy.interceptors.verdict import AcknowledgementHook, acknowledgement_hook
from kiproxy.proxy.config.routes import MatchSettings
from kiproxy.proxy.isolation.pool import IsolatedInterceptor
from kiproxy.proxy.routes.chain import LoadedLink
from kiproxy.proxy.routes.table import CompiledMatch, Route, RouteTable

if TYPE_CHECKING:
    from kiproxy.proxy.config.model import ProxyConfig
    from kiproxy.proxy.config.routes import ChainLinkSettings

log = logging.getLogger("kiproxy")

__all__ = ["LoadedChain", "LoadedRoutes", "close_interceptor", "link_names", "load_routes",
           "one_interceptor"]


@dataclass(frozen=True, slots=True)
class LoadedChain:
    """One route with its chain's interceptors loaded."""

    route: Route
    links: tuple[LoadedLink, ...]
    hooks: tuple[AcknowledgementHook, ...]
    """The links' ``on_acknowledgement`` hooks (those that override the base class's)."""
    hook_names: tuple[str, ...] = ()
    """The name of each hook's link, in the same order (for the log)."""
    observe_links: bool = False
    """Some link of the chain is in observe mode."""
    consumers: tuple[LoadedLink, ...] = ()
    """The links with a fetch-side hook (``on_consume``), in reverse chain order: what
    the produce side applied last is undone first. Observe-mode links take no part."""
    every: tuple[LoadedLink, ...] = ()
    """Every link as configured (``links`` holds those with a produce hook)."""

    @property
    def name(self) -> str:
        """The route's name (the ``route`` label, audit field and log field)."""
        return self.route.name


class LoadedRoutes:
    """Every route of a generation with its chain loaded; see the module docstring."""

    __slots__ = ("_chains", "consumes", "intercepts", "single", "table")

    def __init__(self, table: RouteTable, chains: dict[int, LoadedChain]) -> None:
        self.table = table
        """The compiled routes (selection, per-client cache)."""
        self._chains = chains
        self.single: LoadedChain | None = None
        """The only chain, when it is on a catch-all route and there is no default."""
        only = table.routes[0] if len(table.routes) == 1 else None
        if only is not None and table.default is None and _matches_everything(only.match) \
                and chains[only.index].links:
            self.single = chains[only.index]
        self.intercepts = any(chain.links for chain in chains.values())
        """Some route has a produce hook (so Produce requests are decoded)."""
        self.consumes = any(chain.consumers for chain in chains.values())
        """Some route has a fetch-side hook (so Fetch responses are looked at)."""

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
                     for link in chain.every)

    async def close(self) -> None:
        """Run every link's ``close()`` (isolation pools stop their workers)."""
        for chain in self._chains.values():
            for link in chain.every:
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


def link_names(links: Sequence[ChainLinkSettings]) -> list[str]:
    """Each link's name: its ``class``, ``#N`` added to the N-th link of that class from
    the second on."""
    seen: dict[str, int] = {}
    names = []
    for link in links:
        n = seen[link.class_name] = seen.get(link.class_name, 0) + 1
        names.append(link.class_name if n == 1 else f"{link.class_name}#{n}")
    return names


def _load_link(config: ProxyConfig, link: ChainLinkSettings, name: str, where: str
               ) -> LoadedLink:
    spec = link.class_name
    if link.isolation == "process":
        if consume_hook(resolve_class(spec, config.plugins_dir)) is not None:
            raise PluginLoadError(
                f"interceptor {spec} has a fetch-side hook (on_consume), which runs "
                "in the proxy's process: isolation: process is not supported for it "
                "(remove isolation, or split the hooks into two classes)")
        pool = IsolatedInterceptor(spec, config.plugins_dir, link.config,
                                   workers=config.interceptor.workers,
                                   log_setup=(config.log_level, config.log_format),
                                   limits=config.plugin_output_limits())
        pool.start()  # a plugin that cannot load raises PluginLoadError here
        log.info("%sinterceptor %s loaded in %d worker processes (pids %s)", where, name,
                 len(pool.pids), ", ".join(map(str, pool.pids)))
        return LoadedLink(name, pool, link.timeout_ms / 1000, link.mode == "observe",
                          config.plugin_output_limits())
    interceptor = load_interceptor(spec, config.plugins_dir, link.config)
    log.info("%sinterceptor %s loaded", where, name)
    return LoadedLink(name, interceptor, link.timeout_ms / 1000, link.mode == "observe",
                      config.plugin_output_limits())


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
            for number, (link, name) in enumerate(zip(route.links, link_names(route.links),
                                                       strict=True), 1):
                try:
                    links.append(_load_link(config, link, name, where))
                except PluginLoadError as exc:
                    if shorthand:
                        raise
                    # which of the routes and links, when a file has several
                    raise PluginLoadError(f"route {route.name}, link {number} of "
                                          f"{len(route.links)}: {exc}") from exc
                loaded.append(links[-1])
            chains[route.index] = _chain(route, tuple(links))
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


def one_interceptor(interceptor: Any, name: str, timeout: float) -> LoadedRoutes:
    """``interceptor`` (built in code) as the ``interceptor:`` shorthand is: one link on
    one catch-all route named ``default``."""
    route = Route(index=0, name="default", match=CompiledMatch.of(MatchSettings()), links=())
    return LoadedRoutes(RouteTable([route]),
                        {0: _chain(route, (LoadedLink(name, interceptor, timeout),))})


def _chain(route: Route, every: tuple[LoadedLink, ...]) -> LoadedChain:
    links = tuple(link for link in every if isinstance(link.interceptor, IsolatedInterceptor)
                  or produce_hook(link.interceptor) is not None)
    hooked = [(link.name, hook) for link in links
              if (hook := acknowledgement_hook(link.interceptor)) is not None]
    # Observe mode forwards as received: a link or route in it runs no fetch-side hook.
    consumers = tuple(link for link in reversed(every) if not (link.observe or route.observe)
                      and not isinstance(link.interceptor, IsolatedInterceptor)
                      and consume_hook(link.interceptor) is not None)
    return LoadedChain(route, links, tuple(hook for _, hook in hooked),
                       tuple(name for name, _ in hooked),
                       any(link.observe for link in links), consumers, every)
