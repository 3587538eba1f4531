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

Rolling a rule out: ``mode: observe`` (on a route, the ``default`` route, a
chain link or the ``interceptor:`` shorthand) runs the chain exactly as it
would and records its verdict, but forwards the partition as received (a link
in observe mode hands the next link the batch it was given); ``observe_sample``
evaluates a fraction of batches, chosen per batch. ``dead_letter: {topic}``
copies the records a route refuses to that topic, and ``dead_letter_observed:
true`` also those an observing route or link would refuse.

A client with no principal matches no ``principal``/``principal_regex``. These
are facts of the connection and the batch; a rule on record contents belongs
inside a plugin.

:func:`route_warnings` lists routes that can never match, for a warning at start.
The compiled form is :class:`kiproxy.proxy.routes.table.RouteTable`.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from kiproxy.interceptors.extras import interceptor_feature
from kiproxy.interceptors.flags import DEFAULT_TIMEOUT_MS
from kiproxy.interceptors.topics import topic_regex
from kiproxy.proxy.config.networks import network

__all__ = [
    "ChainLinkSettings",
    "DeadLetterSettings",
    "DefaultRouteSettings",
    "MatchSettings",
    "Mode",
    "RouteSettings",
    "check_observe_sample",
    "plugin_spec",
    "route_features",
    "route_warnings",
]


Mode = Literal["enforce", "observe"]
"""How a route's or a link's verdict takes effect (see the module docstring)."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True, frozen=True)


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
        return None if value is None else topic_regex(value)

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
    mode: Mode = "enforce"
    """``enforce``: the link's verdict counts; ``observe``: it is recorded (metrics
    ``kiproxy_would_*``, the audit event's ``observed_outcome``, a rate-limited log line)
    and the next link gets the batch this one was given."""

    @field_validator("class_name")
    @classmethod
    def _module_colon_class(cls, value: str) -> str:
        return plugin_spec(value)


class DeadLetterSettings(_Strict):
    """Where a route copies the records it refuses (by the ``dead_letter_sink`` producer)."""

    topic: str = Field(min_length=1, max_length=249, pattern=r"^[A-Za-z0-9._-]+$")
    """The dead-letter topic, on the cluster of ``dead_letter_sink`` (it is not created)."""


OBSERVE_SAMPLE_NEEDS_OBSERVE = ("observe_sample applies in mode: observe only (an enforcing "
                                "chain judges every batch); set mode: observe, or remove it")
"""A sample set where nothing samples: refused rather than ignored."""


def check_observe_sample(mode: Mode, observe_sample: float) -> None:
    """Refuse a sample where nothing samples (:data:`OBSERVE_SAMPLE_NEEDS_OBSERVE`): the
    rule of a route, of ``default`` and of the top-level ``interceptor:``."""
    if observe_sample != 1.0 and mode != "observe":
        raise ValueError(OBSERVE_SAMPLE_NEEDS_OBSERVE)


class _RolloutSettings(_Strict):
    """How a route's verdicts take effect: enforced or observed, and copied when refused."""

    mode: Mode = "enforce"
    """``enforce``: refused partitions are refused, transformed ones forwarded changed;
    ``observe``: the chain runs as it would, its verdict is recorded (metrics
    ``kiproxy_would_*``, the audit event's ``observed_outcome``, a rate-limited log line)
    and the partition is forwarded exactly as received."""
    observe_sample: float = Field(default=1.0, gt=0, le=1)
    """In observe mode, the fraction of batches evaluated, each batch chosen at random on
    its own (0.1: about one batch in ten); the others are forwarded unevaluated."""
    dead_letter: DeadLetterSettings | None = None
    """Copy the records of every partition this route refuses to ``dead_letter.topic``
    (asynchronously; the producer's answer is unchanged)."""
    dead_letter_observed: bool = False
    """Copy the records an observing route or link would refuse too (needs ``dead_letter``)."""

    @model_validator(mode="after")
    def _observed_copies_need_a_topic(self) -> _RolloutSettings:
        check_observe_sample(self.mode, self.observe_sample)
        if self.dead_letter_observed and self.dead_letter is None:
            raise ValueError("dead_letter_observed: true needs dead_letter: {topic: ...} on "
                             "the same route")
        return self


class RouteSettings(_RolloutSettings):
    """One route: a name, when it applies, and its chain of interceptors."""

    name: str | None = Field(default=None, min_length=1)
    """Used in metrics (``route`` label), logs and audit events; default: the index."""
    match: MatchSettings = Field(default_factory=MatchSettings)
    """All keys given must hold; empty: every batch."""
    interceptors: tuple[ChainLinkSettings, ...] = Field(min_length=1)
    """Run in order, each on the previous one's output."""


class DefaultRouteSettings(_RolloutSettings):
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


def route_features(routes: Iterable[RouteSettings],
                   default: DefaultRouteSettings | None = None) -> list[tuple[str, str]]:
    """``(key, feature)`` of the optional features the routes use: a ``dead_letter``, a
    built-in interceptor that needs an extra (see :mod:`kiproxy.interceptors.extras`)."""
    keyed: list[tuple[str, _RolloutSettings, tuple[ChainLinkSettings, ...]]] = [
        (f"routes[{i}]", route, route.interceptors) for i, route in enumerate(routes)]
    if default is not None:
        keyed.append(("default", default, default.interceptors))
    uses: list[tuple[str, str]] = []
    for key, route, links in keyed:
        if route.dead_letter is not None:
            uses.append((f"{key}.dead_letter", "dead_letter"))
        for j, link in enumerate(links):
            feature = interceptor_feature(link.class_name)
            if feature is not None:
                uses.append((f"{key}.interceptors[{j}] ({link.class_name})", feature))
    return uses
