"""Interceptors that misbehave, for the plugin-isolation tests.

Loaded from this directory as a plugins dir (``--plugins-dir tests/isolation_plugins``):

- ``SpinOrUpper``: ``while True: pass`` on ``spin*`` topics; upper-cases values otherwise.
- ``Reveal``: upper-cases values, reverses keys, appends headers that describe the batch
  and the context it saw.
- ``Same``: returns the batch it got.
- ``Reject``: raises ``RejectBatch`` (POLICY_VIOLATION, with record errors).
- ``Raise``: raises ``ValueError``.
- ``Crash``: ``os._exit(config["code"])`` on ``crash*`` topics, SIGSEGV on ``segv*``;
  upper-cases otherwise.
- ``Sleep``: blocks ``config["sleep_ms"]`` on ``slow*`` topics; upper-cases values.
- ``AsyncUpper``: ``async def intercept`` that upper-cases values.
- ``ReturnsNone``: returns ``None``.
- ``Acked``: defines ``on_acknowledgement``.
- ``BadConfigure``: ``configure()`` raises; ``ExitOnConfigure``: it calls ``os._exit(5)``.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from collections.abc import Mapping
from typing import Any

from kiproxy.interceptors import (
    AcknowledgedBatch,
    InterceptContext,
    ProduceRequestInterceptor,
    RecordBatch,
    RejectBatch,
)


def _upper(batch: RecordBatch) -> RecordBatch:
    return batch.with_records(
        r.with_value(r.value.upper()) if r.value is not None else r for r in batch.records
    )


class SpinOrUpper(ProduceRequestInterceptor):
    """Loops forever on ``spin*`` topics, upper-cases values elsewhere."""

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        if batch.topic.startswith("spin"):
            while True:
                pass
        return _upper(batch)


class Reveal(ProduceRequestInterceptor):
    """Changes every record in a way that shows what the plugin received."""

    def configure(self, config: Mapping[str, Any]) -> None:
        self.tag = str(config.get("tag", ""))

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        seen_batch = json.dumps({
            "topic": batch.topic, "partition": batch.partition,
            "producer_id": batch.producer_id, "producer_epoch": batch.producer_epoch,
            "base_sequence": batch.base_sequence, "transactional": batch.transactional,
            "compression": batch.compression, "tag": self.tag,
        }, sort_keys=True).encode()
        seen_ctx = json.dumps({
            "client_id": ctx.client_id, "client_address": ctx.client_address,
            "principal": ctx.principal, "api_version": ctx.api_version, "acks": ctx.acks,
            "transactional_id": ctx.transactional_id, "deadline": ctx.deadline,
            "received_at_ms": ctx.received_at_ms, "proxy_host": ctx.proxy_host,
            "extra": dict(ctx.extra),
            "identity": {f: getattr(ctx.identity, f) for f in ctx.identity.__slots__},
        }, sort_keys=True).encode()
        return batch.with_records(
            r.with_key(r.key[::-1] if r.key is not None else None)
             .with_value(r.value.upper() if r.value is not None else None)
             .with_header("seen-batch", seen_batch)
             .with_header("seen-ctx", seen_ctx)
             .with_header("seen-null", None)
            for r in batch.records
        )


class Same(ProduceRequestInterceptor):
    """Leaves every batch as it is."""

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        return batch


class Reject(ProduceRequestInterceptor):
    """Rejects every batch with POLICY_VIOLATION and two record errors."""

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        raise RejectBatch(f"no writes to {batch.topic}", error="POLICY_VIOLATION",
                          record_errors=[(0, "first record is bad"), (1, None)])


class Raise(ProduceRequestInterceptor):
    """Raises ValueError."""

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        raise ValueError(f"cannot handle {batch.topic}")


class Crash(ProduceRequestInterceptor):
    """Ends its own process on ``crash*`` (exit code) and ``segv*`` (SIGSEGV) topics."""

    def configure(self, config: Mapping[str, Any]) -> None:
        self.code = int(config.get("code", 3))

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        if batch.topic.startswith("crash"):
            os._exit(self.code)
        if batch.topic.startswith("segv"):
            os.kill(os.getpid(), signal.SIGSEGV)
        return _upper(batch)


class Sleep(ProduceRequestInterceptor):
    """Takes ``sleep_ms`` (default 500) on ``slow*`` topics, then upper-cases values."""

    def configure(self, config: Mapping[str, Any]) -> None:
        self.sleep = float(config.get("sleep_ms", 500)) / 1000

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        if batch.topic.startswith("slow"):
            time.sleep(self.sleep)
        return _upper(batch)


class AsyncUpper(ProduceRequestInterceptor):
    """An ``async def intercept``."""

    async def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        await asyncio.sleep(0)
        return _upper(batch)


class ReturnsNone(ProduceRequestInterceptor):
    """Breaks the API by returning None."""

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> Any:
        return None


class Acked(Same):
    """Defines on_acknowledgement (not called in process mode)."""

    def on_acknowledgement(self, batch: AcknowledgedBatch, base_offset: int,
                           error: int | None) -> None:
        pass


class BadConfigure(ProduceRequestInterceptor):
    """``configure()`` raises."""

    def configure(self, config: Mapping[str, Any]) -> None:
        raise ValueError("setting 'url' is required")

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        return batch


class ExitOnConfigure(ProduceRequestInterceptor):
    """``configure()`` ends the process."""

    def configure(self, config: Mapping[str, Any]) -> None:
        os._exit(5)

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        return batch


class Environ(ProduceRequestInterceptor):
    """Puts the worker's value of the environment variable ``config["name"]`` in every
    record's value (``-`` when unset)."""

    def configure(self, config: Mapping[str, Any]) -> None:
        self.name = str(config["name"])

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        import os

        seen = os.environ.get(self.name, "-").encode()
        return batch.with_records(r.with_value(seen) for r in batch.records)
