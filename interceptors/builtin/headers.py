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

from pydantic import ConfigDict, Field

from kiproxy.interceptors import (
    Header,
    InterceptContext,
    PluginSettings,
    ProduceRequestInterceptor,
    RecordBatch,
)


class StampHeadersSettings(PluginSettings):
    """Settings of ``stamp_headers``."""

    model_config = ConfigDict(coerce_numbers_to_str=True)  # `version: 2` is the header "2"

    headers: dict[str, str | None] = Field(default_factory=dict)
    """Static headers appended to every record, name -> value (null: a null value)."""
    prefix: str = "kiproxy-"
    """Prefix of the three stamps (``host``, ``client-id``, ``received-ms``)."""
    stamp: bool = True
    """Append the three stamps; false: only the static headers."""


class StampHeaders(ProduceRequestInterceptor[StampHeadersSettings]):
    """Appends static headers and ``<prefix>host``, ``client-id``, ``received-ms`` stamps."""

    def __init__(self) -> None:
        self.static: tuple[Header, ...] = ()
        self.prefix = "kiproxy-"
        self.stamp = True

    def configure(self, config: StampHeadersSettings) -> None:
        """Take the validated settings."""
        self.static = tuple(
            Header(k, None if v is None else v.encode()) for k, v in config.headers.items())
        self.prefix = config.prefix
        self.stamp = config.stamp

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
