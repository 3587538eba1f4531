"""``tp_package:Shout`` - a plugin that is a package (directory with ``__init__.py``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kiproxy.interceptors import InterceptContext, ProduceRequestInterceptor, RecordBatch

from .shout import shout

__all__ = ["Shout"]


class Shout(ProduceRequestInterceptor):
    """Upper-cases values and appends ``suffix`` (default ``!``)."""

    def __init__(self) -> None:
        self.suffix = b"!"

    def configure(self, config: Mapping[str, Any]) -> None:
        """Read ``suffix``."""
        self.suffix = str(config.get("suffix", "!")).encode()

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Shout every non-null value."""
        return batch.with_records(
            r.with_value(shout(r.value, self.suffix)) if r.value is not None else r
            for r in batch.records
        )
