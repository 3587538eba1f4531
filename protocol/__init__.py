"""Sans-IO Kafka wire code: framing, headers, messages (through kio) and record batches.

Nothing here touches a socket or an event loop; bytes go in, values come out,
and values go back to bytes.
"""

from kiproxy.protocol.errors import (
    CorruptBatch,
    DecompressionLimitExceeded,
    FrameTooLarge,
    MalformedFrame,
    MalformedMessage,
    ProtocolError,
    UnsupportedCompression,
    UnsupportedMagic,
    UnsupportedVersion,
)

__all__ = [
    "CorruptBatch",
    "DecompressionLimitExceeded",
    "FrameTooLarge",
    "MalformedFrame",
    "MalformedMessage",
    "ProtocolError",
    "UnsupportedCompression",
    "UnsupportedMagic",
    "UnsupportedVersion",
]
