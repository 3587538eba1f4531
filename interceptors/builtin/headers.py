"""``kiproxy.interceptors.builtin.headers:StampHeaders`` - a paper trail in record headers.

Appends the configured headers, then the proxy host, the producer's client id
and the time the proxy received the request, to every record. Existing headers
are kept in order (header keys may repeat, KIP-82).

Config::

    interceptor:
      class: kiproxy.interceptors.builtin.headers:StampHeaders
      config:
        headers: {env: prod, team: payments}   # static headers
        prefix: "kiproxy-"                     # prefix of the three stamps
        stamp: true                            # false: only the static headers
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from kiproxy.interceptors import Header, InterceptContext, ProduceRequestInterceptor, RecordBatch


class StampHeaders(ProduceRequestInterceptor):
    """Appends static headers and ``<prefix>host``, ``client-id``, ``received-ms`` stamps."""

    def __init__(self) -> None:
        self.static: tuple[Header, ...] = ()
        self.prefix = "kiproxy-"
        self.stamp = True

    def configure(self, config: Mapping[str, Any]) -> None:
        """Read ``headers``, ``prefix`` and ``stamp``."""
        headers = config.get("headers", {}) or {}
        if not isinstance(headers, Mapping):
            raise ValueError("headers must be a mapping of header name to value")
        self.static = tuple(
            Header(str(k), None if v is None else str(v).encode()) for k, v in headers.items()
        )
        self.prefix = str(config.get("prefix", self.prefix))
        self.stamp = bool(config.get("stamp", True))

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Return the batch with the headers appended to every record."""
        added = self.static
        if self.stamp:
            added += (
                Header(f"{self.prefix}host", ctx.proxy_host.encode()),
                Header(f"{self.prefix}client-id",
                       None if ctx.client_id is None else ctx.client_id.encode()),
                Header(f"{self.prefix}received-ms", str(ctx.received_at_ms).encode()),
            )
        return batch.with_records(r.with_headers(r.headers + added) for r in batch.records)
