"""``kiproxy.interceptors.builtin.trace:TraceContext`` - a W3C ``traceparent`` on every record.

A record without a ``traceparent`` header gets one, appended after its other
headers: version ``00``, a random 16-byte trace id, a random 8-byte parent id
and the sampled flag, e.g. ``00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01``
(https://www.w3.org/TR/trace-context/). A record that carries a valid one keeps
it untouched, so traces started by the producer continue through the proxy.

A ``traceparent`` that is present but invalid (wrong shape, upper-case hex,
all-zero ids, version ``ff``, or more than one such header) is handled by
``on_invalid``:

- ``replace`` (default, as the W3C spec asks of a vendor that cannot parse
  it): the first one gets a fresh value in place, any others are removed;
- ``keep``: left as it is;
- ``reject``: the batch is rejected (INVALID_RECORD by default) with
  ``record_errors`` naming each such record.

Config::

    interceptor:
      class: kiproxy.interceptors.builtin.trace:TraceContext
      config:
        header: traceparent
        sampled: true            # trace-flags 01 (false: 00)
        on_invalid: replace      # or keep, reject
        error: INVALID_RECORD
"""

from __future__ import annotations

import random
import re
from typing import Literal

from pydantic import Field

from kiproxy.interceptors import (
    Header,
    InterceptContext,
    PluginSettings,
    ProduceRequestInterceptor,
    Record,
    RecordBatch,
)
from kiproxy.interceptors.builtin._per_record import per_record
from kiproxy.interceptors.settings import ErrorName

_TRACEPARENT = re.compile(rb"([0-9a-f]{2})-([0-9a-f]{32})-([0-9a-f]{16})-([0-9a-f]{2})(-.*)?",
                          re.DOTALL)


def traceparent_problem(value: bytes | None) -> str | None:
    """Why ``value`` is not a valid W3C traceparent, or None when it is."""
    if value is None:
        return "the traceparent header is null"
    match = _TRACEPARENT.fullmatch(value)
    if match is None:
        return f"traceparent {value[:80]!r} is not VERSION-TRACEID-PARENTID-FLAGS in lower-case hex"
    version, trace_id, parent_id, _, rest = match.groups()
    if version == b"ff":
        return "traceparent version ff is invalid"
    if version == b"00" and rest is not None:
        return "a version 00 traceparent has exactly four fields"
    if trace_id == b"0" * 32:
        return "traceparent trace-id is all zeros"
    if parent_id == b"0" * 16:
        return "traceparent parent-id is all zeros"
    return None


class TraceContextSettings(PluginSettings):
    """Settings of ``trace_context``."""

    header: str = Field(default="traceparent", min_length=1)
    """The header that carries the trace context."""
    sampled: bool = True
    """The trace-flags of a new traceparent: ``01`` (sampled), or ``00`` with false."""
    on_invalid: Literal["replace", "keep", "reject"] = "replace"
    """A present but invalid traceparent: replaced in place, kept, or the batch rejected."""
    error: ErrorName = "INVALID_RECORD"
    """The error code of a rejection (``on_invalid: reject``)."""


class TraceContext(ProduceRequestInterceptor[TraceContextSettings]):
    """Adds a W3C ``traceparent`` header to records that have none; keeps valid ones."""

    def __init__(self) -> None:
        self.header = "traceparent"
        self.flags = "01"
        self.on_invalid = "replace"
        self.error = "INVALID_RECORD"
        self._random = random.Random()

    def configure(self, config: TraceContextSettings) -> None:
        """Take the validated settings."""
        self.header = config.header
        self.flags = "01" if config.sampled else "00"
        self.on_invalid = config.on_invalid
        self.error = config.error

    def new_traceparent(self) -> bytes:
        """A fresh version-00 traceparent (random ids, never all zeros)."""
        trace_id = self._random.getrandbits(128) or 1
        parent_id = self._random.getrandbits(64) or 1
        return f"00-{trace_id:032x}-{parent_id:016x}-{self.flags}".encode()

    def _one(self, record: Record) -> Record | str:
        values = record.header_values(self.header)
        if not values:
            return record.with_header(self.header, self.new_traceparent())
        problem = (f"{len(values)} traceparent headers" if len(values) > 1
                   else traceparent_problem(values[0]))
        if problem is None or self.on_invalid == "keep":
            return record
        if self.on_invalid == "reject":
            return problem
        fresh = self.new_traceparent()
        headers: list[Header] = []
        replaced = False
        for h in record.headers:
            if h.key != self.header:
                headers.append(h)
            elif not replaced:
                headers.append(Header(self.header, fresh))
                replaced = True
        return record.with_headers(headers)

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
        """Return the batch with a traceparent on every record."""
        return per_record(batch, self._one, plugin="TraceContext",
                          refused=f"carry an invalid {self.header}", error=self.error)
