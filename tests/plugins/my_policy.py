"""``my_policy:MyPolicy`` - the rule of the observe-mode and dead-letter tests.

A batch holding a record whose value contains ``bad`` (any case) is refused with
POLICY_VIOLATION, each such record named in the record errors
(``record N says bad``); any other batch is returned as it came.
"""

from __future__ import annotations

from kiproxy.interceptors import (
    InterceptContext,
    ProduceRequestInterceptor,
    RecordBatch,
    RejectBatch,
)


class MyPolicy(ProduceRequestInterceptor):
    """Refuses batches with a ``bad`` value."""

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        bad = [(i, f"record {i} says bad") for i, r in enumerate(batch.records)
               if r.value is not None and b"bad" in r.value.lower()]
        if bad:
            raise RejectBatch(f"{len(bad)} of {len(batch.records)} records say bad",
                              error="POLICY_VIOLATION", record_errors=bad)
        return batch
