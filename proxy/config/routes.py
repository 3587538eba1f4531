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

:func:`route_warnings` lists routes that can never match, for a warning at start.
The compiled form is :class:`kiproxy.proxy.routes.table.RouteTable`.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kiproxy.interceptors.flags import DEFAULT_TIMEOUT_MS
from kiproxy.proxy.config.networks import network

__all__ = [
    "ChainLinkSettings",
    "DefaultRouteSettings",
    "MatchSettings",
    "RouteSettings",
    "plugin_spec",
    "route_warnings",
]


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
    timeout_ms: int = Field(default=DEFAULT_TIMEOUT_MS, gt=0)
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
