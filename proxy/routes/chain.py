"""Running a route's chain: each interceptor in order, judged after each link.

Contract: :func:`run_chain` hands the batch to the first link, judges its
answer with the verdict function, hands what it returned to the next link, and
so on. The record-count rule, exceptions, return types and the deadline are
the verdict function's to judge, once per link; a link whose verdict is a
rejection ends the chain there and nothing is forwarded. Each link gets its own
deadline (its ``timeout_ms`` counted from when it starts: the context it sees
has ``deadline`` set accordingly), so a chain's worst case is the sum.

Seam (phase 2 of routes): ``judge`` is
``kiproxy.interceptors.verdict.judge`` once that lands; until then any
callable of the same shape works. A verdict that has a ``batch`` attribute
(``Unchanged``/``Transformed``) lets the chain go on with that batch; one
without (``Rejected``) stops it. ``Unchanged`` carries the very batch it was
given, which is how ``changed`` is told apart. The runtime maps a
:class:`ChainResult` back to one verdict: ``rejection`` when set, else
``Transformed(batch)`` when ``changed``, else ``Unchanged(batch)``.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kiproxy.interceptors.api import InterceptContext, RecordBatch

__all__ = ["ChainResult", "Judge", "LoadedLink", "run_chain"]


class Judge(Protocol):
    """The verdict function's shape: ``judge(interceptor, batch, ctx, *, name, timeout)``."""

    def __call__(self, interceptor: Any, batch: RecordBatch, ctx: InterceptContext, *,
                 name: str, timeout: float | None) -> Awaitable[object]: ...


@dataclass(frozen=True, slots=True)
class LoadedLink:
    """One link of a route's chain with its interceptor loaded (once per generation)."""

    name: str
    """How messages name it: the configured ``class``."""
    interceptor: Any
    """The configured, ready interceptor (or the isolation pool standing in for it)."""
    timeout: float
    """Seconds the link may take (``timeout_ms`` / 1000)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChainResult:
    """What a route's chain made of one batch."""

    route: str
    """The route's name (for the ``route`` metric label, logs and audit events)."""
    batch: RecordBatch
    """What to forward: the last link's output, or the original when nothing changed it.
    On a rejection: the batch the rejecting link was given."""
    changed: bool
    """Some link transformed the batch."""
    rejection: object | None = None
    """The rejecting link's verdict (``Rejected``), or None."""
    rejected_by: int | None = None
    """The index of the rejecting link in the chain, or None."""


async def run_chain(route: str, links: Sequence[LoadedLink], batch: RecordBatch,
                    ctx: InterceptContext, judge: Judge) -> ChainResult:
    """Run ``links`` in order over ``batch``; see the module docstring."""
    current = batch
    changed = False
    for index, link in enumerate(links):
        link_ctx = dataclasses.replace(ctx, deadline=time.monotonic() + link.timeout)
        verdict = await judge(link.interceptor, current, link_ctx, name=link.name,
                              timeout=link.timeout)
        returned = getattr(verdict, "batch", None)
        if not isinstance(returned, RecordBatch):
            return ChainResult(route=route, batch=current, changed=changed,
                               rejection=verdict, rejected_by=index)
        changed = changed or returned is not current
        current = returned
    return ChainResult(route=route, batch=current, changed=changed)
