"""``tp_count:ChangeCount`` - breaks the record-count rule on purpose."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tp_common import topic_pattern

from kiproxy.interceptors import InterceptContext, ProduceRequestInterceptor, RecordBatch


class ChangeCount(ProduceRequestInterceptor):
    """Returns ``delta`` records more than it got (negative: drops from the end)."""

    def __init__(self) -> None:
        self.pattern = topic_pattern({})
        self.delta = -1

    def configure(self, config: Mapping[str, Any]) -> None:
        """Read ``topics`` and ``delta`` (default -1, never 0)."""
        self.pattern = topic_pattern(config)
        self.delta = int(config.get("delta", -1))
        if self.delta == 0:
            raise ValueError("delta must not be 0")

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Drop the last ``-delta`` records, or repeat the last record ``delta`` times."""
        if not self.pattern.fullmatch(batch.topic):
            return batch
        records = batch.records
        if self.delta < 0:
            return batch.with_records(records[: max(len(records) + self.delta, 0)])
        return batch.with_records(records + records[-1:] * self.delta)
