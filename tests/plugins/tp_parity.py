"""``tp_parity:Parity`` - one plugin whose answer is picked by the topic's first word.

Used to check that the proxy and replay reach the same verdict on the same
batch (``tests/integration/test_verdict_parity.py``):

``same-`` returns the batch; ``copy-`` the same records in a new list;
``upper-`` upper-cases the values; ``offsets-`` reverses the offset deltas
(nothing else changes); ``reject-`` raises RejectBatch (POLICY_VIOLATION, a
record error on record 1); ``shrink-`` drops a record; ``raise-`` raises
ValueError; ``none-`` returns None; ``async-`` upper-cases in an
``async def``; ``slow-`` sleeps 3 s in an ``async def``; ``bytes-`` returns a batch of
values rather than Records; ``surrogate-`` adds a header whose key holds a lone
surrogate (text no bytes stand for). The last two cannot be encoded.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kiproxy.interceptors import (
    InterceptContext,
    ProduceRequestInterceptor,
    RecordBatch,
    RejectBatch,
)


def _upper(batch: RecordBatch) -> RecordBatch:
    return batch.with_records(r.with_value((r.value or b"").upper()) for r in batch.records)


class Parity(ProduceRequestInterceptor):
    """See the module docstring."""

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> Any:
        """Answer as the topic's first word says."""
        word = batch.topic.split("-", 1)[0]
        if word == "copy":
            return batch.with_records(list(batch.records))
        if word == "upper":
            return _upper(batch)
        if word == "offsets":
            n = len(batch.records)
            return batch.with_records(r.with_offset_delta(n - 1 - i)
                                      for i, r in enumerate(batch.records))
        if word == "reject":
            raise RejectBatch("reject-* is closed", error="POLICY_VIOLATION",
                              record_errors=[(1, "the second record")])
        if word == "shrink":
            return batch.with_records(batch.records[1:])
        if word == "raise":
            raise ValueError(f"cannot handle {batch.topic}")
        if word == "none":
            return None
        if word == "async":
            return self._upper_later(batch)
        if word == "slow":
            return self._sleep(batch)
        if word == "bytes":
            return batch.with_records([r.value for r in batch.records])  # type: ignore[misc]
        if word == "surrogate":
            return batch.with_records(r.with_header("\ud800", b"v") for r in batch.records)
        return batch

    async def _upper_later(self, batch: RecordBatch) -> RecordBatch:
        await asyncio.sleep(0)
        return _upper(batch)

    async def _sleep(self, batch: RecordBatch) -> RecordBatch:
        await asyncio.sleep(3)
        return batch
