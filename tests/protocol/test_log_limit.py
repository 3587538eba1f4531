"""One line per key per interval; what was held back is counted into the next line."""

from __future__ import annotations

import logging

import pytest

from kiproxy.protocol.log_limit import RateLimitedLog


def test_lines_within_the_interval_are_held_back_and_counted_into_the_next(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [100.0]
    limited = RateLimitedLog(logging.getLogger("kiproxy.test.limit"), 10.0,
                             clock=lambda: now[0])
    more = " ({count} more in {interval:g} s, 100%)"
    with caplog.at_level(logging.WARNING, logger="kiproxy.test.limit"):
        assert limited.warning("a", "bad %s", 1, more=more)
        assert not limited.warning("a", "bad %s", 2, more=more)
        assert not limited.warning("a", "bad %s", 3, more=more)
        assert limited.warning("b", "other %s", 1, more=more)  # keys are apart
        now[0] += 10.0
        assert limited.warning("a", "bad %s", 4, more=more)
    assert [r.getMessage() for r in caplog.records] == [
        "bad 1", "other 1", "bad 4 (2 more in 10 s, 100%)"]


def test_a_summary_takes_the_count_and_a_quiet_key_is_forgotten() -> None:
    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("kiproxy.test.limit"), 5.0, clock=lambda: now[0])
    assert limited.allow("x") == 0
    assert limited.allow("x") is None
    assert limited.summary("x") == 1
    assert limited.allow("x") is None  # the summary opened a new window
    assert limited.summary("x") == 1
    assert limited.summary("x") == 0  # nothing held back: forgotten
    assert limited.allow("x") == 0


def test_distinct_keys_past_the_limit_do_not_grow_it() -> None:
    limited = RateLimitedLog(logging.getLogger("kiproxy.test.limit"), max_keys=3)
    for n in range(10):
        assert limited.allow(n) == 0
    assert len(limited._windows) <= 3
