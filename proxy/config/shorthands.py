"""Built-in composites written as one interceptor, rewritten into the routes they stand for.

Contract. Which topic and in which order belong to the routes (``routes:`` and a
route's ``interceptors:`` list), which the runtime runs with a deadline, a mode
and metrics per link. Two built-ins were written before routes existed and do
the same inside one interceptor: ``chain`` (links in order) and
``topic_router`` (an interceptor per topic regex). :func:`expand_shorthands`
rewrites a config file's mapping, before it is validated, so that they become
routes:

- ``interceptor: {class: chain, config: {links: [...]}}`` becomes one route
  ``default`` whose ``interceptors`` are the links, each with the
  interceptor's ``timeout_ms``, ``isolation`` and ``mode``;
- ``interceptor: {class: topic_router, config: {routes: [...]}}`` becomes one
  route per entry, ``match: {topic: REGEX}``, in the same order (named by
  their index, as routes without a name are);
- a ``chain`` link of a route (or of ``default``) becomes its links, in place.

Each rewrite returns a line saying what the config should say instead (the
caller logs it as a deprecation warning). A shape that cannot be rewritten
exactly or as cheaply (its own ``plugins_dir`` other than the proxy's,
``properties``, ``isolation: process``, a malformed link) is left alone: the
built-in then runs it as before and reports its own errors.
"""

from __future__ import annotations

from typing import Any

__all__ = ["CHAIN", "TOPIC_ROUTER", "expand_shorthands"]

CHAIN = frozenset({"chain", "kiproxy.interceptors.builtin.chain:Chain"})
"""The names of the ``chain`` built-in."""
TOPIC_ROUTER = frozenset({"topic_router", "kiproxy.interceptors.builtin.route:TopicRouter"})
"""The names of the ``topic_router`` built-in."""

_LINK_KEYS = ("timeout_ms", "isolation", "mode")
"""What every link of a rewritten composite takes from the interceptor it replaces."""


def _link(item: Any) -> dict[str, Any] | None:
    """A composite's ``{interceptor, config}`` (or the name alone) as a route's chain link."""
    if isinstance(item, str):
        item = {"interceptor": item}
    if not isinstance(item, dict) or not isinstance(item.get("interceptor"), str) \
            or set(item) - {"interceptor", "config"}:
        return None
    return {"class": item["interceptor"], "config": item.get("config") or {}}


def _items(settings: dict[str, Any], data: dict[str, Any], names: frozenset[str],
           key: str) -> list[Any] | None:
    """The non-empty list ``config.<key>`` of the composite ``settings`` names, when it can be
    rewritten: inline, no other key than ``key`` and a ``plugins_dir`` that is the proxy's."""
    config = settings.get("config")
    # In process isolation one worker pool runs the whole composite; as routes, every
    # link would get a pool of its own and every batch a hop per link.
    if settings.get("class") not in names or not isinstance(config, dict) \
            or settings.get("isolation") == "process" \
            or set(config) - {key, "plugins_dir"} \
            or config.get("plugins_dir", data.get("plugins_dir")) != data.get("plugins_dir"):
        return None
    items = config.get(key)
    return items if isinstance(items, list) and items else None


def _chain_links(settings: dict[str, Any], data: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The links of a ``chain`` given as ``settings`` (class, config...), else None."""
    items = _items(settings, data, CHAIN, "links")
    links = None if items is None else [_link(item) for item in items]
    if links is None or any(link is None for link in links):
        return None
    inherited = {k: settings[k] for k in _LINK_KEYS if k in settings}
    return [{**link, **inherited} for link in links if link is not None]


def _router_routes(settings: dict[str, Any], data: dict[str, Any]) -> list[dict[str, Any]] | None:
    """The routes a ``topic_router`` given as ``settings`` stands for, else None."""
    items = _items(settings, data, TOPIC_ROUTER, "routes")
    if items is None:
        return None
    routes: list[dict[str, Any]] = []
    inherited: dict[str, Any] = {k: settings[k] for k in ("timeout_ms", "isolation")
                                 if k in settings}
    rollout: dict[str, Any] = {k: settings[k] for k in ("mode", "observe_sample")
                               if k in settings}
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("topic"), str):
            return None
        link = _link({k: v for k, v in item.items() if k != "topic"})
        if link is None:
            return None
        routes.append({"match": {"topic": item["topic"]},
                       "interceptors": [{**link, **inherited}], **rollout})
    return routes


_ROUTE_KEYS = ("class", "config", "properties", *_LINK_KEYS, "observe_sample")
"""The ``interceptor:`` keys a rewrite moves into the routes; the others (``workers``,
``compression``) stay, as they hold for every route."""


def _expand_interceptor(data: dict[str, Any]) -> str | None:
    settings = data.get("interceptor")
    if not isinstance(settings, dict) or settings.get("properties") is not None \
            or "routes" in data or "default" in data:
        return None
    links = _chain_links(settings, data)
    routes: list[dict[str, Any]] | None
    if links is not None:
        rollout = {k: settings[k] for k in ("mode", "observe_sample") if k in settings}
        if "mode" in rollout:  # the route observes; its links run as links of it do
            links = [{k: v for k, v in link.items() if k != "mode"} for link in links]
        routes = [{"name": "default", "interceptors": links, **rollout}]
        what = (f"interceptor: {{class: {settings['class']}}} is deprecated: its links are "
                "now the interceptors of one route (routes: [{name: default, interceptors: "
                "[{class: ..., config: ...}, ...]}]); write that instead")
    else:
        routes = _router_routes(settings, data)
        if routes is None:
            return None
        what = (f"interceptor: {{class: {settings['class']}}} is deprecated: each of its "
                "routes is now a route (routes: [{match: {topic: REGEX}, interceptors: "
                "[{class: ..., config: ...}]}, ...]); write that instead")
    data["interceptor"] = {k: v for k, v in settings.items() if k not in _ROUTE_KEYS}
    data["routes"] = routes
    return what


def _expand_links(data: dict[str, Any]) -> list[str]:
    notes = []
    keyed: list[tuple[str, Any]] = [(f"routes[{i}]", route)
                                    for i, route in enumerate(data.get("routes") or [])]
    keyed.append(("default", data.get("default")))
    for key, route in keyed:
        links = route.get("interceptors") if isinstance(route, dict) else None
        if not isinstance(links, list):
            continue
        flat: list[Any] = []
        for j, link in enumerate(links):
            inner = _chain_links(link, data) if isinstance(link, dict) else None
            if inner is None:
                flat.append(link)
                continue
            flat.extend(inner)
            notes.append(f"{key}.interceptors[{j}] (class: {link['class']}) is deprecated: "
                         "write its links in the route's interceptors list in its place")
        route["interceptors"] = flat
    return notes


def expand_shorthands(data: dict[str, Any]) -> list[str]:
    """Rewrite ``data`` (a config file's mapping) in place; one deprecation line per rewrite."""
    notes = []
    note = _expand_interceptor(data)
    if note is not None:
        notes.append(note)
    if isinstance(data.get("routes"), list):
        notes += _expand_links(data)
    return notes
