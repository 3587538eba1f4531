"""Running a chain: each interceptor in order, judged after each link.

Contract: :func:`run_chain` hands the batch to the first link, judges its
answer with the verdict function (:func:`~kiproxy.interceptors.verdict.judge`
by default), hands what it returned to the next link, and so on. The
record-count rule, exceptions, return types and the deadline are the verdict
function's to judge, once per link; a link whose verdict is a rejection ends
the chain there and nothing is forwarded. Each link gets its own deadline
(its ``timeout_ms`` counted from when it starts), so a chain's worst case is
the sum; a chain of one link is judged with the context as given (the
caller set its ``deadline`` to now + that link's ``timeout_ms``).

A link in observe mode (``mode: observe``) is judged the same way, but its
verdict only goes into :attr:`ChainResult.observed` and the next link gets
the batch it was given.

The answer is one immutable :class:`ChainResult`: :attr:`ChainResult.verdict`,
the one verdict the produce path acts on (a chain of one link answers with
that link's verdict as it is), which link refused, and what observing links
would have done. The ``interceptor:`` shorthand is a
chain of one link like any other.

One body runs every chain: the runtime's routes (:func:`run_chain`, each link
judged by the verdict) and the ``chain`` built-in that ``kiproxy check``, replay
and code loading one interceptor get (:func:`run_links`: the links share the
caller's context, a :data:`Step` of the caller's judges each link, and the chain
stays synchronous until a step returns an awaitable).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Awaitable, Callable, Generator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

from kiproxy.interceptors.api import InterceptContext, RecordBatch
from kiproxy.interceptors.verdict import (
    DEFAULT_OUTPUT_LIMITS,
    OutputLimits,
    Rejected,
    Transformed,
    Unchanged,
    Verdict,
    judge,
)
from kiproxy.protocol._codec import SlotsMaker

__all__ = ["ChainResult", "Judge", "LoadedLink", "Observed", "Step", "run_chain", "run_links"]


class Judge(Protocol):
    """The verdict function's shape: ``judge(interceptor, batch, ctx, *, name, timeout,
    limits)``."""

    def __call__(self, interceptor: Any, batch: RecordBatch, ctx: InterceptContext, *,
                 name: str, timeout: float | None,
                 limits: OutputLimits = ...) -> Awaitable[Verdict]: ...


@dataclass(frozen=True, slots=True)
class LoadedLink:
    """One link of a route's chain with its interceptor loaded (once per generation)."""

    name: str
    """How logs, metrics and audit events name it: the configured ``class``, with
    ``#N`` for the N-th link of a chain with that class from the second on
    (:func:`~kiproxy.proxy.routes.runtime.link_names`)."""
    interceptor: Any
    """The configured, ready interceptor (or the isolation pool standing in for it)."""
    timeout: float
    """Seconds the link may take (``timeout_ms`` / 1000)."""
    observe: bool = False
    """``mode: observe``: its verdict is recorded, and the next link gets the batch this
    one was given."""
    limits: OutputLimits = DEFAULT_OUTPUT_LIMITS
    """How many bytes it may return for a batch (the proxy's ``max_plugin_output_*``)."""


@dataclass(frozen=True, slots=True)
class Observed:
    """What a link in observe mode would have done to one batch."""

    link: str
    """The link's name (its ``class``)."""
    verdict: Transformed | Rejected
    """Its verdict (an unchanged batch is not recorded)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ChainResult:
    """What a route's chain made of one batch."""

    route: str
    """The route's name (for the ``route`` metric label, logs and audit events)."""
    verdict: Verdict
    """The chain's verdict: the rejecting link's ``Rejected``, else ``Transformed`` (some
    link changed the batch: the last output) or ``Unchanged`` (the batch as given)."""
    given: RecordBatch
    """On a rejection, the batch the rejecting link was given; else the chain's input."""
    rejected_by: int | None = None
    """The index of the rejecting link in the chain, or None."""
    observed: tuple[Observed, ...] = ()
    """The verdicts of links in observe mode that would have changed or refused it."""

    @property
    def rejection(self) -> Rejected | None:
        """The rejecting link's verdict, or None."""
        return self.verdict if isinstance(self.verdict, Rejected) else None

    @property
    def changed(self) -> bool:
        """Some link transformed the batch."""
        return isinstance(self.verdict, Transformed)

    @property
    def batch(self) -> RecordBatch:
        """What to forward: the last link's output, or the original when nothing changed
        it; on a rejection, the batch the rejecting link was given."""
        return self.given if isinstance(self.verdict, Rejected) else self.verdict.batch


_result_from_fields = SlotsMaker(ChainResult)
"""A ChainResult from every field, in order (the common case's, per batch: see SlotsMaker)."""


Step = Callable[[int, LoadedLink, RecordBatch, InterceptContext],
               "Verdict | Awaitable[Verdict]"]
"""How :func:`run_links` asks for a link's verdict: ``step(index, link, batch, ctx)``."""
_VERDICTS = (Unchanged, Transformed, Rejected)


def _chaining(route: str, links: Sequence[LoadedLink], batch: RecordBatch,
              ctx: InterceptContext, step: Step, own_deadlines: bool,
              ) -> Generator[Awaitable[Verdict], Verdict, ChainResult]:
    """The one body of every chain, without the waiting: yields a step's awaitable, and
    the driver sends its verdict back in."""
    current = batch
    changed = False
    observed: list[Observed] = []
    shared = not own_deadlines or len(links) == 1  # the caller's context as it is
    for index, link in enumerate(links):
        link_ctx = ctx if shared else dataclasses.replace(
            ctx, deadline=time.monotonic() + link.timeout)
        answer = step(index, link, current, link_ctx)
        verdict = answer if isinstance(answer, _VERDICTS) else (yield answer)
        if link.observe:
            if not isinstance(verdict, Unchanged):
                observed.append(Observed(link.name, verdict))
            continue  # the next link gets the batch this one was given
        if isinstance(verdict, Rejected):
            return ChainResult(route=route, verdict=verdict, given=current,
                               rejected_by=index, observed=tuple(observed))
        changed = changed or isinstance(verdict, Transformed)
        current = verdict.batch
    return ChainResult(route=route, given=batch, observed=tuple(observed),
                       verdict=Transformed(current) if changed else Unchanged(batch))


async def _driven(chaining: Generator[Awaitable[Verdict], Verdict, ChainResult],
                  pending: Awaitable[Verdict]) -> ChainResult:
    while True:
        verdict = await pending
        try:
            pending = chaining.send(verdict)
        except StopIteration as done:
            result: ChainResult = done.value
            return result


async def run_chain(route: str, links: Sequence[LoadedLink], batch: RecordBatch,
                    ctx: InterceptContext, judge: Judge = judge) -> ChainResult:
    """Run ``links`` in order over ``batch``; see the module docstring."""
    if len(links) == 1 and not links[0].observe:  # the common case, judged as it is
        link = links[0]
        verdict = await judge(link.interceptor, batch, ctx, name=link.name,
                              timeout=link.timeout, limits=link.limits)
        result: ChainResult = _result_from_fields(
            route, verdict, batch, 0 if isinstance(verdict, Rejected) else None, ())
        return result

    def step(index: int, link: LoadedLink, given: RecordBatch,
             link_ctx: InterceptContext) -> Awaitable[Verdict]:
        return judge(link.interceptor, given, link_ctx, name=link.name,
                     timeout=link.timeout, limits=link.limits)

    outcome = _started(_chaining(route, links, batch, ctx, step, own_deadlines=True))
    return outcome if isinstance(outcome, ChainResult) else await outcome


def run_links(route: str, links: Sequence[LoadedLink], batch: RecordBatch,
              ctx: InterceptContext, step: Step) -> ChainResult | Awaitable[ChainResult]:
    """Run ``links`` in order over ``batch``, every link with ``ctx`` as given, each
    judged by ``step``: the result at once while every step answers at once, else an
    awaitable of it. An exception a step raises (or its awaitable) propagates."""
    return _started(_chaining(route, links, batch, ctx, step, own_deadlines=False))


def _started(chaining: Generator[Awaitable[Verdict], Verdict, ChainResult],
             ) -> ChainResult | Awaitable[ChainResult]:
    try:
        pending = next(chaining)
    except StopIteration as done:
        result: ChainResult = done.value
        return result
    return _driven(chaining, pending)
