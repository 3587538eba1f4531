"""Example plugin dropped into the plugins dir: masks payment card numbers in values.

Any run of 13-19 digits (spaces or dashes allowed between them) becomes
``****-****-****-1234``, keeping the last four digits. Records without one pass
unchanged, and a batch with nothing to mask is forwarded as its original bytes.

Use it with ``--plugins-dir plugins --interceptor mask_card_numbers:MaskCardNumbers``.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from kiproxy.interceptors import InterceptContext, ProduceRequestInterceptor, Record, RecordBatch

_CARD = re.compile(rb"\b(?:\d[ -]?){12,18}\d\b")


def _mask(match: re.Match[bytes]) -> bytes:
    digits = re.sub(rb"\D", b"", match.group())
    return b"****-****-****-" + digits[-4:]


class MaskCardNumbers(ProduceRequestInterceptor):
    """Replaces card-number-like digit runs in record values."""

    def configure(self, config: Mapping[str, Any]) -> None:
        """Optional ``topics``: only these topics are masked (default: all)."""
        topics = config.get("topics")
        self.topics = set(topics) if topics else None

    def _one(self, record: Record) -> Record:
        if record.value is None:
            return record
        masked = _CARD.sub(_mask, record.value)
        return record if masked == record.value else record.with_value(masked)

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Return the batch with card numbers masked."""
        if self.topics is not None and batch.topic not in self.topics:
            return batch
        return batch.with_records(self._one(r) for r in batch.records)
