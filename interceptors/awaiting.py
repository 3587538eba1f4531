"""A plugin's coroutine awaited in the caller's task within a deadline that holds.

Contract: :func:`within` returns what ``awaitable`` returns, or raises what it raises,
or raises ``TimeoutError`` once ``timeout`` seconds passed (None: no limit) - at the
deadline, whatever the awaitable does. There it is cancelled and the caller answered
at once: a coroutine that swallows the cancellation and runs on is left to finish in
the background (referenced until it ends, so it is not collected mid-flight; what it
returns or raises is dropped), and when it ends otherwise than cancelled one WARNING
per plugin per 10 s names it (``name``). The caller's own cancellation is passed on
the same way. (``asyncio.wait_for`` waits for a cancelled task to end and returns
its result when it ignored the cancellation, so a plugin could keep a batch past its
deadline for as long as it liked.)

A coroutine runs in the caller's task, as a plain ``await`` runs it: what it asks of
``asyncio.current_task()`` - ``asyncio.timeout()``, a ``TaskGroup``, aiohttp's and
anyio's timeouts - is about that task and holds for the whole call. The deadline is
``asyncio.timeout``'s, so a plugin's own timeouts nest inside it as they nest
anywhere. Only a coroutine that swallows the cancellation and waits again is moved
to a task of its own to run on; a timeout it entered before still names the
caller's task (a plugin must let ``CancelledError`` propagate).

Cost: a coroutine is first run on the caller's own stack up to its first suspension,
so one that finishes without waiting for anything (an ``async def`` hook that only
computes, or whose keys are cached) answers at once, with no timer or loop
iteration. Only a coroutine that does wait pays for the deadline's timer.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Coroutine, Generator
from typing import Any, TypeVar

from kiproxy.protocol.log_limit import MORE_IN_INTERVAL, RateLimitedLog

__all__ = ["within"]

_T = TypeVar("_T")

log = logging.getLogger("kiproxy.interceptors")

_ran_on: set[asyncio.Future[Any]] = set()
"""Plugin coroutines cancelled at their deadline that have not ended yet (held here so
that the loop, which keeps only a weak reference to a task, cannot lose them)."""
_warnings = RateLimitedLog(log)


async def within(awaitable: Awaitable[_T], timeout: float | None, name: str = "") -> _T:
    """``await awaitable``, ``TimeoutError`` after ``timeout`` seconds whatever it does,
    without a task for a coroutine that finishes without suspending (see the module
    docstring); ``name`` names the plugin in the warning about one that runs on."""
    if not asyncio.iscoroutine(awaitable):
        if timeout is None:
            return await awaitable
        return await _bounded(asyncio.ensure_future(awaitable), timeout,
                              name or _qualname(awaitable))
    try:
        waiting_on = awaitable.send(None)
    except StopIteration as done:
        result: _T = done.value
        return result
    resumed = _Resumed(awaitable, waiting_on)
    name = name or _qualname(awaitable)
    try:
        async with asyncio.timeout(timeout) as bound:  # None: no deadline, never expires
            answer: _T = await resumed
    except BaseException as exc:
        expired = bound.expired()
        _ran_on_after(resumed, name, _AT_DEADLINE if expired else _CALLER_CANCELLED)
        if not expired or isinstance(exc, (TimeoutError, asyncio.CancelledError)):
            raise
        # it caught the cancellation and raised something else at once
        _warn_ignored(name, _AT_DEADLINE, 0.0, f"raised {type(exc).__name__}")
        raise TimeoutError from None
    if bound.expired():  # it caught the cancellation and returned at once
        _warn_ignored(name, _AT_DEADLINE, 0.0, "returned")
        raise TimeoutError
    _still_cancelled(resumed, name)
    return answer


def _still_cancelled(resumed: _Resumed, name: str) -> None:
    """CancelledError when the caller was cancelled while the coroutine ran and the
    coroutine caught it and answered: the caller's cancellation goes on, the answer is
    dropped (as when the coroutine runs on)."""
    task = asyncio.current_task()
    if task is not None and task.cancelling() > resumed.cancelling_before:
        _warn_ignored(name, _CALLER_CANCELLED, 0.0, "returned")
        raise asyncio.CancelledError


def _ran_on_after(resumed: _Resumed, name: str, reason: str) -> None:
    """Keep and watch the task ``resumed`` moved its coroutine to, if it did: the
    coroutine swallowed its cancellation (``reason``) and waits again."""
    if resumed.running_on is not None:
        _ran_on.add(resumed.running_on)
        resumed.running_on.add_done_callback(
            functools.partial(_ended, name, reason, time.monotonic()))


async def _awaited(resumed: _Resumed) -> Any:
    return await resumed


def _qualname(awaitable: object) -> str:
    return getattr(awaitable, "__qualname__", type(awaitable).__name__)


async def _bounded(task: asyncio.Future[_T], timeout: float, name: str) -> _T:
    """``task``'s result, or ``TimeoutError`` after ``timeout`` seconds, when ``task`` is
    cancelled and left to end on its own: ``asyncio.wait_for``'s waiter, without its
    waiting for the cancelled task (``asyncio.wait`` would do, at 4 us more a call)."""
    loop = asyncio.get_running_loop()
    waiter = loop.create_future()
    release = functools.partial(_release, waiter)
    timer = loop.call_later(timeout, release)
    task.add_done_callback(release)
    reason = _AT_DEADLINE
    try:
        await waiter
    except BaseException:  # the caller is cancelled: so is the plugin, and it may run on
        reason = _CALLER_CANCELLED
        raise
    finally:
        timer.cancel()
        if not task.done():
            task.remove_done_callback(release)
            _let_go(task, name, reason)
        elif reason is _CALLER_CANCELLED and not task.cancelled():
            task.exception()  # it ended as the caller was cancelled: its answer is nobody's
    if task.done():
        return task.result()
    raise TimeoutError


def _release(waiter: asyncio.Future[None], *_: object) -> None:
    if not waiter.done():
        waiter.set_result(None)


_AT_DEADLINE = "at the deadline"
_CALLER_CANCELLED = "when the proxy stopped waiting for it"
"""Why a plugin's task was cancelled, as its warning says it."""
_ANSWERED = {_AT_DEADLINE: " (its batch had been answered as timed out)", _CALLER_CANCELLED: ""}


def _let_go(task: asyncio.Future[Any], name: str, reason: str) -> None:
    """Cancel ``task`` and leave it to end in the background, referenced until it does."""
    task.cancel()
    _ran_on.add(task)
    task.add_done_callback(functools.partial(_ended, name, reason, time.monotonic()))


def _ended(name: str, reason: str, cancelled_at: float, task: asyncio.Future[Any]) -> None:
    """``task`` ended after it was cancelled: drop its answer, and warn when it ran on."""
    _ran_on.discard(task)
    if task.cancelled():  # the cancellation ended it, as it should
        return
    exc = task.exception()  # retrieved here: asyncio would log it as never retrieved
    _warn_ignored(name, reason, time.monotonic() - cancelled_at,
                  "returned" if exc is None else f"raised {type(exc).__name__}")


def _warn_ignored(name: str, reason: str, seconds: float, how: str) -> None:
    _warnings.warning(
        ("ignored", name),
        "interceptor %s ignored its cancellation %s: it ran on in the background for %.1f s "
        "more and %s, which was dropped%s. Let asyncio.CancelledError propagate out of the "
        "plugin's coroutine (re-raise it after any cleanup)", name, reason, seconds, how,
        _ANSWERED[reason], more=MORE_IN_INTERVAL)


class _Resumed:
    """A started coroutine as an awaitable: the future it stopped on is handed to the
    task that awaits this, and the coroutine is resumed once that future is done."""

    __slots__ = ("_coroutine", "_waiting_on", "cancelling_before", "running_on")

    def __init__(self, coroutine: Coroutine[Any, Any, Any], waiting_on: Any) -> None:
        self._coroutine = coroutine
        self._waiting_on = waiting_on
        task = asyncio.current_task()
        self.cancelling_before = task.cancelling() if task is not None else 0
        """Cancellations of the awaiting task asked before the coroutine's wait."""
        self.running_on: asyncio.Task[Any] | None = None
        """The task the coroutine was moved to when it swallowed a cancellation."""

    def __await__(self) -> Generator[Any, None, Any]:
        coroutine, waiting_on = self._coroutine, self._waiting_on
        task = asyncio.current_task()
        pending = task.cancelling() if task is not None else 0
        while True:
            try:
                yield waiting_on
            except BaseException as exc:  # cancellation (a deadline) goes in, as with await
                try:
                    waiting_on = coroutine.throw(exc)
                except StopIteration as done:
                    return done.value
                # A cancellation of this task that nobody took back (a plugin's own
                # timeout takes back the one it made) was swallowed: it runs on alone.
                if isinstance(exc, asyncio.CancelledError) and task is not None \
                        and task.cancelling() > pending:
                    self.running_on = asyncio.get_running_loop().create_task(
                        _awaited(_Resumed(coroutine, waiting_on)))
                    raise
                continue
            try:
                waiting_on = coroutine.send(None)
            except StopIteration as done:
                return done.value
