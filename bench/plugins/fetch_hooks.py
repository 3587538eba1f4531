"""Fetch-side hooks for ``bench.fetch_hook``: ``Identity`` returns each batch as it is
(the decode alone); ``Reverse`` reverses every value (decode and re-encode)."""

from __future__ import annotations

from kiproxy.interceptors import ConsumeContext, ConsumedBatch, FetchResponseInterceptor


class Identity(FetchResponseInterceptor):
    def on_consume(self, batch: ConsumedBatch, ctx: ConsumeContext) -> ConsumedBatch:
        return batch


class Reverse(FetchResponseInterceptor):
    def on_consume(self, batch: ConsumedBatch, ctx: ConsumeContext) -> ConsumedBatch:
        return batch.with_records(r.with_value(r.value[::-1]) if r.value is not None else r
                                  for r in batch.records)
