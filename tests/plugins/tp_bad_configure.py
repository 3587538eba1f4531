"""Interceptors that cannot start."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kiproxy.interceptors import InterceptContext, ProduceRequestInterceptor, RecordBatch


class BadConfigure(ProduceRequestInterceptor):
    """``configure()`` rejects every config."""

    def configure(self, config: Mapping[str, Any]) -> None:
        """Always fail, naming the setting."""
        raise ValueError(f"tp_bad_configure: 'limit' must be a positive integer, "
                         f"got {config.get('limit')!r}")

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Never reached."""
        return batch


class BadInit(ProduceRequestInterceptor):
    """Cannot even be created."""

    def __init__(self) -> None:
        raise RuntimeError("tp_bad_configure: BadInit needs a licence file")

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Never reached."""
        return batch


class AsyncConfigure(ProduceRequestInterceptor):
    """``async def configure``: a coroutine the loader cannot run at load."""

    prefix = b"unset"

    async def configure(self, config: Mapping[str, Any]) -> None:  # type: ignore[override]
        """Would set the prefix, if anything awaited it."""
        self.prefix = str(config["prefix"]).encode()

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Prefix every value."""
        return batch.with_records([r.with_value(self.prefix + (r.value or b""))
                                   for r in batch.records])


class AsyncAcknowledgement(ProduceRequestInterceptor):
    """``async def on_acknowledgement``: the proxy calls it and does not await it."""

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """The batch as it came."""
        return batch

    async def on_acknowledgement(  # type: ignore[override]
            self, batch: Any, base_offset: int, error: int | None) -> None:
        """Would record the acknowledgement, if anything awaited it."""
