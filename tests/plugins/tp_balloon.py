"""Hostile: answers every batch with ``bytes_per_batch`` bytes of values (default 200 MB).

The records keep their count; every value is the same ``bytes`` object of
``bytes_per_batch / records`` bytes, so building the answer costs that much memory
once while the batch it stands for is the full size.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kiproxy.interceptors import InterceptContext, ProduceRequestInterceptor, RecordBatch


class Balloon(ProduceRequestInterceptor):
    def configure(self, config: Mapping[str, Any]) -> None:
        self.total = int(config.get("bytes_per_batch", 200_000_000))

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        value = b"x" * (self.total // max(len(batch.records), 1))
        return batch.with_records(r.with_value(value) for r in batch.records)
