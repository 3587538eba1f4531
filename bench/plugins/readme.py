"""Benchmark plugin: a transform written the way the README teaches.

``python -m bench.proxy`` loads it with ``--plugins-dir bench/plugins
--interceptor readme:Readme``. Every value is rewritten in Python, one
``Record.with_value`` per record, as users' own plugins do; compare it with the
built-in ``uppercase``, which does the same in compiled code.
"""

from __future__ import annotations

from kiproxy.interceptors import InterceptContext, ProduceRequestInterceptor, RecordBatch


class Readme(ProduceRequestInterceptor):
    """Upper-cases every non-null value with ``bytes.upper()``."""

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Return the batch with every value upper-cased."""
        return batch.with_records(
            r.with_value(r.value.upper()) if r.value is not None else r
            for r in batch.records
        )
