"""``tp_raise:Raise`` - a plugin with a bug: raises on the topics it is configured for."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tp_common import topic_pattern

from kiproxy.interceptors import InterceptContext, ProduceRequestInterceptor, RecordBatch


class Raise(ProduceRequestInterceptor):
    """Raises ``RuntimeError(message)`` for topics matching ``topics``; others pass."""

    def __init__(self) -> None:
        self.pattern = topic_pattern({})
        self.message = "tp_raise exploded"

    def configure(self, config: Mapping[str, Any]) -> None:
        """Read ``topics`` and ``message``."""
        self.pattern = topic_pattern(config)
        self.message = str(config.get("message", self.message))

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Raise for a matching topic."""
        if self.pattern.fullmatch(batch.topic):
            raise RuntimeError(self.message)
        return batch
