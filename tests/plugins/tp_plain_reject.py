"""``tp_plain_reject:PlainReject`` - ``raise RejectBatch(message)`` with no error code.

Topics named ``code-<N>-...`` are rejected with error code N instead, to compare
what clients show for other codes; topics named ``each-...`` are rejected with the
default code and a record error for each record whose value starts with ``bad``.
"""

from __future__ import annotations

from kiproxy.interceptors import (
    InterceptContext,
    ProduceRequestInterceptor,
    RecordBatch,
    RejectBatch,
)

REASON = "orders need a customer id"


class PlainReject(ProduceRequestInterceptor):
    """Rejects every batch; with the default error code unless the topic names one."""

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Reject the batch."""
        if batch.topic.startswith("each-"):
            raise RejectBatch(REASON, record_errors=[
                (i, f"record {i} is bad") for i, r in enumerate(batch.records)
                if (r.value or b"").startswith(b"bad")])
        if batch.topic.startswith("code-"):
            raise RejectBatch(REASON, error=int(batch.topic.split("-")[1]))
        raise RejectBatch(REASON)
