"""A request's disposition: what the proxy does with one client request, forward it or
answer it itself (:data:`Disposition` is ``Forward | Answer``), with the per-partition
tallies of a produce request that observers get."""

from __future__ import annotations

import dataclasses
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


@dataclass(frozen=True, slots=True)
class PartitionTally:
    """A tally of one produced topic-partition (batches, records, bytes, outcome): made
    by the pipeline once the partition is decided, completed with the broker's answer
    by :meth:`answered` (a new tally), handed to observers as :meth:`freeze`."""

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
    link: str | None = None
    """The chain link that refused it, when one did."""
    observed_outcome: str | None = None
    """What a route or link in observe mode would have done (``unchanged``,
    ``transformed``, ``rejected``); None when none judged it."""
    observed_error_code: int = 0
    observed_error_message: str | None = None
    observed_link: str | None = None

    def answered(self, base_offset: int, error_code: int,
                 error_message: str | None) -> PartitionTally:
        """This tally once the broker answered the partition (an error: ``broker_error``)."""
        if not error_code:
            return dataclasses.replace(self, base_offset=base_offset)
        return dataclasses.replace(self, base_offset=base_offset, outcome="broker_error",
                                   error_code=error_code, error_message=error_message)

    def freeze(self) -> PartitionSummary:
        """The observer-facing, immutable summary."""
        return PartitionSummary(
            topic=self.topic, partition=self.partition, batches=self.batches,
            records=self.records, bytes=self.bytes,
            outcome=self.outcome,  # type: ignore[arg-type]
            error_code=self.error_code, error_message=self.error_message,
            base_offset=self.base_offset, route=self.route, link=self.link,
            observed_outcome=self.observed_outcome,  # type: ignore[arg-type]
            observed_error_code=self.observed_error_code,
            observed_error_message=self.observed_error_message,
            observed_link=self.observed_link,
        )
