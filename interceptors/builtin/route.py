"""``kiproxy.interceptors.builtin.route:TopicRouter`` - a different interceptor per topic pattern.

In the spirit of KIP-940: routes are tried in order, the first whose regular
expression matches the whole topic name handles the batch; unmatched topics
pass untouched. Each route names an interceptor like the top-level setting.
Topics are matched by :class:`~kiproxy.interceptors.TopicSelector`, as the
proxy's routes match ``match.topic``. In the proxy's own config,
``interceptor: {class: topic_router}`` is rewritten into ``routes:`` when the
config is loaded (with a warning naming the new shape); this class is what
``kiproxy check``, replay and code that load one interceptor get.

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
from collections.abc import Awaitable
from typing import Annotated, Any

from pydantic import AfterValidator, Field

from kiproxy.interceptors import (
    InterceptContext,
    PluginFactory,
    PluginSettings,
    ProduceRequestInterceptor,
    RecordBatch,
    TopicSelector,
)
from kiproxy.interceptors.builtin._composite import LinkSettings, link_loader
from kiproxy.interceptors.topics import topic_regex


class TopicRouteSettings(LinkSettings):
    """One route: the topics it takes and the interceptor that handles them."""

    topic: Annotated[str, AfterValidator(topic_regex)]
    """A regular expression matched against the whole topic name."""


class TopicRouterSettings(PluginSettings):
    """Settings of ``topic_router``."""

    routes: list[TopicRouteSettings] = Field(min_length=1)
    """Tried in order: ``{topic: REGEX, interceptor: MODULE:CLASS, config: {...}}``."""
    plugins_dir: str | None = None
    """Where the routes' interceptors are looked for first; default: the plugins dir
    this router was loaded from."""


class TopicRouter(ProduceRequestInterceptor[TopicRouterSettings]):
    """Hands each batch to the first route whose pattern matches its topic."""

    def __init__(self) -> None:
        self.routes: TopicSelector[Any] = TopicSelector(())

    def configure(self, config: TopicRouterSettings, *,
                  plugins: PluginFactory | None = None) -> None:
        """Load every route's interceptor."""
        load = link_loader(config.plugins_dir, plugins)
        self.routes = TopicSelector(
            (route.topic, load(route.interceptor, route.config)) for route in config.routes)

    def intercept(
        self, batch: RecordBatch, ctx: InterceptContext
    ) -> RecordBatch | Awaitable[RecordBatch]:
        """Delegate to the matching route (sync or async), or pass the batch untouched."""
        plugin = self.routes.select(batch.topic)
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
