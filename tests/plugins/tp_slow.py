"""``tp_slow:SlowAsync`` - an async interceptor that takes longer than it should."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Mapping
from typing import Any

from tp_common import topic_pattern

from kiproxy.interceptors import InterceptContext, ProduceRequestInterceptor, RecordBatch


class SlowAsync(ProduceRequestInterceptor):
    """``async def intercept`` that sleeps ``sleep_ms`` (default 2000) on matching topics."""

    def __init__(self) -> None:
        self.pattern = topic_pattern({})
        self.sleep = 2.0

    def configure(self, config: Mapping[str, Any]) -> None:
        """Read ``topics`` and ``sleep_ms``."""
        self.pattern = topic_pattern(config)
        self.sleep = float(config.get("sleep_ms", 2000)) / 1000

    async def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Sleep (cancellable) on a matching topic, then pass the batch."""
        if self.pattern.fullmatch(batch.topic):
            await asyncio.sleep(self.sleep)
        return batch




class Stubborn(ProduceRequestInterceptor):
    """``async def intercept`` that swallows its cancellation: ``times`` (default 3) sleeps
    of ``sleep_ms`` (default 2000) on matching topics, each catching whatever is thrown
    in (the bug a deadline must hold against), then the batch passed."""

    def __init__(self) -> None:
        self.pattern = topic_pattern({})
        self.sleep = 2.0
        self.times = 3

    def configure(self, config: Mapping[str, Any]) -> None:
        """Read ``topics``, ``sleep_ms`` and ``times``."""
        self.pattern = topic_pattern(config)
        self.sleep = float(config.get("sleep_ms", 2000)) / 1000
        self.times = int(config.get("times", 3))

    async def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Sleep, ignoring cancellation, on a matching topic; then pass the batch."""
        if self.pattern.fullmatch(batch.topic):
            for _ in range(self.times):
                with contextlib.suppress(BaseException):  # swallowed: the bug
                    await asyncio.sleep(self.sleep)
        return batch


class OwnTimeout(ProduceRequestInterceptor):
    """``async def intercept`` that bounds a slow call of its own with
    ``asyncio.timeout(timeout_ms)`` (as a plugin bounds an HTTP call), and on its
    timeout tags each record's value with ``b"fallback:"``; a call that answers in time
    tags it ``b"answered:"``. The call takes ``sleep_ms``."""

    def __init__(self) -> None:
        self.sleep = 1.0
        self.timeout = 0.05

    def configure(self, config: Mapping[str, Any]) -> None:
        """Read ``sleep_ms`` and ``timeout_ms``."""
        self.sleep = float(config.get("sleep_ms", 1000)) / 1000
        self.timeout = float(config.get("timeout_ms", 50)) / 1000

    async def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """The batch, its values tagged by whether the slow call answered in time."""
        try:
            async with asyncio.timeout(self.timeout):
                await asyncio.sleep(self.sleep)
            tag = b"answered:"
        except TimeoutError:
            tag = b"fallback:"
        return batch.with_records([r.with_value(tag + (r.value or b""))
                                   for r in batch.records])
