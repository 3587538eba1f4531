"""``kiproxy.interceptors.builtin.route:TopicRouter`` - a different interceptor per topic pattern.

In the spirit of KIP-940: routes are tried in order, the first whose regular
expression matches the whole topic name handles the batch; unmatched topics
pass untouched. Each route names an interceptor like the top-level setting.

Config::

    interceptor:
      class: kiproxy.interceptors.builtin.route:TopicRouter
      config:
        routes:
          - topic: "orders|payments"
            interceptor: kiproxy.interceptors.builtin.json_schema:JsonSchemaValidator
            config: {schemas: {orders: {type: object}}}
          - topic: "logs\\..*"
            interceptor: redact:Redact       # from the plugins dir
        plugins_dir: plugins                 # optional; defaults to the proxy's plugins dir
"""

from __future__ import annotations

import inspect
import re
from collections.abc import Awaitable, Mapping
from typing import Any

from kiproxy.interceptors import (
    InterceptContext,
    PluginFactory,
    ProduceRequestInterceptor,
    RecordBatch,
)
from kiproxy.interceptors.builtin._composite import link_loader


class TopicRouter(ProduceRequestInterceptor):
    """Hands each batch to the first route whose pattern matches its topic."""

    def __init__(self) -> None:
        self.routes: list[tuple[re.Pattern[str], Any]] = []
        self._cache: dict[str, Any] = {}

    def configure(self, config: Mapping[str, Any], *,
                  plugins: PluginFactory | None = None) -> None:
        """Load every route's interceptor."""
        routes = config.get("routes")
        if not isinstance(routes, list) or not routes:
            raise ValueError("routes must be a non-empty list of {topic, interceptor, config}")
        load = link_loader(config, plugins)
        for i, route in enumerate(routes):
            if not isinstance(route, Mapping) or "topic" not in route or "interceptor" not in route:
                raise ValueError(f"routes[{i}] needs 'topic' (a regex) and 'interceptor'")
            try:
                pattern = re.compile(str(route["topic"]))
            except re.error as exc:
                raise ValueError(f"routes[{i}].topic is not a regular expression: {exc}") from None
            plugin = load(str(route["interceptor"]), route.get("config") or {})
            self.routes.append((pattern, plugin))

    def _route(self, topic: str) -> Any:
        try:
            return self._cache[topic]
        except KeyError:
            pass
        plugin = next((p for pattern, p in self.routes if pattern.fullmatch(topic)), None)
        if len(self._cache) < 100_000:
            self._cache[topic] = plugin
        return plugin

    def intercept(
        self, batch: RecordBatch, ctx: InterceptContext
    ) -> RecordBatch | Awaitable[RecordBatch]:
        """Delegate to the matching route (sync or async), or pass the batch untouched."""
        plugin = self._route(batch.topic)
        if plugin is None:
            return batch
        result: RecordBatch | Awaitable[RecordBatch] = plugin.intercept(batch, ctx)
        return result

    def close(self) -> None:
        """Close every route's interceptor."""
        for _, plugin in self.routes:
            close = getattr(plugin, "close", None)
            if close is not None:
                result = close()
                if inspect.isawaitable(result):
                    pass  # async close of a routed plugin is not awaited in sync close
