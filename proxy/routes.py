"""Routes: which chain of interceptors a batch goes through, by who produces it and where.

Contract. ``routes:`` is an ordered list; each route has a ``name`` (default:
its index), a ``match`` and a chain ``interceptors: [{class, config,
timeout_ms, isolation}, ...]``. For each topic-partition batch the first route
whose match holds handles it; no match passes the batch through untouched,
or to the ``default:`` route when one is configured. The top-level
``interceptor:`` (with a ``class``) is shorthand for one route named
``default`` that matches everything; it cannot be combined with ``routes`` or
``default``.

``match`` keys, all optional; every key given must hold (an empty match holds
for everything):

==================  ==========================================================
``topic``           regex, matched against the whole topic name
``principal``       exact principal, or a list of them (``alice``, ``CN=app,O=Example``)
``principal_regex`` regex, matched against the whole principal
``client_id``       regex, matched against the whole ``client.id`` (absent = ``""``)
``client_address``  CIDR or list of CIDRs (IPv4 and IPv6) holding the original
                    client address (the PROXY protocol's source when present)
``listener``        listener name, or a list of them
``transactional``   true: only batches of transactional producers; false: only others
``acks``            0, 1, -1 (or ``all``), or a list of them
==================  ==========================================================

A client with no principal matches no ``principal``/``principal_regex``. These
are facts of the connection and the batch; a rule on record contents belongs
inside a plugin.

:class:`RouteTable` is the compiled form: regexes and networks are built once,
and :meth:`RouteTable.select` caches per client identity and topic, so a
batch costs a dict lookup or two whatever the number of routes.
:func:`route_warnings` lists routes that can never match, for a warning at start.
"""

from __future__ import annotations

import ipaddress
import re
import socket
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kiproxy.interceptors.identity import ClientIdentity

__all__ = [
    "ChainLinkSettings",
    "ClientRoutes",
    "CompiledMatch",
    "DefaultRouteSettings",
    "MatchSettings",
    "Route",
    "RouteSettings",
    "RouteTable",
    "client_ip",
    "in_networks",
    "network",
    "plugin_spec",
    "route_warnings",
]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network
IPAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
_CACHE_LIMIT = 10_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


def _regex(value: str) -> str:
    try:
        re.compile(value)
    except re.error as exc:
        raise ValueError(f"{value!r} is not a regular expression: {exc}") from None
    return value


def _names(value: str | list[str]) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not items or any(not item for item in items):
        raise ValueError("must be a non-empty name or a non-empty list of names")
    return tuple(items)


def network(text: str) -> Network:
    """``10.0.0.0/8``, ``2001:db8::/32`` or a single address; ``ValueError`` names the text."""
    try:
        return ipaddress.ip_network(text, strict=True)
    except ValueError as exc:
        hint = " (host bits set: write the network address)" if "host bits" in str(exc) else ""
        raise ValueError(f"{text!r} is not a CIDR{hint}") from None


class MatchSettings(_Strict):
    """When a route applies; see the module docstring for every key."""

    topic: str | None = None
    principal: tuple[str, ...] | None = None
    principal_regex: str | None = None
    client_id: str | None = None
    client_address: tuple[str, ...] | None = None
    listener: tuple[str, ...] | None = None
    transactional: bool | None = Field(default=None, strict=True)
    acks: tuple[Literal[0, 1, -1], ...] | None = None

    @field_validator("topic", "principal_regex", "client_id")
    @classmethod
    def _regexes(cls, value: str | None) -> str | None:
        return None if value is None else _regex(value)

    @field_validator("principal", "listener", mode="before")
    @classmethod
    def _name_lists(cls, value: Any) -> Any:
        return _names(value) if isinstance(value, str | list) else value

    @field_validator("client_address", mode="before")
    @classmethod
    def _networks(cls, value: Any) -> Any:
        items = [value] if isinstance(value, str) else value
        if isinstance(items, list):
            if not items:
                raise ValueError("must list at least one CIDR")
            return tuple(str(network(str(item))) for item in items)
        return value

    @field_validator("acks", mode="before")
    @classmethod
    def _acks(cls, value: Any) -> Any:
        items = value if isinstance(value, list) else [value]
        parsed = []
        for item in items:
            if item == "all":
                item = -1
            if isinstance(item, bool) or item not in (0, 1, -1):
                raise ValueError(f"{item!r} is not an acks value: 0, 1, -1 or all")
            parsed.append(item)
        if not parsed:
            raise ValueError("must list at least one acks value")
        return tuple(parsed)


def plugin_spec(value: str) -> str:
    """``MODULE:CLASS`` or a bare entry-point name such as ``uppercase``; else ``ValueError``."""
    module, colon, name = value.partition(":")
    if colon and module and name.isidentifier() and ":" not in name:
        return value
    if not colon and value.isidentifier():
        return value
    raise ValueError(f"{value!r} must be MODULE:CLASS or an entry-point name such as 'uppercase'")


class ChainLinkSettings(_Strict):
    """One interceptor of a route's chain; keys as the top-level ``interceptor:``."""

    class_name: str = Field(alias="class")
    """``MODULE:CLASS`` (plugins dir, then installed modules) or an entry-point name."""
    config: dict[str, Any] = Field(default_factory=dict)
    """Passed to the interceptor's ``configure()``."""
    timeout_ms: int = Field(default=5000, gt=0)
    """This link's deadline, counted from when the link starts; a link not done by then
    rejects the batch with REQUEST_TIMED_OUT."""
    isolation: Literal["inline", "process"] = "inline"
    """``inline`` on the event loop, or ``process`` in the isolation workers."""

    @field_validator("class_name")
    @classmethod
    def _module_colon_class(cls, value: str) -> str:
        return plugin_spec(value)


class RouteSettings(_Strict):
    """One route: a name, when it applies, and its chain of interceptors."""

    name: str | None = Field(default=None, min_length=1)
    """Used in metrics (``route`` label), logs and audit events; default: the index."""
    match: MatchSettings = Field(default_factory=MatchSettings)
    """All keys given must hold; empty: every batch."""
    interceptors: tuple[ChainLinkSettings, ...] = Field(min_length=1)
    """Run in order, each on the previous one's output."""


class DefaultRouteSettings(_Strict):
    """The route for batches no route matched (instead of passing them through)."""

    name: str = Field(default="default", min_length=1)
    interceptors: tuple[ChainLinkSettings, ...] = Field(min_length=1)


@dataclass(frozen=True, slots=True)
class CompiledMatch:
    """A :class:`MatchSettings` with its regexes and networks built."""

    topic: re.Pattern[str] | None
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
            topic=pattern(settings.topic),
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
        return self.topic is None or self.topic.fullmatch(topic) is not None

    def holds_for_request(self, acks: int, transactional: bool) -> bool:
        """The ``acks`` and ``transactional`` keys hold."""
        return ((self.acks is None or acks in self.acks)
                and (self.transactional is None or transactional == self.transactional))


def client_ip(host: str) -> IPAddress | None:
    """``host`` as an IP address (IPv4-mapped IPv6 unmapped), or None when it is not one."""
    # inet_pton: ten times faster than ipaddress's parser, and this runs once per client.
    try:
        return ipaddress.IPv4Address(socket.inet_pton(socket.AF_INET, host))
    except OSError:
        pass
    try:
        address = ipaddress.IPv6Address(
            socket.inet_pton(socket.AF_INET6, host.partition("%")[0]))
    except OSError:
        return None  # no IP known (e.g. a Unix socket peer): no CIDR holds it
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped  # a dual-stack socket's view of an IPv4 client
    return address


def in_networks(host: str, networks: tuple[Network, ...]) -> bool:
    """``host`` (an IP address as text) lies in one of ``networks``; False for a non-IP."""
    address = client_ip(host)
    return address is not None and any(address in net for net in networks)


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
        self._chosen: dict[tuple[str, int, bool], Route | None] = {}

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
        """Compile validated settings (see ``ProxyConfig.route_table``)."""
        compiled = [Route(index=i, name=r.name if r.name is not None else str(i),
                          match=CompiledMatch.of(r.match), links=r.interceptors)
                    for i, r in enumerate(routes)]
        fallback = None if default is None else Route(
            index=-1, name=default.name, match=CompiledMatch.of(MatchSettings()),
            links=default.interceptors)
        return cls(compiled, fallback)

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


def route_warnings(routes: Iterable[RouteSettings], default: DefaultRouteSettings | None = None,
                   listeners: Iterable[str] | None = None) -> list[str]:
    """Why some routes can never match: one line each, for a warning at start.

    A route after a catch-all (empty ``match``) or after a route with the same
    ``match``; a route naming a listener that is not configured (``listeners``
    given); a ``default`` after a catch-all route.
    """
    warnings: list[str] = []
    known = None if listeners is None else set(listeners)
    seen: dict[MatchSettings, str] = {}
    catch_all: str | None = None
    for i, route in enumerate(routes):
        label = f"routes[{i}]" + (f" ({route.name})" if route.name is not None else "")
        if catch_all is not None:
            warnings.append(f"{label} can never match: {catch_all} before it matches "
                            "every batch; move it up or narrow the earlier match")
        elif route.match in seen:
            warnings.append(f"{label} can never match: {seen[route.match]} before it has "
                            "the same match; merge the two or change one")
        elif known is not None and route.match.listener is not None \
                and not set(route.match.listener) & known:
            warnings.append(f"{label} can never match: match.listener "
                            f"{', '.join(route.match.listener)} names no configured listener "
                            f"({', '.join(sorted(known))})")
        seen.setdefault(route.match, label)
        if catch_all is None and route.match == MatchSettings():
            catch_all = label
    if default is not None and catch_all is not None:
        warnings.append(f"default ({default.name}) is never used: {catch_all} matches "
                        "every batch")
    return warnings
