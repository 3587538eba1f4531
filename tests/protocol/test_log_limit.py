"""One line per key per interval; what was held back is counted into the next line."""

from __future__ import annotations

import asyncio
import logging

import pytest

from kiproxy.protocol.log_limit import MORE_IN_INTERVAL, RateLimitedLog


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


async def test_a_burst_that_stops_is_counted_by_a_summary_line(
        caplog: pytest.LogCaptureFixture) -> None:
    """Lines held back on the event loop reach the log in one line an interval after the
    first of them, with the last one's text, though no other line comes; then the key's
    next line is written at once again."""
    limited = RateLimitedLog(logging.getLogger("kiproxy.test.limit"), 0.05)
    with caplog.at_level(logging.WARNING, logger="kiproxy.test.limit"):
        assert limited.warning("tls", "refused %s", "10.0.0.1", more=MORE_IN_INTERVAL)
        for host in ("10.0.0.2", "10.0.0.3", "10.0.0.4"):
            assert not limited.warning("tls", "refused %s", host, more=MORE_IN_INTERVAL)
        await asyncio.sleep(0.2)
        assert limited.warning("tls", "refused %s", "10.0.0.5", more=MORE_IN_INTERVAL)
    assert [r.getMessage() for r in caplog.records] == [
        "refused 10.0.0.1",
        "3 more like it in the last 0.05 s not logged; the last: refused 10.0.0.4",
        "refused 10.0.0.5"]
    assert [r.levelno for r in caplog.records] == [logging.WARNING] * 3


async def test_a_line_that_counts_what_was_held_back_cancels_the_summary(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("kiproxy.test.limit"), 0.1,
                             clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kiproxy.test.limit"):
        limited.warning("k", "bad %d", 1, more=MORE_IN_INTERVAL)
        limited.warning("k", "bad %d", 2, more=MORE_IN_INTERVAL)  # held: a summary is due
        now[0] = 0.2  # the window has passed on the limiter's clock
        limited.warning("k", "bad %d", 3, more=MORE_IN_INTERVAL)  # counts it
        await asyncio.sleep(0.3)  # past the summary's time on the loop's clock
    assert [r.getMessage() for r in caplog.records] == [
        "bad 1", "bad 3 (1 more in the last 0.1 s)"]


def test_without_a_running_loop_the_count_waits_for_the_next_line(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    limited = RateLimitedLog(logging.getLogger("kiproxy.test.limit"), 10.0,
                             clock=lambda: now[0])
    with caplog.at_level(logging.WARNING, logger="kiproxy.test.limit"):
        limited.warning("k", "bad", more=MORE_IN_INTERVAL)
        limited.warning("k", "bad", more=MORE_IN_INTERVAL)
        now[0] = 10.0
        limited.warning("k", "bad", more=MORE_IN_INTERVAL)
    assert [r.getMessage() for r in caplog.records] == [
        "bad", "bad (1 more in the last 10 s)"]
    assert not limited._timers and not limited._held


def test_a_timer_left_on_a_closed_loop_does_not_stop_summaries(
        caplog: pytest.LogCaptureFixture) -> None:
    """A limiter kept across event loops (a module's, in a process that runs another loop
    later) summarizes on the loop running now."""
    limited = RateLimitedLog(logging.getLogger("kiproxy.test.limit"), 0.05)

    async def burst() -> None:
        limited.warning("k", "first", more=MORE_IN_INTERVAL)
        limited.warning("k", "held", more=MORE_IN_INTERVAL)

    async def again() -> None:
        limited.warning("k", "held again", more=MORE_IN_INTERVAL)
        await asyncio.sleep(0.2)

    asyncio.run(burst())  # its summary timer never fires: the loop ends first
    with caplog.at_level(logging.WARNING, logger="kiproxy.test.limit"):
        asyncio.run(again())
    assert [r.getMessage() for r in caplog.records] == [
        "first", "2 more like it in the last 0.05 s not logged; the last: held again"]
