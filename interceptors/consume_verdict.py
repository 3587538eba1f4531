"""Judging a fetch-side hook's answer: the one function the proxy and the test kit call.

Contract: :func:`judge_consume` hands a :class:`~kiproxy.interceptors.consume.ConsumedBatch`
to an interceptor's ``on_consume`` (plain or ``async def``; awaited within ``timeout``
seconds) and returns either the batch to send on (the given one, also for records
equal to those given, as on produce, so that the batch keeps the broker's bytes; or
one with the same records count whose every record keeps its ``offset_delta`` and
``timestamp``, and the given batch's topic, partition and producer fields) or a
:class:`ConsumeRefusal`: the error code the partition is answered with, a message
naming the hook and what it did, and a short ``reason`` for metrics and logs. It never
raises for anything the hook does: ``RefuseFetch`` keeps its code; any other
exception, a wrong return type, another record count, a moved batch (its
``base_offset``), record offset or timestamp, and a missed deadline are
``UNKNOWN_SERVER_ERROR``, which consumers retry. The
deadline is the produce side's rule: an ``async def`` hook is cancelled at it, a
plain one cannot be and is refused when it returns past ``ctx.deadline`` (whatever it
returned); an exception is kept on the refusal for the caller to log its traceback.
:func:`judge_consume_block` does the same for ``on_consume_block``, whose block is
checked record by record (compiled) instead: against the batch's records when the
caller has them, else against the block it gave (a batch handed on undecoded);
:func:`judge_consume_blocks` for ``on_consume_blocks``, each answer as a block's; a
block the call opened from that very block with
:func:`~kiproxy.interceptors.sealing.open_blocks` is those records by construction
and is not walked again (:func:`~kiproxy.protocol.parallel.noting_opened`).
"""

from __future__ import annotations

import inspect
import time
from collections.abc import Iterable, Mapping, Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from kiproxy.interceptors.awaiting import within
from kiproxy.interceptors.consume import (
    ConsumeContext,
    ConsumedBatch,
    ConsumedBlock,
    RefuseFetch,
)
from kiproxy.interceptors.errors import ErrorCode
from kiproxy.interceptors.verdict import (
    DEFAULT_OUTPUT_LIMITS,
    OutputLimits,
    clip,
    encoding_problem,
    output_size,
    oversized,
    unencodable_detail,
)
from kiproxy.protocol.errors import CorruptBatch
from kiproxy.protocol.parallel import Opened, noting_opened
from kiproxy.protocol.records import (
    Record,
    block_moved,
    check_block,
    decode_records,
    first_moved,
)

__all__ = ["ConsumeRefusal", "consume_encodable", "judge_consume", "judge_consume_block",
           "judge_consume_blocks", "unencodable"]

_RETRIED = ErrorCode.UNKNOWN_SERVER_ERROR


@dataclass(frozen=True, slots=True)
class ConsumeRefusal:
    """Why a fetched partition is answered with an error instead of its records."""

    code: int
    """The Kafka error code of the partition."""
    message: str
    """What happened, naming the hook (for the proxy's log: Fetch has no message field)."""
    reason: str
    """``refused``, ``plugin_error``, ``bad_return``, ``record_count``, ``shape_changed``,
    ``output_size`` or ``timeout``."""
    exception: BaseException | None = field(default=None, compare=False, repr=False)
    """The exception a ``plugin_error`` came from (its traceback, for the log)."""


async def _called(hook: Any, given: Any, ctx: ConsumeContext, name: str,
                  timeout: float | None) -> Any:
    """``hook(given, ctx)``, awaited within ``timeout`` when it is a coroutine, refused
    when a plain call returns past ``ctx.deadline`` (as :mod:`~kiproxy.interceptors.verdict`
    does for a plain ``intercept``); whatever it raises or misses turned into a
    :class:`ConsumeRefusal`."""
    try:
        result = hook(given, ctx)
        if inspect.isawaitable(result):  # a generator is not: on_consume_blocks' answers
            result = await within(result, timeout, name)
        elif timeout is not None and time.monotonic() > ctx.deadline:
            return _timed_out(name, timeout)
    except RefuseFetch as exc:
        return _refused(exc, name)
    except TimeoutError:
        return _timed_out(name, timeout)
    except Exception as exc:
        return ConsumeRefusal(_RETRIED, clip(f"{name} raised {type(exc).__name__}: {exc}"),
                              "plugin_error", exc)
    return result


def _timed_out(name: str, timeout: float | None) -> ConsumeRefusal:
    return ConsumeRefusal(_RETRIED, f"{name} did not answer within "
                          f"{(timeout or 0) * 1000:.0f} ms (timeout_ms)", "timeout")


async def judge_consume(interceptor: Any, batch: ConsumedBatch, ctx: ConsumeContext, *,
                        name: str, timeout: float | None,
                        limits: OutputLimits = DEFAULT_OUTPUT_LIMITS
                        ) -> ConsumedBatch | ConsumeRefusal:
    """``interceptor.on_consume(batch, ctx)`` judged (see the module docstring); ``limits``
    bound the bytes of records it may return, as on the produce side."""
    result = await _called(interceptor.on_consume, batch, ctx, name, timeout)
    if isinstance(result, ConsumeRefusal):
        return result
    if not isinstance(result, ConsumedBatch):
        return ConsumeRefusal(_RETRIED, f"{name} returned {type(result).__name__}, not a "
                              "ConsumedBatch", "bad_return")
    if result.base_offset != batch.base_offset:
        return ConsumeRefusal(_RETRIED, f"{name} moved the batch from offset "
                              f"{batch.base_offset} to {result.base_offset} (its base_offset "
                              "is the log's)", "shape_changed")
    if result.records is batch.records or result.records == batch.records:
        return batch  # unchanged: sent as the broker's bytes, not re-encoded
    if len(result.records) != len(batch.records):
        return ConsumeRefusal(_RETRIED, f"{name} returned {len(result.records)} records for "
                              f"{len(batch.records)}: records can be changed, not added or "
                              "removed", "record_count")
    try:
        moved = first_moved(batch.records, result.records)
    except (AttributeError, TypeError):  # something other than Records: found only now
        problem = encoding_problem(result.records, batch.records)  # names the record
        if problem is None:
            raise
        return unencodable(name, problem)
    if moved >= 0:
        return _moved(name, f"at offset {batch.base_offset + batch.records[moved].offset_delta}")
    detail = oversized(output_size(result.records), output_size, batch.records, limits)
    if detail is not None:
        return _too_large(name, detail)
    return batch.with_records(result.records)  # where it lies and its producer: the log's


def _too_large(name: str, detail: str) -> ConsumeRefusal:
    return ConsumeRefusal(_RETRIED, clip(f"{name} {detail}"), "output_size")


def unencodable(name: str, exc: Exception) -> ConsumeRefusal:
    """The refusal of records a hook returned that cannot be encoded (not Records, a
    header key holding a surrogate that stands for no byte, a timestamp out of range),
    ``exc`` being what encoding them raised: a ``bad_return``, as the produce side
    refuses such records."""
    return ConsumeRefusal(_RETRIED, clip(f"{name} {unencodable_detail(exc)}"), "bad_return")


def consume_encodable(judged: ConsumedBatch | ConsumeRefusal, given: ConsumedBatch,
                      name: str) -> ConsumedBatch | ConsumeRefusal:
    """``judged``, or its :func:`unencodable` refusal when it holds records that cannot be
    encoded (:func:`~kiproxy.interceptors.verdict.encoding_problem`)."""
    if isinstance(judged, ConsumeRefusal) or judged.records is given.records:
        return judged
    problem = encoding_problem(judged.records, given.records)
    return judged if problem is None else unencodable(name, problem)


async def judge_consume_block(interceptor: Any, block: ConsumedBlock,
                              records: tuple[Record, ...] | None, ctx: ConsumeContext, *,
                              name: str, timeout: float | None,
                              limits: OutputLimits = DEFAULT_OUTPUT_LIMITS
                              ) -> bytes | memoryview | ConsumeRefusal | None:
    """``interceptor.on_consume_block(block, ctx)`` judged: ``block.data`` itself
    (unchanged, also for a block of the same bytes), a new block that holds the same
    records' offset deltas and timestamps in order (as bytes; checked against
    ``records`` when given, else against
    ``block.data``), None (the hook wants records), or a :class:`ConsumeRefusal` as
    :func:`judge_consume` gives one, ``bad_return`` for a block that is not
    ``block.record_count`` well-formed records."""
    result = await _called(interceptor.on_consume_block, block, ctx, name, timeout)
    if isinstance(result, ConsumeRefusal):
        return result
    return _judged_block(result, block, records, name, limits)


async def judge_consume_blocks(interceptor: Any, blocks: Sequence[ConsumedBlock],
                               ctx: ConsumeContext, *, name: str, timeout: float | None,
                               limits: OutputLimits = DEFAULT_OUTPUT_LIMITS
                               ) -> list[bytes | memoryview | ConsumeRefusal | None] \
        | ConsumeRefusal:
    """``interceptor.on_consume_blocks(blocks, ctx)`` judged: one answer per block, each
    as :func:`judge_consume_block` judges it (a refusal for a block that is not its
    records, and for a :class:`RefuseFetch` answered for it); a :class:`ConsumeRefusal`
    for the whole call when it raised, missed its deadline or did not answer once per
    block."""
    with noting_opened() as opened:
        result = await _answers(interceptor, blocks, ctx, name, timeout)
        if isinstance(result, ConsumeRefusal):
            return result
        return [_refused(answer, name) if isinstance(answer, RefuseFetch)
                else _judged_block(answer, block, None, name, limits, opened)
                for answer, block in zip(result, blocks, strict=True)]


async def _answers(interceptor: Any, blocks: Sequence[ConsumedBlock], ctx: ConsumeContext,
                   name: str, timeout: float | None) -> Sequence[Any] | ConsumeRefusal:
    """The answers of ``on_consume_blocks``, one per block, or why the call is refused."""
    result = await _called(interceptor.on_consume_blocks, blocks, ctx, name, timeout)
    if isinstance(result, ConsumeRefusal):
        return result
    if isinstance(result, (bytes, bytearray, memoryview, str, Mapping, AbstractSet)) or \
            not isinstance(result, Iterable):
        return ConsumeRefusal(_RETRIED, f"{name} returned {type(result).__name__}, not a "
                              "sequence with an answer per block", "bad_return")
    if not isinstance(result, Sequence):  # a generator, say: its answers, in order
        try:
            result = list(result)  # the hook's own code runs here, as part of the call
        except RefuseFetch as exc:
            return _refused(exc, name)
        except Exception as exc:
            return ConsumeRefusal(_RETRIED, clip(f"{name} raised {type(exc).__name__}: "
                                                 f"{exc}"), "plugin_error", exc)
        if timeout is not None and time.monotonic() > ctx.deadline:
            return _timed_out(name, timeout)
    answers: Sequence[Any] = result
    if len(answers) != len(blocks):
        return ConsumeRefusal(_RETRIED, f"{name} returned {len(answers)} answers for "
                              f"{len(blocks)} blocks", "bad_return")
    return answers


def _refused(exc: RefuseFetch, name: str) -> ConsumeRefusal:
    """A :class:`RefuseFetch` a hook raised, or answered for one block."""
    return ConsumeRefusal(exc.error_code, clip(f"{name} refused it: {exc.message}"),
                          "refused")


def _judged_block(result: Any, block: ConsumedBlock, records: tuple[Record, ...] | None,
                  name: str, limits: OutputLimits = DEFAULT_OUTPUT_LIMITS,
                  opened: Opened | None = None
                  ) -> bytes | memoryview | ConsumeRefusal | None:
    """A block hook's ``result`` for ``block`` judged (see :func:`judge_consume_block`);
    ``opened``: the blocks ``open_blocks`` opened during the call."""
    if result is None or result is block.data:
        return result
    if opened:
        was = opened.get(id(result))
        if was is not None and was[0] is result and was[1] is block.data \
                and was[2] == block.record_count:
            return result  # opened from this very block: its records by construction
    if not isinstance(result, (bytes, bytearray, memoryview)):
        return ConsumeRefusal(_RETRIED, f"{name} returned {type(result).__name__}, not a "
                              "records block (bytes) or None", "bad_return")
    if len(result) == len(block.data) and bytes(result) == block.data.tobytes():
        return block.data  # the same bytes: unchanged, as records equal to a batch are
    detail = oversized(len(result), len, block.data, limits)
    if detail is not None:
        return _too_large(name, detail)
    try:
        moved = (block_moved(result, block.data, block.record_count) if records is None
                 else check_block(result, block.base_timestamp, records))
    except (CorruptBatch, ValueError, BufferError) as exc:
        return ConsumeRefusal(_RETRIED, f"{name} returned a records block that is not the "
                              f"batch's {block.record_count} records: {exc}", "bad_return")
    if moved >= 0:
        if records is None:  # rare: the records, to name the one that moved
            try:
                records = decode_records(bytes(block.data), 0, len(block.data),
                                         block.record_count, block.base_timestamp)
            except (CorruptBatch, ValueError):  # the log's own block, unreadable: the
                # record named by its place in the batch
                return _moved(name, f"{moved} of the batch at offset {block.base_offset}")
        return _moved(name, f"at offset {block.base_offset + records[moved].offset_delta}")
    return result if type(result) is bytes else bytes(result)


def _moved(name: str, which: str) -> ConsumeRefusal:
    return ConsumeRefusal(_RETRIED, f"{name} moved the record {which} (its offset delta or "
                          "timestamp changed; they are the log's)", "shape_changed")
