"""``kiproxy.interceptors.builtin.uppercase:Uppercase`` - upper-cases record values.

Config (all optional)::

    interceptor:
      class: kiproxy.interceptors.builtin.uppercase:Uppercase
      config:
        keys: false        # also upper-case keys
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kiproxy.interceptors import InterceptContext, ProduceRequestInterceptor, Record, RecordBatch


class Uppercase(ProduceRequestInterceptor):
    """Upper-cases every non-null value (ASCII bytes.upper), and keys if ``keys: true``."""

    keys = False

    def configure(self, config: Mapping[str, Any]) -> None:
        """Read ``keys``."""
        self.keys = bool(config.get("keys", False))

    def _one(self, record: Record) -> Record:
        if record.value is not None:
            record = record.with_value(record.value.upper())
        if self.keys and record.key is not None:
            record = record.with_key(record.key.upper())
        return record

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Return the batch with upper-cased values."""
        return batch.with_records(self._one(r) for r in batch.records)
