"""``tp_bad_records:BadRecords`` - returns records the proxy cannot encode.

Config: ``topics`` (regex, default every topic) and ``mode``: ``tuples`` (plain
``(key, value)`` tuples instead of Records) or ``surrogate`` (a header key that is
not encodable as UTF-8). Other topics pass untouched.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tp_common import topic_pattern

from kiproxy.interceptors import InterceptContext, ProduceRequestInterceptor, RecordBatch


class BadRecords(ProduceRequestInterceptor):
    """Keeps the record count but returns something that is not valid records."""

    def __init__(self) -> None:
        self.pattern = topic_pattern({})
        self.mode = "tuples"

    def configure(self, config: Mapping[str, Any]) -> None:
        """Read ``topics`` and ``mode``."""
        self.pattern = topic_pattern(config)
        self.mode = str(config.get("mode", "tuples"))
        if self.mode not in {"tuples", "surrogate"}:
            raise ValueError(f"mode {self.mode!r} is not tuples or surrogate")

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Return the same number of unencodable records for a matching topic."""
        if not self.pattern.fullmatch(batch.topic):
            return batch
        if self.mode == "tuples":
            return batch.with_records((r.key, r.value) for r in batch.records)  # type: ignore[misc]
        return batch.with_records(r.with_header("\ud800", b"x") for r in batch.records)
