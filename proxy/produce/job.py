"""What goes into deciding one topic-partition of a ProduceRequest, and what comes out.

Contract: the pipeline builds one immutable :class:`PartitionJob` per topic-partition
of a request, once, before anything is decided: who sent it, the request's facts
(:class:`RequestFacts`, shared by every partition of the request), how the topic is
named and keyed, the partition's batch headers
(:class:`~kiproxy.protocol.partition_batches.PartitionBatches`, read once) and the
route's chain that judges it (None: forwarded as it came). Deciding a job answers
with one immutable :class:`Decision`: forwarded as it lies in the frame, transformed
(its re-encoded records), or refused (a :class:`~kiproxy.proxy.produce.response.Rejection`),
together with what routes and links in observe mode saw. The settle step
(:mod:`~kiproxy.proxy.produce.settle`) turns each job and its decision into the
request's answer and every side effect.

Immutable to the type checker, not at run time: each is a slotted dataclass whose
fields are ``Final`` (mypy refuses an assignment to one). These are built and read on
every Produce request, several times a partition, so both must be cheap: a slotted
field is read in a few instructions where a named tuple's goes through a descriptor
(about three times the cost), and ``frozen=True`` would make each construction pay an
``object.__setattr__`` per field (about five times a plain one).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal

from kiproxy.interceptors.api import AcknowledgedBatch
from kiproxy.protocol.partition_batches import PartitionBatches
from kiproxy.proxy.produce.response import Observation, Rejection

if TYPE_CHECKING:
    from kiproxy.proxy.net.client import RequestingClient
    from kiproxy.proxy.routes.runtime import LoadedChain

__all__ = ["FORWARDED", "UNREAD", "Decision", "PartitionJob", "RequestFacts"]


@dataclass(slots=True)
class RequestFacts:
    """What every partition of one ProduceRequest shares (built per request)."""

    frame: Final[bytes]
    """The request frame; each partition's records lie in it."""
    version: Final[int]
    acks: Final[int]
    transactional_id: Final[str | None]
    received_at_ms: Final[int]
    """When the proxy read the request (wall clock, ms): the interceptors' and the
    dead-letter copies' ``received_at_ms``."""


@dataclass(slots=True)
class PartitionJob:
    """One topic-partition of a request, as the pipeline decides and settles it (built
    per partition)."""

    client: Final[RequestingClient]
    """Who sent it (its identity, its log fields)."""
    facts: Final[RequestFacts]
    topic: Final[str]
    """The topic's name (for a Produce v13 topic id the proxy does not know: the id)."""
    topic_key: Final[Any]
    """How the request names the topic: its name, or its id on v13 (what a refusal
    and an acknowledgement are keyed by)."""
    partition: Final[int]
    position: Final[tuple[int, int]]
    """(topic position, partition position) in the request: where a splice cuts."""
    batches: Final[PartitionBatches]
    """Its batch headers, read once (:data:`UNREAD` when nothing will look at them)."""
    chain: Final[LoadedChain | None]
    """The chain of the route that judges it; None: forwarded untouched."""
    route: Final[str | None] = None
    """How its log lines name the route (None for the ``interceptor:`` shorthand)."""
    known: Final[bool] = True
    """The topic is known by name (False: a v13 topic id the proxy has not learned)."""


UNREAD = PartitionBatches(start=0, end=0, headers=(), records=0, compressed_blocks=())
"""The headers of a partition forwarded untouched and not tallied: never read."""


@dataclass(slots=True)
class Decision:
    """What the proxy decided for one topic-partition of a ProduceRequest (built per
    decided partition)."""

    records: Final[bytes | None] = None
    """The re-encoded records when ``changed``; None otherwise (refused, or forwarded as
    they lie in the request frame)."""
    changed: Final[bool] = False
    """The interceptor transformed at least one batch: ``records`` were re-encoded."""
    acknowledged: Final[tuple[AcknowledgedBatch, ...]] = ()
    """The batches the acknowledgement hook hears about once the broker answered."""
    rejection: Final[Rejection | None] = None
    """Why the partition is not forwarded, when it is not."""
    observed: Final[tuple[Observation, ...]] = ()
    """What routes or links in observe mode would have done to its batches."""
    watched: Final[bool] = False
    """Some batch was judged by a route or link in observe mode (``observed`` may still
    be empty: nothing would have changed)."""

    @property
    def outcome(self) -> Literal["forwarded", "transformed", "rejected"]:
        """Forwarded as it came, transformed, or refused."""
        if self.rejection is not None:
            return "rejected"
        return "transformed" if self.changed else "forwarded"


FORWARDED = Decision()
"""A partition forwarded as it lies in the request frame with nothing to acknowledge or
record (immutable, so one value serves every such partition)."""
