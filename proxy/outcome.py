"""What the proxy does with one client request: forward it, or answer it itself."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Answer", "Forward", "RequestOutcome"]


@dataclass(slots=True)
class Forward:
    """Send ``frame`` (a request frame, no length prefix) to the upstream broker."""

    frame: bytes
    expect_response: bool = True
    """False for acks=0 produce requests: the broker sends nothing back."""
    on_response: Callable[[bytes], bytes] | None = None
    """Rewrites the broker's response frame before it goes to the client."""


@dataclass(slots=True)
class Answer:
    """Answer the client without contacting the broker."""

    frame: bytes | None
    """The response frame (no length prefix), or ``None`` to send nothing (acks=0)."""


RequestOutcome = Forward | Answer
