"""Awaiting a plugin's coroutine within a deadline that holds, paying for a task only when it waits.

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

Cost: a coroutine is first run on the caller's own stack up to its first suspension,
so one that finishes without waiting for anything (an ``async def`` hook that only
computes, or whose keys are cached) answers at once, with no task, timer or loop
iteration. Only a coroutine that does wait is handed, already started, to a task of
its own, which resumes it where it stopped; the caller waits for that task or the
deadline, whichever comes first.
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
    if timeout is None:
        answer: _T = await resumed
        return answer
    name = name or _qualname(awaitable)
    task = asyncio.get_running_loop().create_task(_awaited(resumed), name=f"interceptor {name}")
    answer = await _bounded(task, timeout, name)
    return answer


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
    how = "returned" if exc is None else f"raised {type(exc).__name__}"
    _warnings.warning(
        ("ignored", name),
        "interceptor %s ignored its cancellation %s: it ran on in the background for %.1f s "
        "more and %s, which was dropped%s. Let asyncio.CancelledError propagate out of the "
        "plugin's coroutine (re-raise it after any cleanup)", name, reason,
        time.monotonic() - cancelled_at, how, _ANSWERED[reason], more=MORE_IN_INTERVAL)


class _Resumed:
    """A started coroutine as an awaitable: the future it stopped on is handed to the
    task that awaits this, and the coroutine is resumed once that future is done."""

    __slots__ = ("_coroutine", "_waiting_on")

    def __init__(self, coroutine: Coroutine[Any, Any, Any], waiting_on: Any) -> None:
        self._coroutine = coroutine
        self._waiting_on = waiting_on

    def __await__(self) -> Generator[Any, None, Any]:
        coroutine, waiting_on = self._coroutine, self._waiting_on
        while True:
            try:
                yield waiting_on
            except BaseException as exc:  # cancellation (a deadline) goes in, as with await
                try:
                    waiting_on = coroutine.throw(exc)
                except StopIteration as done:
                    return done.value
                continue
            try:
                waiting_on = coroutine.send(None)
            except StopIteration as done:
                return done.value
