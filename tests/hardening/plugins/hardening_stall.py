"""``hardening_stall:Stall`` - a plain ``intercept`` that holds the event loop.

A plain (not ``async``) interceptor runs inline on the proxy's event loop, so
while it computes the proxy handles no other I/O. The fault tests use that to
cut the broker connection at an exact point: after the proxy read a Produce
request and before it forwards it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from kiproxy.interceptors import InterceptContext, ProduceRequestInterceptor, RecordBatch


class Stall(ProduceRequestInterceptor):
    """Busy for ``stall_ms`` (default 1500) on every batch, then passes it unchanged."""

    def __init__(self) -> None:
        self.stall = 1.5

    def configure(self, config: Mapping[str, Any]) -> None:
        """Read ``stall_ms``."""
        self.stall = float(config.get("stall_ms", 1500)) / 1000

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Hold the loop (as a long computation would), then pass the batch."""
        time.sleep(self.stall)
        return batch
