"""Awaiting a plugin's coroutine within a deadline, paying for a task only when it waits.

Contract: :func:`within` returns what ``awaitable`` returns, or raises what it raises,
or ``TimeoutError`` once ``timeout`` seconds passed (None: no limit), as
``asyncio.wait_for(awaitable, timeout)`` does - with one difference in cost: a
coroutine is first run on the caller's own stack up to its first suspension, so one
that finishes without waiting for anything (an ``async def`` hook that only
computes, or whose keys are cached) answers at once, with no task, timer or loop
iteration. Only a coroutine that does wait is handed, already started, to
``asyncio.wait_for`` as it stands, which then resumes it where it stopped: the
deadline, cancellation and the exception it raises behave as ever.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Coroutine, Generator
from typing import Any, TypeVar

__all__ = ["within"]

_T = TypeVar("_T")


async def within(awaitable: Awaitable[_T], timeout: float | None) -> _T:
    """``await asyncio.wait_for(awaitable, timeout)``, without a task for a coroutine
    that finishes without suspending (see the module docstring)."""
    if not asyncio.iscoroutine(awaitable):
        return await (awaitable if timeout is None else asyncio.wait_for(awaitable, timeout))
    try:
        waiting_on = awaitable.send(None)
    except StopIteration as done:
        result: _T = done.value
        return result
    resumed = _Resumed(awaitable, waiting_on)
    return await (resumed if timeout is None else asyncio.wait_for(resumed, timeout))


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
