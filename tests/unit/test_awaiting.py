"""``within``: a plugin's coroutine awaited within a deadline, a task only when it waits.

A coroutine that finishes without suspending answers on the caller's stack (no task is
created for it); one that waits is resumed where it stopped: its result, its exception,
the deadline, and cancellation reaching it. The deadline holds whatever the coroutine
does: one that swallows its cancellation is answered ``TimeoutError`` while it still
runs, and is left to end in the background, its answer dropped and one WARNING naming it.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import uuid
from typing import Any

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


class _Stubborn:
    """A plugin coroutine that waits past any deadline, swallows every cancellation and
    runs on for ``steps`` turns of the loop before it answers."""

    def __init__(self, then: str = "return", steps: int = 20) -> None:
        self.swallowed = 0
        self.ended = False
        self.then = then
        self.steps = steps

    async def intercept(self) -> str:
        try:
            await asyncio.Event().wait()  # set by no one
        except BaseException:
            self.swallowed += 1
        for _ in range(self.steps):
            try:
                await asyncio.sleep(0)
            except BaseException:
                self.swallowed += 1
        self.ended = True
        if self.then == "raise":
            raise KeyError("after the deadline")
        return "late answer"

    async def until_ended(self) -> None:
        while not self.ended:
            await asyncio.sleep(0)
        await asyncio.sleep(0)  # its task's end is handled


def _name() -> str:
    """A plugin name of its own, so that no other test's warning holds this one back."""
    return f"stubborn-{uuid.uuid4().hex[:8]}:Stubborn"


@pytest.mark.parametrize("then", ["return", "raise"])
def test_a_coroutine_that_swallows_its_cancellation_is_answered_at_the_deadline(
        then: str, caplog: pytest.LogCaptureFixture) -> None:
    name = _name()
    unhandled: list[dict[str, Any]] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(lambda loop, context: unhandled.append(context))
        plugin = _Stubborn(then)
        started = loop.time()
        with pytest.raises(TimeoutError):
            await within(plugin.intercept(), 0.05, name)
        # Answered at the deadline (by the loop's clock), the plugin still running.
        assert loop.time() >= started + 0.05
        assert not plugin.ended
        await asyncio.sleep(0)  # its cancellation is delivered: swallowed, it runs on
        assert plugin.swallowed == 1 and not plugin.ended
        gc.collect()  # nothing but ``within`` holds the plugin's task now: it must survive
        await plugin.until_ended()

    with caplog.at_level(logging.WARNING, "kiproxy.interceptors"):
        asyncio.run(main())
    gc.collect()
    assert unhandled == []  # its late answer (or exception) was retrieved and dropped
    warned = [r.getMessage() for r in caplog.records if name in r.getMessage()]
    assert len(warned) == 1, caplog.text
    assert f"interceptor {name} ignored its cancellation at the deadline" in warned[0]
    assert ("returned" if then == "return" else "raised KeyError") in warned[0]


def test_a_plugin_that_ignores_cancellation_on_every_batch_is_warned_about_once(
        caplog: pytest.LogCaptureFixture) -> None:
    name = _name()

    async def main() -> None:
        plugins = [_Stubborn() for _ in range(3)]
        for plugin in plugins:
            with pytest.raises(TimeoutError):
                await within(plugin.intercept(), 0.01, name)
            assert not plugin.ended
        for plugin in plugins:
            await plugin.until_ended()

    with caplog.at_level(logging.WARNING, "kiproxy.interceptors"):
        asyncio.run(main())
    assert len([r for r in caplog.records if name in r.getMessage()]) == 1


def test_a_coroutine_that_cleans_up_and_reraises_is_not_warned_about(
        caplog: pytest.LogCaptureFixture) -> None:
    name = _name()
    cleaned: list[bool] = []

    async def tidy() -> None:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            await asyncio.sleep(0)  # cleanup that waits, then the cancellation goes on
            cleaned.append(True)
            raise

    async def main() -> None:
        with pytest.raises(TimeoutError):
            await within(tidy(), 0.01, name)
        while not cleaned:
            await asyncio.sleep(0)
        await asyncio.sleep(0)

    with caplog.at_level(logging.WARNING, "kiproxy.interceptors"):
        asyncio.run(main())
    assert cleaned == [True]
    assert name not in caplog.text


def test_cancelling_the_caller_of_a_stubborn_coroutine_does_not_wait_for_it() -> None:
    async def main() -> None:
        plugin = _Stubborn()
        task = asyncio.create_task(within(plugin.intercept(), 30.0, _name()))
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not plugin.ended  # the caller's cancellation went through; the plugin runs on
        await asyncio.sleep(0)
        assert plugin.swallowed == 1
        await plugin.until_ended()

    asyncio.run(main())


@pytest.mark.parametrize("timeout", [5.0, None])
def test_a_coroutine_runs_in_the_callers_task_so_its_own_timeouts_and_task_groups_hold(
        timeout: float | None) -> None:
    """A plugin's ``asyncio.timeout()`` (as aiohttp's and anyio's timeouts) cancels the
    task it was entered in: that must be the task awaiting the plugin, before and after
    the plugin first waits, or the timeout would cancel the proxy's own work."""
    tasks: list[asyncio.Task[Any] | None] = []

    async def plugin() -> str:
        tasks.append(asyncio.current_task())
        try:
            async with asyncio.timeout(0.02):
                await asyncio.sleep(5)
        except TimeoutError:
            tasks.append(asyncio.current_task())
        async with asyncio.TaskGroup() as group:
            child = group.create_task(asyncio.sleep(0, "from a child task"))
        return f"its own timeout handled, {child.result()}"

    async def main() -> str:
        tasks.append(asyncio.current_task())
        answer = await within(plugin(), timeout, "timeouts")
        await asyncio.sleep(0.05)  # nothing left to cancel this task later
        return answer

    assert asyncio.run(main()) == "its own timeout handled, from a child task"
    assert len(tasks) == 3 and tasks[0] is tasks[1] is tasks[2]


def test_the_deadline_nests_around_a_plugins_own_longer_timeout() -> None:
    async def plugin() -> str:
        async with asyncio.timeout(10):
            await asyncio.sleep(5)
        return "slept"

    async def main() -> None:
        with pytest.raises(TimeoutError):
            await within(plugin(), 0.02, "nested")
        await asyncio.sleep(0)  # the caller goes on, not cancelled

    asyncio.run(main())


@pytest.mark.parametrize("timeout", [30.0, None])
def test_a_caller_cancelled_stays_cancelled_when_the_coroutine_answers_anyway(
        timeout: float | None) -> None:
    """The proxy cancels a connection's task to close it; a plugin that catches the
    cancellation and returns must not turn that into an answer the task goes on with."""
    async def answers_anyway() -> str:
        try:
            await asyncio.sleep(30)
        except asyncio.CancelledError:
            return "answered"
        return "slept"

    went_on: list[str] = []

    async def caller() -> None:
        went_on.append(await within(answers_anyway(), timeout, _name()))

    async def main() -> None:
        task = asyncio.create_task(caller())
        await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(main())
    assert went_on == []
