"""``tp_slow:SlowAsync`` - an async interceptor that takes longer than it should."""

from __future__ import annotations

import asyncio
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


