"""``tp_reject:Reject`` - rejects every batch of the topics it is configured for.

Config: ``topics`` (regex over the whole topic name, default every topic),
``error`` (a Kafka error name or code, default POLICY_VIOLATION), ``message``,
``record_errors`` (true: every record of the batch is listed; a list of indices: those,
in that order, whether the batch has such records or not), ``trace`` (a file
that gets one JSON line per batch seen: topic, partition, record count, the
producer facts of the batch and the request facts of the context). Other topics
pass untouched.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from tp_common import topic_pattern

from kiproxy.interceptors import (
    InterceptContext,
    ProduceRequestInterceptor,
    RecordBatch,
    RejectBatch,
)


class Reject(ProduceRequestInterceptor):
    """Raises :class:`RejectBatch` for matching topics."""

    def __init__(self) -> None:
        self.pattern = topic_pattern({})
        self.error: str | int = "POLICY_VIOLATION"
        self.message = "rejected by tp_reject"
        self.record_errors: bool | list[int] = False
        self.trace: str | None = None

    def configure(self, config: Mapping[str, Any]) -> None:
        """Read ``topics``, ``error``, ``message``, ``record_errors`` and ``trace``."""
        self.pattern = topic_pattern(config)
        self.error = config.get("error", self.error)
        self.message = str(config.get("message", self.message))
        listed = config.get("record_errors", False)
        self.record_errors = [int(i) for i in listed] if isinstance(listed, list) else bool(
            listed)
        self.trace = config.get("trace")
        RejectBatch("check", self.error)  # an unknown error name fails at start

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Reject a matching topic's batch; pass any other batch as it is."""
        if self.trace is not None:
            line = {"topic": batch.topic, "partition": batch.partition,
                    "records": len(batch.records), "producer_id": batch.producer_id,
                    "producer_epoch": batch.producer_epoch,
                    "base_sequence": batch.base_sequence,
                    "transactional": batch.transactional, "compression": batch.compression,
                    "client_address": ctx.client_address, "client_id": ctx.client_id,
                    "received_at_ms": ctx.received_at_ms, "api_version": ctx.api_version,
                    "acks": ctx.acks, "transactional_id": ctx.transactional_id}
            with open(self.trace, "a") as f:
                f.write(json.dumps(line) + "\n")
        if not self.pattern.fullmatch(batch.topic):
            return batch
        indices = (self.record_errors if isinstance(self.record_errors, list)
                   else range(len(batch.records)) if self.record_errors else ())
        raise RejectBatch(self.message, error=self.error,
                          record_errors=[(i, f"record {i} refused") for i in indices])


class RejectToo(Reject):
    """``Reject`` under a name of its own, for a second route whose plugin's rate-limited
    warnings must not be held back by the first's."""
