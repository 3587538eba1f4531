"""The words a failed broker connection is reported in."""

from __future__ import annotations

import socket

import pytest

from kiproxy.proxy.brokers.failures import connect_error


@pytest.mark.parametrize(("exc", "timeout", "tls", "words"), [
    (ConnectionRefusedError(111, "Connection refused"), None, False, "connection refused"),
    (socket.gaierror(-2, "Name or service not known"), None, False,
     "host name does not resolve (Name or service not known)"),
    # The attempt's time left, 9.999 s of a 10 s start-up budget, reads as 10 s.
    (TimeoutError(), 9.9994, False, "no answer within 10 s"),
    (TimeoutError(), 2.5, True,
     "no answer within 2.5 s (does the broker speak TLS on this port?)"),
    # A plaintext listener resets a TLS handshake: no errno text, and not a class name.
    (ConnectionResetError(), None, True,
     "connection reset (does the broker speak TLS on this port?)"),
    (ConnectionResetError(), None, False, "connection reset"),
    (ConnectionResetError(104, "Connection reset by peer"), None, False,
     "connection reset by peer"),
])
def test_a_failed_connection_is_said_in_plain_words(exc: BaseException, timeout: float | None,
                                                     tls: bool, words: str) -> None:
    assert connect_error(exc, timeout, tls) == words
