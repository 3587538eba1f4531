"""A request's disposition: what the proxy does with one client request, forward it or
answer it itself (:data:`Disposition` is ``Forward | Answer``), with the per-partition
tallies of a produce request that observers get."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kiproxy.interceptors.observer import PartitionSummary

__all__ = ["Answer", "Disposition", "Forward", "PartitionTally"]


@dataclass(slots=True)
class Forward:
    """Send ``frame`` (a request frame, no length prefix) to the upstream broker."""

    frame: bytes
    expect_response: bool = True
    """False for acks=0 produce requests: the broker sends nothing back."""
    on_response: Callable[[bytes], bytes] | None = None
    """Rewrites the broker's response frame before it goes to the client."""
    produce: list[PartitionTally] | None = None
    """Per-partition summaries of a produce request, when observed."""


@dataclass(slots=True)
class Answer:
    """Answer the client without contacting the broker."""

    frame: bytes | None
    """The response frame (no length prefix), or ``None`` to send nothing (acks=0)."""
    produce: list[PartitionTally] | None = None
    """Per-partition summaries of a produce request, when observed."""


Disposition = Forward | Answer
"""What the dispatcher decides for one request."""


@dataclass(slots=True)
class PartitionTally:
    """A tally of one produced topic-partition (batches, records, bytes, outcome), filled
    in as the request goes; frozen for observers by :meth:`freeze`."""

    topic: str
    partition: int
    batches: int
    records: int
    bytes: int
    outcome: str = "forwarded"
    error_code: int = 0
    error_message: str | None = None
    base_offset: int = -1
    route: str | None = None
    """The route that handled the partition; None when it passed through unrouted."""

    def freeze(self) -> PartitionSummary:
        """The observer-facing, immutable summary."""
        return PartitionSummary(
            topic=self.topic, partition=self.partition, batches=self.batches,
            records=self.records, bytes=self.bytes,
            outcome=self.outcome,  # type: ignore[arg-type]
            error_code=self.error_code, error_message=self.error_message,
            base_offset=self.base_offset, route=self.route,
        )
