"""Kafka error codes a rejected batch may carry: the one enum every caller uses.

:class:`ErrorCode` names the codes by Kafka's own names (``POLICY_VIOLATION``
is 44). The proxy, its isolation workers and the replay pipeline all take
their codes from here; ``ERROR_CODES`` (name -> code) and :func:`error_code`
(a name or a number to a code) are the plugin API's older spellings of the
same table and stay. Code 0 (NONE) is success and so is not in the table.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import IntEnum
from types import MappingProxyType

from kiproxy.protocol.messages import kafka_error_codes

__all__ = ["ERROR_CODES", "ErrorCode", "error_code", "error_name"]


class ErrorCode(IntEnum):
    """Kafka error codes a rejection may use (the values are Kafka's)."""

    UNKNOWN_SERVER_ERROR = -1
    CORRUPT_MESSAGE = 2
    REQUEST_TIMED_OUT = 7
    MESSAGE_TOO_LARGE = 10
    RECORD_LIST_TOO_LARGE = 18
    INVALID_REQUIRED_ACKS = 21
    TOPIC_AUTHORIZATION_FAILED = 29
    CLUSTER_AUTHORIZATION_FAILED = 31
    INVALID_TIMESTAMP = 32
    INVALID_REQUEST = 42
    UNSUPPORTED_FOR_MESSAGE_FORMAT = 43
    POLICY_VIOLATION = 44
    TRANSACTIONAL_ID_AUTHORIZATION_FAILED = 53
    UNSUPPORTED_COMPRESSION_TYPE = 76
    INVALID_RECORD = 87
    THROTTLING_QUOTA_EXCEEDED = 89
    UNKNOWN_TOPIC_ID = 100


ERROR_CODES: Mapping[str, int] = MappingProxyType({e.name: int(e) for e in ErrorCode})
"""Kafka error names a rejection may use, and their codes."""


def error_code(error: str | int) -> int:
    """The numeric Kafka error code for a name such as ``"POLICY_VIOLATION"``, or a code
    Kafka defines given as a number; ValueError for any other (a response cannot carry
    it)."""
    if isinstance(error, int):
        if int(error) not in kafka_error_codes():
            raise ValueError(
                f"unknown Kafka error code {int(error)}: a response carries only codes Kafka "
                f"defines; use one of {', '.join(sorted(ERROR_CODES))} or such a code")
        return int(error)
    try:
        return int(ErrorCode[error.upper()])
    except KeyError:
        raise ValueError(
            f"unknown Kafka error {error!r}; use one of {', '.join(sorted(ERROR_CODES))} "
            "or a numeric code"
        ) from None


def error_name(code: int) -> str:
    """Kafka's name of an error code (``POLICY_VIOLATION``), or ``ERROR_<code>``."""
    try:
        return ErrorCode(code).name
    except ValueError:
        return f"ERROR_{code}"
