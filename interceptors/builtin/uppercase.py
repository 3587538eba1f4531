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

from kiproxy.interceptors import (
    InterceptContext,
    PluginSettings,
    ProduceRequestInterceptor,
    RecordBatch,
)


class UppercaseSettings(PluginSettings):
    """Settings of ``uppercase``."""

    keys: bool = False
    """Upper-case keys too, not only values."""


class Uppercase(ProduceRequestInterceptor[UppercaseSettings]):
    """Upper-cases every non-null value (ASCII bytes.upper), and keys if ``keys: true``."""

    keys = False

    def configure(self, config: UppercaseSettings) -> None:
        """Take the validated settings."""
        self.keys = config.keys

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Return the batch with upper-cased values (the batch itself if none changes)."""
        return batch.with_upper_case(keys=self.keys)
