"""The compiled routes: which route handles a batch, decided in a dict lookup or two.

Contract. :class:`RouteTable` is the compiled form of the ``routes:`` and
``default:`` settings (:mod:`kiproxy.proxy.config.routes`, where every
``match`` key is described): regexes and networks are built once, and
:meth:`RouteTable.select` caches per client identity and topic, so a batch
costs a dict lookup or two whatever the number of routes. The first route
whose match holds handles a batch; no match passes it through untouched, or
to the ``default:`` route when one is configured.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiproxy.interceptors.identity import ClientIdentity
from kiproxy.interceptors.topics import TopicPattern
from kiproxy.proxy.config.networks import IPAddress, Network, client_ip, network
from kiproxy.proxy.config.routes import (
    ChainLinkSettings,
    DefaultRouteSettings,
    MatchSettings,
    RouteSettings,
)

if TYPE_CHECKING:
    from kiproxy.proxy.config.model import ProxyConfig

__all__ = ["ClientRoutes", "CompiledMatch", "Route", "RouteTable"]

_CACHE_LIMIT = 10_000


@dataclass(frozen=True, slots=True)
class CompiledMatch:
    """A :class:`MatchSettings` with its regexes and networks built."""

    topic: TopicPattern | None
    principals: frozenset[str] | None
    principal_regex: re.Pattern[str] | None
    client_id: re.Pattern[str] | None
    networks: tuple[Network, ...] | None
    listeners: frozenset[str] | None
    transactional: bool | None
    acks: frozenset[int] | None

    @classmethod
    def of(cls, settings: MatchSettings) -> CompiledMatch:
        """Compile ``settings`` (already validated)."""
        def pattern(text: str | None) -> re.Pattern[str] | None:
            return None if text is None else re.compile(text)
        return cls(
            topic=None if settings.topic is None else TopicPattern(settings.topic),
            principals=None if settings.principal is None else frozenset(settings.principal),
            principal_regex=pattern(settings.principal_regex),
            client_id=pattern(settings.client_id),
            networks=None if settings.client_address is None
            else tuple(network(n) for n in settings.client_address),
            listeners=None if settings.listener is None else frozenset(settings.listener),
            transactional=settings.transactional,
            acks=None if settings.acks is None else frozenset(settings.acks),
        )

    def holds_for_client(self, identity: ClientIdentity,
                         address: IPAddress | None = None) -> bool:
        """The connection keys (principal, client id, address, listener) hold.

        ``address`` is ``identity.client_host`` already parsed (see :func:`client_ip`).
        """
        principal = identity.principal
        if self.principals is not None and principal not in self.principals:
            return False
        if self.principal_regex is not None and (
                principal is None or not self.principal_regex.fullmatch(principal)):
            return False
        if self.client_id is not None and not self.client_id.fullmatch(identity.client_id or ""):
            return False
        if self.listeners is not None and identity.listener not in self.listeners:
            return False
        if self.networks is None:
            return True
        if address is None:
            address = client_ip(identity.client_host)
        return address is not None and any(address in net for net in self.networks)

    def holds_for_topic(self, topic: str) -> bool:
        """The ``topic`` key holds."""
        return self.topic is None or self.topic.holds(topic)

    def holds_for_request(self, acks: int, transactional: bool) -> bool:
        """The ``acks`` and ``transactional`` keys hold."""
        return ((self.acks is None or acks in self.acks)
                and (self.transactional is None or transactional == self.transactional))


@dataclass(frozen=True, slots=True)
class Route:
    """A compiled route: what to match and which chain to run."""

    index: int
    """Position in ``routes`` (-1 for the ``default`` route)."""
    name: str
    """The route's name: its ``name``, else its index as text."""
    match: CompiledMatch
    links: tuple[ChainLinkSettings, ...]
    """The chain, in order. The runtime loads each link's interceptor once per
    configuration generation and finds it by ``(route.index, link index)``."""
    observe: bool = False
    """``mode: observe``: the chain's verdict is recorded, the partition forwarded as
    received."""
    observe_sample: float = 1.0
    """In observe mode, the fraction of batches evaluated (chosen per batch)."""
    dead_letter: str | None = None
    """The topic refused records are copied to, or None."""
    dead_letter_observed: bool = False
    """Records an observing route or link would refuse are copied too."""


def _route(index: int, name: str, match: MatchSettings,
           settings: RouteSettings | DefaultRouteSettings) -> Route:
    return Route(index=index, name=name, match=CompiledMatch.of(match),
                 links=settings.interceptors, observe=settings.mode == "observe",
                 observe_sample=settings.observe_sample,
                 dead_letter=settings.dead_letter.topic if settings.dead_letter else None,
                 dead_letter_observed=settings.dead_letter_observed)


class ClientRoutes:
    """The routes one client identity can ever match, with a per-batch-kind cache.

    Get one from :meth:`RouteTable.for_client` when a connection's identity is
    set (or changes) and keep it with the connection: selecting is then one
    dict lookup keyed by ``(topic, acks, transactional)``.
    """

    __slots__ = ("_chosen", "_default", "_routes")

    def __init__(self, routes: tuple[Route, ...], default: Route | None) -> None:
        self._routes = routes
        self._default = default
        self._chosen: dict[tuple[str, int, bool] | str, Route | None] = {}

    def select(self, topic: str, acks: int, transactional: bool) -> Route | None:
        """The first route that holds for a batch of ``topic``, else the default, else None."""
        key = (topic, acks, transactional)
        try:
            return self._chosen[key]
        except KeyError:
            pass
        chosen = next((r for r in self._routes if r.match.holds_for_topic(topic)
                       and r.match.holds_for_request(acks, transactional)), self._default)
        if len(self._chosen) >= _CACHE_LIMIT:
            self._chosen.clear()
        self._chosen[key] = chosen
        return chosen

    def select_fetch(self, topic: str) -> Route | None:
        """The route whose fetch-side hooks run on a Fetch response's ``topic``: the first
        whose connection and ``topic`` keys hold (``acks`` and ``transactional`` describe
        a produce request and take no part), else the default, else None."""
        try:
            return self._chosen[topic]
        except KeyError:
            pass
        chosen = next((r for r in self._routes if r.match.holds_for_topic(topic)),
                      self._default)
        if len(self._chosen) >= _CACHE_LIMIT:
            self._chosen.clear()
        self._chosen[topic] = chosen
        return chosen


class RouteTable:
    """The compiled ``routes`` (plus ``default``) of one configuration generation."""

    __slots__ = ("_clients", "default", "routes")

    def __init__(self, routes: Iterable[Route], default: Route | None = None) -> None:
        self.routes: tuple[Route, ...] = tuple(routes)
        """The routes, in order."""
        self.default = default
        """The route for batches no route matched, or None (pass through)."""
        self._clients: dict[ClientIdentity, ClientRoutes] = {}

    @classmethod
    def from_settings(cls, routes: Iterable[RouteSettings],
                      default: DefaultRouteSettings | None = None) -> RouteTable:
        """Compile validated settings (see :meth:`from_config`)."""
        compiled = [_route(i, r.name if r.name is not None else str(i), r.match, r)
                    for i, r in enumerate(routes)]
        fallback = None if default is None else _route(-1, default.name, MatchSettings(),
                                                       default)
        return cls(compiled, fallback)

    @classmethod
    def from_config(cls, config: ProxyConfig) -> RouteTable:
        """The compiled routes of ``config``; the ``interceptor:`` shorthand becomes one
        route ``default`` that matches everything."""
        if config.interceptor.class_name is not None:
            plugin_config = config.interceptor.config
            if config.interceptor.properties is not None:
                plugin_config = {**plugin_config, "properties": config.interceptor.properties}
            link = ChainLinkSettings.model_validate({
                "class": config.interceptor.class_name, "config": plugin_config,
                "timeout_ms": config.interceptor.timeout_ms,
                "isolation": config.interceptor.isolation})
            return cls.from_settings(
                [RouteSettings(name="default", match=MatchSettings(), interceptors=(link,),
                               mode=config.interceptor.mode,
                               observe_sample=config.interceptor.observe_sample)])
        return cls.from_settings(config.routes, config.default)

    def for_client(self, identity: ClientIdentity) -> ClientRoutes:
        """The routes whose connection keys hold for ``identity`` (cached)."""
        found = self._clients.get(identity)
        if found is None:
            address = client_ip(identity.client_host)
            found = ClientRoutes(
                tuple(r for r in self.routes if r.match.holds_for_client(identity, address)),
                self.default)
            if len(self._clients) >= _CACHE_LIMIT:
                self._clients.clear()
            self._clients[identity] = found
        return found

    def select(self, identity: ClientIdentity, topic: str, acks: int,
               transactional: bool) -> Route | None:
        """The route that handles a batch, or None: pass it through untouched."""
        return self.for_client(identity).select(topic, acks, transactional)
