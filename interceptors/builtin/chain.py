"""``kiproxy.interceptors.builtin.chain:Chain`` - several interceptors, in order, as one.

Each link gets the batch the previous link returned. In the proxy's own config
a route's ``interceptors:`` list is the chain (the runtime runs it, with a
deadline, a mode and metrics per link), and ``interceptor: {class: chain}`` is
rewritten into that list when the config is loaded (with a warning naming the
new shape); this class is what ``kiproxy check``, replay and code that load
one interceptor get. Links are loaded like the top-level interceptor (plugins dir, then
installed modules, then entry points), so a chain mixes built-ins and your own
plugins. Links may be plain or ``async``; the chain stays synchronous until a
link returns an awaitable. All links share the batch's deadline.

A link that rejects stops the chain: the producer sees the link's error code
and its message prefixed with ``chain link N (MODULE:CLASS)``. A link that
returns something other than a batch of as many records is stopped there too,
by the verdict's rules and with their messages (INVALID_RECORD, ``interceptor
chain link N (MODULE:CLASS) broke the record-count rule: ...``).
``on_acknowledgement`` is passed to every link that defines it; ``close()``
closes the links in reverse order.

Config::

    interceptor:
      class: kiproxy.interceptors.builtin.chain:Chain
      config:
        links:
          - interceptor: kiproxy.interceptors.builtin.signing:SignatureVerifier
            config: {keys: {k1: {env: SIGNING_KEY}}, strip: true}
          - interceptor: kiproxy.interceptors.builtin.trace:TraceContext
          - interceptor: kiproxy.interceptors.builtin.paper_trail:PaperTrail
            config: {cluster: east}
          - redact:Redact                     # a plugin from the plugins dir, no config
        plugins_dir: plugins                  # optional; defaults to the proxy's plugins dir
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable
from typing import Any

from pydantic import Field

from kiproxy.interceptors import (
    AcknowledgedBatch,
    InterceptContext,
    PluginFactory,
    PluginSettings,
    ProduceRequestInterceptor,
    RecordBatch,
    RejectBatch,
)
from kiproxy.interceptors.builtin._composite import Link, link_loader
from kiproxy.interceptors.verdict import acknowledgement_hook, result_fault


class ChainSettings(PluginSettings):
    """Settings of ``chain``."""

    links: list[Link] = Field(min_length=1)
    """The interceptors, in order: ``{interceptor: MODULE:CLASS, config: {...}}``, or
    the name alone."""
    plugins_dir: str | None = None
    """Where the links are looked for first; default: the plugins dir this chain was
    loaded from."""


class Chain(ProduceRequestInterceptor[ChainSettings]):
    """Runs its links in order; each gets the batch the previous one returned."""

    def __init__(self) -> None:
        self.links: list[tuple[str, Any]] = []

    def configure(self, config: ChainSettings, *,
                  plugins: PluginFactory | None = None) -> None:
        """Load every link's interceptor (a failure names the link)."""
        load = link_loader(config.plugins_dir, plugins)
        for i, link in enumerate(config.links):
            try:
                plugin = load(link.interceptor, link.config)
            except Exception as exc:
                raise ValueError(f"links[{i}] ({link.interceptor}): {exc}") from exc
            self.links.append((link.interceptor, plugin))
        if any(_has_ack_hook(p) for _, p in self.links):
            # The proxy parses every produce response for an interceptor whose class has
            # the hook, so only a chain with a link that wants it gets it.
            self.__class__ = _AcknowledgingChain

    def _checked(self, index: int, before: RecordBatch, after: Any) -> RecordBatch:
        fault = result_fault(before, after, f"chain link {index + 1} ({self.links[index][0]})")
        if fault is not None:
            raise RejectBatch(fault.message, fault.code)
        checked: RecordBatch = after
        return checked

    def _rejected(self, index: int, exc: RejectBatch) -> RejectBatch:
        spec = self.links[index][0]
        return RejectBatch(f"chain link {index + 1} ({spec}): {exc.message}",
                           exc.error_code, exc.record_errors)

    def intercept(
        self, batch: RecordBatch, ctx: InterceptContext
    ) -> RecordBatch | Awaitable[RecordBatch]:
        """Run the links in order (synchronously until a link returns an awaitable)."""
        for i, (_, plugin) in enumerate(self.links):
            try:
                result = plugin.intercept(batch, ctx)
            except RejectBatch as exc:
                raise self._rejected(i, exc) from exc
            if inspect.isawaitable(result):
                return self._continue(i, batch, result, ctx)
            batch = self._checked(i, batch, result)
        return batch

    async def _continue(self, index: int, batch: RecordBatch, pending: Awaitable[Any],
                        ctx: InterceptContext) -> RecordBatch:
        try:
            result = await pending
        except RejectBatch as exc:
            raise self._rejected(index, exc) from exc
        batch = self._checked(index, batch, result)
        for i in range(index + 1, len(self.links)):
            try:
                result = self.links[i][1].intercept(batch, ctx)
                if inspect.isawaitable(result):
                    result = await result
            except RejectBatch as exc:
                raise self._rejected(i, exc) from exc
            batch = self._checked(i, batch, result)
        return batch

    def close(self) -> Any:
        """Close the links in reverse order; an awaitable when some link closes async."""
        pending = []
        for _, plugin in reversed(self.links):
            close = getattr(plugin, "close", None)
            if close is not None:
                result = close()
                if inspect.isawaitable(result):
                    pending.append(result)
        if pending:
            async def wait() -> None:
                await asyncio.gather(*pending)
            return wait()
        return None


def _has_ack_hook(plugin: Any) -> bool:
    return acknowledgement_hook(plugin) is not None


class _AcknowledgingChain(Chain):
    """A chain with a link that has ``on_acknowledgement``."""

    def on_acknowledgement(
        self, batch: AcknowledgedBatch, base_offset: int, error: int | None
    ) -> None:
        """Tell every link that has the hook."""
        for _, plugin in self.links:
            if _has_ack_hook(plugin):
                plugin.on_acknowledgement(batch, base_offset, error)
