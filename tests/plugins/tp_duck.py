"""``tp_duck:Duck`` - not a ProduceRequestInterceptor subclass, but it has ``intercept``."""

from __future__ import annotations

from kiproxy.interceptors import InterceptContext, RecordBatch


class Duck:
    """Duck-typed interceptor: reverses every non-null value."""

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Return the batch with reversed values."""
        return batch.with_records(
            r.with_value(r.value[::-1]) if r.value is not None else r for r in batch.records
        )
