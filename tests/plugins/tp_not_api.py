"""Things named as interceptors that are not interceptors."""

from __future__ import annotations

from kiproxy.interceptors import ProduceRequestInterceptor, RecordBatch

NOT_A_CLASS = "a string, not a class"


class NotAnInterceptor:
    """Has a ``transform`` method but no ``intercept``."""

    def transform(self, batch: RecordBatch) -> RecordBatch:
        """Not the API."""
        return batch


class AbstractOnly(ProduceRequestInterceptor):
    """Subclasses the base class but forgets ``intercept``."""

    def close(self) -> None:
        """Nothing to release."""
