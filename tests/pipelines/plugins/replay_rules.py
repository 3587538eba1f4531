"""Test interceptors for the replay pipeline (loaded from this plugins dir, like a user's)."""

from __future__ import annotations

from replay_words import BAD_PREFIX, LOWER_PREFIX  # a sibling module: the dir is on sys.path

from kiproxy.interceptors import (
    InterceptContext,
    ProduceRequestInterceptor,
    RecordBatch,
    RejectBatch,
)


class RejectBad(ProduceRequestInterceptor):
    """Rejects a batch holding a value that starts with ``bad``; upper-cases ``lower:`` values."""

    def configure(self, config: dict[str, object]) -> None:
        self.error = str(config.get("error", "POLICY_VIOLATION"))

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        bad = [(i, "value starts with bad") for i, r in enumerate(batch.records)
               if r.value is not None and r.value.startswith(BAD_PREFIX)]
        if bad:
            raise RejectBatch(f"bad records in {batch.topic}", error=self.error,
                              record_errors=bad)
        return batch.with_records(
            r.with_value(r.value.upper()) if r.value is not None
            and r.value.startswith(LOWER_PREFIX) else r
            for r in batch.records
        )


class Mask(ProduceRequestInterceptor):
    """Masks ``secret`` in values; rejects batches holding a value that starts with ``drop``."""

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        if any(r.value is not None and r.value.startswith(b"drop") for r in batch.records):
            raise RejectBatch("drop requested", error="INVALID_RECORD")
        return batch.with_records(
            r.with_value(r.value.replace(b"secret", b"******")) if r.value is not None else r
            for r in batch.records
        )
