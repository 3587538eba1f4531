"""Fetch-side test plugins.

* ``Reverse`` reverses each value's bytes on produce and again on consume: what is
  stored is reversed, what a consumer through the proxy reads is what was produced
  (the shape of envelope encryption, without a key).
* ``UpperOnConsume`` is a fetch-side-only hook: values read through the proxy are
  upper-cased; produce passes through.
* ``RefuseOnConsume`` refuses every batch of a topic whose name contains ``refuse``
  (RefuseFetch), raises on ``raise``, returns one record too many on ``grow``, tuples
  instead of records on ``tuples``, records with a header key that cannot be encoded
  on ``surrogate``, values a thousand times as long on ``inflate``, and sleeps past its
  deadline on ``slow``; other topics pass unchanged.
* ``PlainOnConsume`` is a plain (not ``async``) hook: on a topic whose name contains
  ``slow`` it sleeps 0.6 s (past the tests' 300 ms deadline) and returns the batch; it
  raises ``KeyError('boom')`` on a batch holding a record whose value is ``poison``;
  other batches pass unchanged.
* ``BlockReverse`` is ``Reverse``'s fetch side on records blocks (``on_consume_block``):
  it decodes the block, reverses the values and encodes a new block. On a topic whose
  name contains ``records`` it answers None (records are wanted), on ``same`` it returns
  the block it was given, on ``garbage`` bytes that are no records block, on ``moved``
  a block whose first offset delta moved, on ``short`` one record fewer.
* ``BlocksReverse`` is ``BlockReverse`` answering a partition's blocks at once
  (``on_consume_blocks``), each as ``BlockReverse`` would; it records the record counts
  of each call in ``calls``. On a topic whose name contains ``whole-raise`` it raises,
  on ``whole-count`` it answers one block too few, on ``whole-odd`` it answers None for
  every second block (``on_consume`` reverses those), on ``whole-refuse`` a
  ``RefuseFetch`` for the second block, on ``whole-gen`` its answers as a generator.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterable, Sequence

from kiproxy.interceptors import (
    ConsumeContext,
    ConsumedBatch,
    ConsumedBlock,
    FetchResponseInterceptor,
    InterceptContext,
    ProduceRequestInterceptor,
    RecordBatch,
    RefuseFetch,
)
from kiproxy.protocol.records import decode_records, encode_records


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
        if "tuples" in batch.topic:  # not Records
            return batch.with_records([("k", "v")] * len(batch.records))  # type: ignore[misc]
        if "inflate" in batch.topic:  # every value a thousand times as long
            return batch.with_records(r.with_value((r.value or b"") * 1000)
                                      for r in batch.records)
        if "surrogate" in batch.topic:  # a header key that stands for no byte
            return batch.with_records(r.with_header("\ud800x", b"v") for r in batch.records)
        if "slow" in batch.topic:
            await asyncio.sleep(5)
        return batch


class PlainOnConsume(FetchResponseInterceptor):
    def on_consume(self, batch: ConsumedBatch, ctx: ConsumeContext) -> ConsumedBatch:
        if "slow" in batch.topic:
            time.sleep(0.6)
        if any(r.value == b"poison" for r in batch.records):
            raise KeyError("boom")
        return batch


class BlockReverse(FetchResponseInterceptor):
    def on_consume(self, batch: ConsumedBatch, ctx: ConsumeContext) -> ConsumedBatch:
        return batch.with_records(r.with_value(r.value[::-1]) if r.value is not None else r
                                  for r in batch.records)

    def on_consume_block(self, block: ConsumedBlock, ctx: ConsumeContext
                         ) -> bytes | memoryview | None:
        if "records" in block.topic:
            return None
        if "same" in block.topic:
            return block.data
        if "copy" in block.topic:  # the same bytes, in another object
            return bytes(block.data)
        if "garbage" in block.topic:
            return b"\x07not a block"
        data = bytes(block.data)
        records = decode_records(data, 0, len(data), block.record_count, block.base_timestamp)
        new = tuple(r.with_value(r.value[::-1]) if r.value is not None else r for r in records)
        if "moved" in block.topic:
            new = (new[0].with_offset_delta(new[0].offset_delta + 1), *new[1:])
        if "short" in block.topic:
            new = new[:-1]
        return encode_records(new, block.base_timestamp, False)[0]


class BlocksReverse(BlockReverse):
    calls: list[list[int]] = []

    async def on_consume_blocks(self, blocks: Sequence[ConsumedBlock], ctx: ConsumeContext
                                ) -> Iterable[bytes | memoryview | RefuseFetch | None]:
        BlocksReverse.calls.append([b.record_count for b in blocks])
        topic = blocks[0].topic
        if "whole-raise" in topic:
            raise RuntimeError("the whole partition broke")
        answers: list[bytes | memoryview | RefuseFetch | None] = [
            self.on_consume_block(b, ctx) for b in blocks]
        if "whole-count" in topic:
            return answers[:-1]
        if "whole-odd" in topic:
            return [None if i % 2 else a for i, a in enumerate(answers)]
        if "whole-gen" in topic:
            return (a for a in answers)
        if "whole-refuse" in topic and len(answers) > 1:
            return [answers[0], RefuseFetch("not this one"), *answers[2:]]
        return answers
