"""Typed errors raised by the sans-IO protocol layer.

Every decoder in :mod:`protocol` raises a subclass of :class:`ProtocolError` and
nothing else for malformed input. Messages name the field and the byte offset
so that a log line is enough to understand what a client sent.
"""

from __future__ import annotations


class ProtocolError(Exception):
    """Base class of every error raised while decoding Kafka wire data."""


class FrameTooLarge(ProtocolError):
    """A frame's length prefix is above the configured maximum frame size."""


class MalformedFrame(ProtocolError):
    """A frame or header is truncated or has an impossible length."""


class UnsupportedVersion(ProtocolError):
    """An API key or version that the protocol layer cannot parse."""


class MalformedMessage(ProtocolError):
    """A request or response body that does not parse against its schema."""


class CorruptBatch(ProtocolError):
    """A record batch that is truncated, inconsistent or fails its CRC-32C."""


class DecompressionLimitExceeded(CorruptBatch):
    """A records block that decompresses to more than its limit allows (a bomb, or a
    batch larger than the proxy is configured to inspect)."""

    def __init__(self, message: str, *, limit: int, setting: str) -> None:
        super().__init__(message)
        self.limit = limit
        """The byte limit the output passed."""
        self.setting = setting
        """The setting that made the limit, for the operator to raise if it was honest."""


class UnsupportedMagic(CorruptBatch):
    """A record batch in the old message format (magic 0 or 1)."""


class UnsupportedCompression(CorruptBatch):
    """A record batch whose attributes name a compression codec that does not exist."""


class SaslStateError(ProtocolError):
    """A request a broker refuses in the connection's SASL state (ILLEGAL_SASL_STATE)."""
