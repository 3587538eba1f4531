"""The public observer API: watch every request and response without touching it.

An observer is told about each request the proxy receives and each response
it sends back (KIP-388's broker-side observer, at the proxy). Produce
responses carry a :class:`PartitionSummary` per topic-partition: what was
produced, what the interceptor did with it and what the broker answered.

Observers never affect traffic. The proxy hands events to each observer on a
thread of its own, through a bounded queue: a slow observer only falls behind
(events beyond the queue are dropped and counted), and an observer that
raises has the error logged and counted. Methods are therefore called on that
thread, never on the event loop, one event at a time and in order.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

__all__ = [
    "Observer",
    "Outcome",
    "PartitionSummary",
    "RequestInfo",
    "ResponseInfo",
]

Outcome = Literal["forwarded", "transformed", "rejected", "broker_error"]
"""What became of a produced topic-partition batch.

``forwarded``: passed on unchanged and stored; ``transformed``: the interceptor
changed it and the result was stored; ``rejected``: the proxy refused it (the
interceptor, a deadline, or undecodable data); ``broker_error``: forwarded, and
the broker answered with an error.
"""


@dataclass(frozen=True, slots=True, kw_only=True)
class PartitionSummary:
    """One topic-partition of a produce request, and what became of it."""

    topic: str
    """Topic name (Produce v13 topic ids are resolved to names when known)."""
    partition: int
    batches: int
    """Record batches in the partition's data (control batches included)."""
    records: int
    """Records in the partition's batches, as the producer sent them."""
    bytes: int
    """Size of the partition's ``records`` field as the producer sent it."""
    outcome: Outcome
    error_code: int = 0
    """The Kafka error code the producer received for this partition (0 on success)."""
    error_message: str | None = None
    base_offset: int = -1
    """Offset the broker assigned to the first record; -1 when none (rejected, acks=0)."""
    route: str | None = None
    """The name of the route whose chain handled the partition (``default`` for the
    ``interceptor:`` shorthand); None when no route matched and it passed through."""
    link: str | None = None
    """The chain link (its ``class``) that refused the partition, when one did."""
    observed_outcome: Literal["unchanged", "transformed", "rejected"] | None = None
    """What a route or link in observe mode would have done to the partition (the
    partition itself was forwarded as received by an observing route); None when no
    route or link in observe mode judged it."""
    observed_error_code: int = 0
    """The error code the producer would have got (``observed_outcome`` rejected)."""
    observed_error_message: str | None = None
    """The error message it would have got."""
    observed_link: str | None = None
    """The link whose verdict ``observed_outcome`` is."""
    observe_mode: bool = False
    """The route is in observe mode (``mode: observe``): it forwarded the partition as
    received, whatever its chain made of it, and whether or not ``observe_sample`` had the
    chain judge it (``observed_outcome`` None: not judged). False on an enforcing route,
    including one whose links observe."""


@dataclass(frozen=True, slots=True, kw_only=True)
class RequestInfo:
    """A request received from a client."""

    api_key: int
    api_name: str
    api_version: int
    correlation_id: int
    client_id: str | None
    client_address: str
    """``host:port`` the client connects from."""
    principal: str | None
    """The authenticated principal when the proxy knows it, else ``None`` (unknown)."""
    size: int
    """Request size in bytes (without the 4-byte length prefix)."""
    received_at_ms: int
    """When the proxy received the request, ms since the epoch."""
    node_id: int | None
    """The broker node the client addressed; ``None`` on the bootstrap listener."""


@dataclass(frozen=True, slots=True, kw_only=True)
class ResponseInfo:
    """The response sent back for a :class:`RequestInfo`."""

    request: RequestInfo
    size: int
    """Response size in bytes (without the length prefix); 0 when none was sent (acks=0)."""
    latency_ms: float
    """From the proxy reading the request to writing the response (or forwarding, acks=0)."""
    answered_by_proxy: bool
    """True when the proxy answered without the broker (e.g. everything rejected)."""
    produce: tuple[PartitionSummary, ...] = ()
    """For Produce: one summary per topic-partition, in request order."""


class Observer:
    """Base class of observers. Configure them under ``observers`` in the config.

    Override what you need; every method has a no-op default. Methods run on
    the observer's own thread and must not assume an event loop.
    """

    def configure(self, config: Mapping[str, Any]) -> None:
        """Receive the observer's ``config`` mapping once, before any event."""

    def on_request(self, info: RequestInfo) -> None:
        """A request was received (before it is forwarded)."""

    def on_response(self, info: ResponseInfo) -> None:
        """A response went back to the client (or an acks=0 produce was forwarded)."""

    def close(self) -> None:
        """Flush and release resources; called once, after the last event, on shutdown."""
