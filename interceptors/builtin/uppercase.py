"""``kiproxy.interceptors.builtin.uppercase:Uppercase`` - upper-cases record values.

Config (all optional)::

    interceptor:
      class: kiproxy.interceptors.builtin.uppercase:Uppercase
      config:
        keys: false        # also upper-case keys

The per-record loop is the public :meth:`RecordBatch.with_upper_case
<kiproxy.interceptors.RecordBatch.with_upper_case>` (compiled, ``bytes.upper()``
semantics): it reads each value straight from the decoded batch and keeps a record
that has nothing to upper-case as it is, so a batch with nothing to change is
returned unchanged and forwarded as its original bytes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kiproxy.interceptors import InterceptContext, ProduceRequestInterceptor, RecordBatch


class Uppercase(ProduceRequestInterceptor):
    """Upper-cases every non-null value (ASCII bytes.upper), and keys if ``keys: true``."""

    keys = False

    def configure(self, config: Mapping[str, Any]) -> None:
        """Read ``keys``."""
        self.keys = bool(config.get("keys", False))

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Return the batch with upper-cased values (the batch itself if none changes)."""
        return batch.with_upper_case(keys=self.keys)
