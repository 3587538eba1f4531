"""Fetch-side test plugins.

* ``Reverse`` reverses each value's bytes on produce and again on consume: what is
  stored is reversed, what a consumer through the proxy reads is what was produced
  (the shape of envelope encryption, without a key).
* ``UpperOnConsume`` is a fetch-side-only hook: values read through the proxy are
  upper-cased; produce passes through.
* ``RefuseOnConsume`` refuses every batch of a topic whose name contains ``refuse``
  (RefuseFetch), raises on ``raise``, returns one record too many on ``grow`` and
  sleeps past its deadline on ``slow``; other topics pass unchanged.
"""

from __future__ import annotations

import asyncio

from kiproxy.interceptors import (
    ConsumeContext,
    ConsumedBatch,
    FetchResponseInterceptor,
    InterceptContext,
    ProduceRequestInterceptor,
    RecordBatch,
    RefuseFetch,
)


class Reverse(ProduceRequestInterceptor, FetchResponseInterceptor):
    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        return batch.with_records(r.with_value(r.value[::-1]) if r.value is not None else r
                                  for r in batch.records)

    def on_consume(self, batch: ConsumedBatch, ctx: ConsumeContext) -> ConsumedBatch:
        return batch.with_records(r.with_value(r.value[::-1]) if r.value is not None else r
                                  for r in batch.records)


class UpperOnConsume(FetchResponseInterceptor):
    async def on_consume(self, batch: ConsumedBatch, ctx: ConsumeContext) -> ConsumedBatch:
        return batch.with_records(r.with_value(r.value.upper()) if r.value is not None else r
                                  for r in batch.records)


class RefuseOnConsume(FetchResponseInterceptor):
    async def on_consume(self, batch: ConsumedBatch, ctx: ConsumeContext) -> ConsumedBatch:
        if "refuse" in batch.topic:
            raise RefuseFetch(f"no reading {batch.topic} at offset {batch.base_offset}")
        if "raise" in batch.topic:
            raise RuntimeError("the hook broke")
        if "grow" in batch.topic:
            return batch.with_records((*batch.records, batch.records[0]))
        if "slow" in batch.topic:
            await asyncio.sleep(5)
        return batch
