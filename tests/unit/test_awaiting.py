"""``within``: a plugin's coroutine awaited within a deadline, a task only when it waits.

A coroutine that finishes without suspending answers on the caller's stack (no task is
created for it); one that waits is resumed where it stopped and keeps ``wait_for``'s
rules: its result, its exception, the deadline, and cancellation reaching it.
"""

from __future__ import annotations

import asyncio

import pytest

from kiproxy.interceptors.awaiting import within


async def _computes() -> str:
    return "at once"


async def _waits(seconds: float, steps: list[str]) -> str:
    steps.append("started")
    await asyncio.sleep(seconds)
    steps.append("woke")
    await asyncio.sleep(0)
    return "after waiting"


def test_a_coroutine_that_does_not_wait_answers_without_a_task() -> None:
    async def main() -> tuple[str, int]:
        created = 0
        loop = asyncio.get_running_loop()
        factory = loop.get_task_factory()

        def counting(loop: asyncio.AbstractEventLoop, coro, **kwargs):  # type: ignore[no-untyped-def]
            nonlocal created
            created += 1
            return asyncio.Task(coro, loop=loop, **kwargs)

        loop.set_task_factory(counting)
        try:
            return await within(_computes(), 1.0), created
        finally:
            loop.set_task_factory(factory)

    assert asyncio.run(main()) == ("at once", 0)


@pytest.mark.parametrize("timeout", [None, 5.0])
def test_a_coroutine_that_waits_is_resumed_where_it_stopped(timeout: float | None) -> None:
    steps: list[str] = []
    assert asyncio.run(within(_waits(0.01, steps), timeout)) == "after waiting"
    assert steps == ["started", "woke"]  # started once, not again


def test_the_deadline_cancels_the_waiting_coroutine() -> None:
    cancelled: list[bool] = []

    async def hangs() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            cancelled.append(True)
            raise

    with pytest.raises(TimeoutError):
        asyncio.run(within(hangs(), 0.05))
    assert cancelled == [True]


def test_exceptions_come_out_as_raised_before_and_after_waiting() -> None:
    async def fails_at_once() -> None:
        raise KeyError("at once")

    async def fails_later() -> None:
        await asyncio.sleep(0.01)
        raise KeyError("later")

    for coro, text in ((fails_at_once(), "at once"), (fails_later(), "later")):
        with pytest.raises(KeyError, match=text):
            asyncio.run(within(coro, 1.0))


def test_cancelling_the_caller_reaches_the_coroutine() -> None:
    reached: list[bool] = []

    async def hangs() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            reached.append(True)
            raise

    async def main() -> None:
        task = asyncio.create_task(within(hangs(), None))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert reached == [True]


def test_a_future_is_awaited_as_it_is() -> None:
    async def main() -> int:
        future = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_later(0.01, future.set_result, 7)
        return await within(future, 1.0)

    assert asyncio.run(main()) == 7
