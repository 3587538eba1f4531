"""``tp_plain_reject:PlainReject`` - ``raise RejectBatch(message)`` with no error code.

Topics named ``code-<N>-...`` are rejected with error code N instead, to compare
what clients show for other codes.
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
        if batch.topic.startswith("code-"):
            raise RejectBatch(REASON, error=int(batch.topic.split("-")[1]))
        raise RejectBatch(REASON)
