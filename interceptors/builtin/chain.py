"""``kiproxy.interceptors.builtin.chain:Chain`` - several interceptors, in order, as one.

Each link gets the batch the previous link returned. In the proxy's own config
a route's ``interceptors:`` list is the chain (the runtime runs it, with a
deadline, a mode and metrics per link), and ``interceptor: {class: chain}`` is
rewritten into that list when the config is loaded (with a warning naming the
new shape); this class is what ``kiproxy check``, replay and code that load
one interceptor get. Links are loaded like the top-level interceptor (plugins dir, then
installed modules, then entry points), so a chain mixes built-ins and your own
plugins. Links may be plain or ``async``; the chain stays synchronous until a
link returns an awaitable. All links share the batch's deadline. The links run on the
chain runner the routes use (:func:`~kiproxy.interceptors.chain.run_links`).

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
import math
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
from kiproxy.interceptors.chain import ChainResult, LoadedLink, run_links
from kiproxy.interceptors.verdict import (
    Rejected,
    Transformed,
    Verdict,
    acknowledgement_hook,
    result_fault,
)


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
        self._loaded: tuple[LoadedLink, ...] = ()

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
        # Every link runs within the batch's deadline (the caller's): none of its own.
        self._loaded = tuple(LoadedLink(f"chain link {i + 1} ({spec})", plugin, math.inf)
                             for i, (spec, plugin) in enumerate(self.links))
        if any(_has_ack_hook(p) for _, p in self.links):
            # The proxy parses every produce response for an interceptor whose class has
            # the hook, so only a chain with a link that wants it gets it.
            self.__class__ = _AcknowledgingChain

    def intercept(
        self, batch: RecordBatch, ctx: InterceptContext
    ) -> RecordBatch | Awaitable[RecordBatch]:
        """Run the links in order (synchronously until a link returns an awaitable)."""
        outcome = run_links("chain", self._loaded, batch, ctx, _step)
        if isinstance(outcome, ChainResult):
            return _forwarded(outcome)
        return _awaited(outcome)

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


def _step(index: int, link: LoadedLink, batch: RecordBatch,
          ctx: InterceptContext) -> Verdict | Awaitable[Verdict]:
    """A link's verdict: its rejection named, a broken rule named, else its batch.
    Exceptions other than RejectBatch propagate (the verdict judges the chain)."""
    try:
        result = link.interceptor.intercept(batch, ctx)
    except RejectBatch as exc:
        return _rejected(link, exc)
    if inspect.isawaitable(result):
        return _step_awaited(link, batch, result)
    return _checked(link, batch, result)


async def _step_awaited(link: LoadedLink, batch: RecordBatch,
                        pending: Awaitable[Any]) -> Verdict:
    try:
        result = await pending
    except RejectBatch as exc:
        return _rejected(link, exc)
    return _checked(link, batch, result)


def _checked(link: LoadedLink, before: RecordBatch, after: Any) -> Verdict:
    return result_fault(before, after, link.name) or Transformed(after)


def _rejected(link: LoadedLink, exc: RejectBatch) -> Rejected:
    return Rejected(code=exc.error_code, message=f"{link.name}: {exc.message}",
                    record_errors=exc.record_errors)


def _forwarded(outcome: ChainResult) -> RecordBatch:
    """The chain's last batch, or the rejecting link's refusal raised."""
    rejection = outcome.rejection
    if rejection is not None:
        raise RejectBatch(rejection.message, rejection.code, rejection.record_errors)
    return outcome.batch


async def _awaited(outcome: Awaitable[ChainResult]) -> RecordBatch:
    return _forwarded(await outcome)


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
