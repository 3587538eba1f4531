"""The answer side's asynchronous transforms (a Fetch answer through the fetch-side hooks):
a transform whose task is cancelled before it ever ran (the connection closed at once)
leaves no coroutine behind that Python reports as never awaited."""

from __future__ import annotations

import asyncio
import gc
import warnings
from collections import deque

from kiproxy.proxy.answers import AnswerSide, AnswerSlot


async def _hook_output(frame: bytes) -> bytes:
    await asyncio.sleep(0)
    return frame


async def test_a_transform_cancelled_before_it_ran_is_not_left_unawaited() -> None:
    side = AnswerSide.__new__(AnswerSide)  # the matching state only: no sockets
    slot = AnswerSlot(generation=None)  # type: ignore[arg-type]
    side._pending = deque([(7, slot, None, _hook_output)])
    side._unanswered = deque()
    side._transforms = set()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert side._match_response(b"\x00\x00\x00\x07answer") is None  # a task fills it
        (task,) = side._transforms
        task.cancel()  # as close() does, before the loop ever ran the task
        await asyncio.sleep(0)
        await asyncio.sleep(0)
        assert task.cancelled()
        del task
        gc.collect()
    assert not [w for w in caught if "never awaited" in str(w.message)], [
        str(w.message) for w in caught]
    assert not slot.done
