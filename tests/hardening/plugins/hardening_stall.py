"""``hardening_stall:Stall`` - a plain ``intercept`` that holds the event loop;
``hardening_stall:Wait`` - an ``async`` one that waits without holding it.

A plain (not ``async``) interceptor runs inline on the proxy's event loop, so
while it computes the proxy handles no other I/O. The fault tests use that to
cut the broker connection at an exact point: after the proxy read a Produce
request and before it forwards it. ``Wait`` keeps the request in the
interceptor while the proxy goes on with other I/O: the client tests close the
client's connection while its answer is owed (``started_file`` says when).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kiproxy.interceptors import (
    InterceptContext,
    ProduceRequestInterceptor,
    RecordBatch,
    RejectBatch,
)


class Stall(ProduceRequestInterceptor):
    """Busy for ``stall_ms`` (default 1500) on every batch, then passes it unchanged
    (or rejects it, with ``reject: true``). With ``started_file``, that file is
    written when a stall begins."""

    def __init__(self) -> None:
        self.stall = 1.5
        self.reject = False
        self.started: Path | None = None

    def configure(self, config: Mapping[str, Any]) -> None:
        """Read ``stall_ms``, ``reject`` and ``started_file``."""
        self.stall = float(config.get("stall_ms", 1500)) / 1000
        self.reject = bool(config.get("reject", False))
        started = config.get("started_file")
        self.started = None if started is None else Path(str(started))

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Hold the loop (as a long computation would), then pass or reject the batch."""
        if self.started is not None:
            self.started.write_text(batch.topic)
        time.sleep(self.stall)
        if self.reject:
            raise RejectBatch("stalled, then rejected", error="POLICY_VIOLATION")
        return batch


class Wait(Stall):
    """As :class:`Stall`, but waits with ``asyncio.sleep``: the proxy's event loop
    carries on meanwhile (a closed client connection is noticed, answers arrive)."""

    async def intercept(  # type: ignore[override]
            self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Wait ``stall_ms``, then pass or reject the batch."""
        if self.started is not None:
            self.started.write_text(batch.topic)
        await asyncio.sleep(self.stall)
        if self.reject:
            raise RejectBatch("waited, then rejected", error="POLICY_VIOLATION")
        return batch
