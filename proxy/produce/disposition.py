"""A request's disposition: what the proxy does with one client request, forward it or
answer it itself (:data:`Disposition` is ``Forward | Answer``), with the per-partition
summaries of a produce request that observers get."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kiproxy.interceptors.observer import PartitionSummary

if TYPE_CHECKING:
    from kiproxy.proxy.net.frame_stream import Frame, FramePieces

__all__ = ["Answer", "Disposition", "Forward"]


@dataclass(slots=True)
class Forward:
    """Send ``frame`` (a request frame, no length prefix) to the upstream broker."""

    frame: bytes
    expect_response: bool = True
    """False for acks=0 produce requests: the broker sends nothing back."""
    on_response: Callable[[bytes], bytes] | None = None
    """Rewrites the broker's response frame before it goes to the client."""
    produce: list[PartitionSummary] | None = None
    """Per-partition summaries of a produce request, when observed."""
    transform: Callable[[bytes], bytes | Awaitable[Frame | FramePieces]] | None = None
    """Turns the broker's response frame into the client's (a Fetch answer through the
    fetch-side hooks): the new frame at once, or an awaitable of it or of its pieces;
    runs after ``on_response``. Answers still leave in request order."""


@dataclass(slots=True)
class Answer:
    """Answer the client without contacting the broker."""

    frame: bytes | None
    """The response frame (no length prefix), or ``None`` to send nothing (acks=0)."""
    produce: list[PartitionSummary] | None = None
    """Per-partition summaries of a produce request, when observed."""


Disposition = Forward | Answer
"""What the dispatcher decides for one request."""
