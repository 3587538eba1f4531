"""Benchmark plugin: the identity interceptor (the proxy decodes, nothing changes).

``python -m bench.proxy`` loads it with ``--plugins-dir bench/plugins
--interceptor identity:Identity``. The proxy parses the ProduceRequest and
decodes every batch before calling :meth:`Identity.intercept`; returning the
same batch object means the original bytes are forwarded (no re-encoding), so
this scenario measures the cost of looking at every record and nothing else.
"""

from __future__ import annotations

from kiproxy.interceptors import InterceptContext, ProduceRequestInterceptor, RecordBatch


class Identity(ProduceRequestInterceptor):
    """Returns every batch unchanged."""

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Return ``batch`` itself."""
        return batch
