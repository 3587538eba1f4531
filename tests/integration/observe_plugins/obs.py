"""Plugins for the observability tests: an interceptor and a few observers."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Mapping
from typing import Any

from kiproxy.interceptors import (
    AcknowledgedBatch,
    InterceptContext,
    ProduceRequestInterceptor,
    RecordBatch,
    RejectBatch,
)
from kiproxy.interceptors.observer import Observer, ResponseInfo


class UpperOrReject(ProduceRequestInterceptor):
    """Topics starting ``rej`` are rejected, ``up`` uppercased, others pass untouched.

    Every acknowledgement is appended to ``acks_path`` as a JSON line.
    """

    def configure(self, config: Mapping[str, Any]) -> None:
        self.acks_path = config.get("acks_path")
        self._lock = threading.Lock()

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        if batch.topic.startswith("rej"):
            raise RejectBatch(f"no writes to {batch.topic}", error="POLICY_VIOLATION")
        if batch.topic.startswith("up"):
            return batch.with_records(
                r.with_value(r.value.upper()) if r.value is not None else r
                for r in batch.records)
        return batch

    def on_acknowledgement(self, batch: AcknowledgedBatch, base_offset: int,
                           error: int | None) -> None:
        if self.acks_path:
            line = json.dumps({"topic": batch.topic, "partition": batch.partition,
                               "records": batch.record_count, "base_offset": base_offset,
                               "error": error, "transformed": batch.transformed})
            with self._lock, open(self.acks_path, "a") as f:
                f.write(line + "\n")


class Raising(Observer):
    """Raises on every event."""

    def on_request(self, info: Any) -> None:
        raise RuntimeError("observer bug (request)")

    def on_response(self, info: ResponseInfo) -> None:
        raise RuntimeError("observer bug (response)")


class Slow(Observer):
    """Sleeps on every event; records how many it saw."""

    def configure(self, config: Mapping[str, Any]) -> None:
        self.delay = float(config.get("delay_s", 0.5))

    def on_response(self, info: ResponseInfo) -> None:
        time.sleep(self.delay)


class Recorder(Observer):
    """Writes every request and response event as a JSON line to ``path``."""

    def configure(self, config: Mapping[str, Any]) -> None:
        self.file = open(config["path"], "a")  # noqa: SIM115

    def on_request(self, info: Any) -> None:
        self.file.write(json.dumps({"kind": "request", "api": info.api_name,
                                    "correlation_id": info.correlation_id,
                                    "client_id": info.client_id}) + "\n")

    def on_response(self, info: ResponseInfo) -> None:
        self.file.write(json.dumps({"kind": "response", "api": info.request.api_name,
                                    "correlation_id": info.request.correlation_id,
                                    "size": info.size, "latency_ms": info.latency_ms,
                                    "produce": len(info.produce)}) + "\n")

    def close(self) -> None:
        self.file.close()
