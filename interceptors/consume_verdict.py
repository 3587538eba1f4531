"""Judging a fetch-side hook's answer: the one function the proxy and the test kit call.

Contract: :func:`judge_consume` hands a :class:`~kiproxy.interceptors.consume.ConsumedBatch`
to an interceptor's ``on_consume`` (plain or ``async def``; awaited within ``timeout``
seconds) and returns either the batch to send on (the given one, or one with the same
records count whose every record keeps its ``offset_delta`` and ``timestamp``) or a
:class:`ConsumeRefusal`: the error code the partition is answered with, a message
naming the hook and what it did, and a short ``reason`` for metrics and logs. It never
raises for anything the hook does: ``RefuseFetch`` keeps its code; any other
exception, a wrong return type, another record count, a moved offset or timestamp,
and a missed deadline are ``UNKNOWN_SERVER_ERROR``, which consumers retry.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Any

from kiproxy.interceptors.awaiting import within
from kiproxy.interceptors.consume import ConsumeContext, ConsumedBatch, RefuseFetch
from kiproxy.interceptors.errors import ErrorCode
from kiproxy.protocol.records import first_moved

__all__ = ["ConsumeRefusal", "judge_consume"]

log = logging.getLogger("kiproxy.fetch")

_RETRIED = ErrorCode.UNKNOWN_SERVER_ERROR


@dataclass(frozen=True, slots=True)
class ConsumeRefusal:
    """Why a fetched partition is answered with an error instead of its records."""

    code: int
    """The Kafka error code of the partition."""
    message: str
    """What happened, naming the hook (for the proxy's log: Fetch has no message field)."""
    reason: str
    """``refused``, ``plugin_error``, ``bad_return``, ``record_count``, ``shape_changed``
    or ``timeout``."""


async def judge_consume(interceptor: Any, batch: ConsumedBatch, ctx: ConsumeContext, *,
                        name: str, timeout: float | None) -> ConsumedBatch | ConsumeRefusal:
    """``interceptor.on_consume(batch, ctx)`` judged (see the module docstring)."""
    try:
        result = interceptor.on_consume(batch, ctx)
        if asyncio.iscoroutine(result) or isinstance(result, asyncio.Future):
            result = await within(result, timeout)
    except RefuseFetch as exc:
        return ConsumeRefusal(exc.error_code, f"{name} refused it: {exc.message}", "refused")
    except TimeoutError:
        return ConsumeRefusal(_RETRIED, f"{name} did not answer within "
                              f"{(timeout or 0) * 1000:.0f} ms (timeout_ms)", "timeout")
    except Exception as exc:
        log.debug("fetch-side hook %s raised", name, exc_info=True)
        return ConsumeRefusal(_RETRIED, f"{name} raised {type(exc).__name__}: {exc}",
                              "plugin_error")
    if not isinstance(result, ConsumedBatch):
        return ConsumeRefusal(_RETRIED, f"{name} returned {type(result).__name__}, not a "
                              "ConsumedBatch", "bad_return")
    if result.records is batch.records:
        return result
    if len(result.records) != len(batch.records):
        return ConsumeRefusal(_RETRIED, f"{name} returned {len(result.records)} records for "
                              f"{len(batch.records)}: records can be changed, not added or "
                              "removed", "record_count")
    moved = first_moved(batch.records, result.records)
    if moved >= 0:
        offset = batch.base_offset + batch.records[moved].offset_delta
        return ConsumeRefusal(_RETRIED, f"{name} moved the record at offset {offset} "
                              "(its offset delta or timestamp changed; they are the "
                              "log's)", "shape_changed")
    return result
