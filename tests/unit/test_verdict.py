"""The verdict function (``interceptors.verdict``) and how the proxy logs verdicts."""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import pytest

from kiproxy.interceptors import (
    ErrorCode,
    InterceptContext,
    ProduceRequestInterceptor,
    Record,
    RecordBatch,
    RejectBatch,
    error_code,
)
from kiproxy.interceptors.verdict import (
    Judged,
    Rejected,
    Transformed,
    Unchanged,
    acknowledgement_hook,
    judge,
    judge_sync,
)
from kiproxy.proxy.observe.verdict_log import Subject, VerdictLog

BATCH = RecordBatch(topic="t", partition=0, records=tuple(
    Record(value=b"v%d" % i, timestamp=10 + i, offset_delta=i) for i in range(2)))


def _ctx(seconds: float = 5.0) -> InterceptContext:
    return InterceptContext(client_id="c", client_address="127.0.0.1:1", principal=None,
                            api_version=9, acks=-1, transactional_id=None,
                            deadline=time.monotonic() + seconds)


class _Answer(ProduceRequestInterceptor):
    def __init__(self, answer: Any) -> None:
        self.answer = answer

    def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> Any:
        if isinstance(self.answer, BaseException):
            raise self.answer
        return self.answer(batch) if callable(self.answer) else self.answer


def _run(awaitable: Any, timeout: float | None) -> Any:
    async def bounded() -> Any:
        return await asyncio.wait_for(awaitable, timeout)

    return asyncio.run(bounded())


@pytest.mark.parametrize("answer", [
    lambda b: b,
    lambda b: b.with_records(list(b.records)),
    lambda b: b.with_records(Record(value=r.value, timestamp=r.timestamp,
                                    offset_delta=r.offset_delta) for r in b.records),
])
async def test_equal_records_are_unchanged(answer: Any) -> None:
    assert await judge(_Answer(answer), BATCH, _ctx(), name="p", timeout=1) == Unchanged(BATCH)


async def test_a_different_offset_delta_is_a_transformation() -> None:
    moved = BATCH.with_records(r.with_offset_delta(5 - i) for i, r in enumerate(BATCH.records))
    verdict = await judge(_Answer(moved), BATCH, _ctx(), name="p", timeout=1)
    assert verdict == Transformed(moved)


@pytest.mark.parametrize(("answer", "expected"), [
    (RejectBatch("no", error="POLICY_VIOLATION", record_errors=[(1, "x")]),
     Rejected(code=44, message="no", record_errors=((1, "x"),))),
    (KeyError("k"), Rejected(code=87, message="interceptor p failed: KeyError: 'k'",
                             fault="raised")),
    (None, Rejected(code=87, message="interceptor p returned NoneType, not a RecordBatch",
                    fault="return_type")),
    (lambda b: b.with_records(b.records[:1]), Rejected(
        code=87, message="interceptor p broke the record-count rule: returned 1 records "
        "for a batch of 2", fault="record_count")),
    (Judged(Rejected(code=87, message="judged elsewhere", fault="return_type")),
     Rejected(code=87, message="judged elsewhere", fault="return_type")),
])
def test_rejections(answer: Any, expected: Rejected) -> None:
    plugin = _Answer(answer)
    verdict = asyncio.run(judge(plugin, BATCH, _ctx(), name="p", timeout=1))
    assert verdict == expected
    assert judge_sync(plugin, BATCH, _ctx(), name="p", timeout=1, run=_run) == expected
    assert verdict.plugin_fault is (expected.fault is not None)  # type: ignore[union-attr]


def test_a_plugins_messages_are_cut_to_a_bounded_size() -> None:
    """A reason goes to the producer and into the log: a plugin may not decide their
    size (a 10 MB reason reached kafka-python whole and was logged at every rejection)."""
    huge = RejectBatch("r" * 10_000_000, record_errors=[(0, "e" * 5000), (1, "a"), (1, "b")])
    verdict = asyncio.run(judge(_Answer(huge), BATCH, _ctx(), name="p", timeout=1))
    assert isinstance(verdict, Rejected)
    assert verdict.message == "r" * 1024 + "... (9,998,976 more characters cut)"
    assert verdict.record_errors == ((0, "e" * 1024 + "... (3,976 more characters cut)"),
                                     (1, "a; b"))
    raised = asyncio.run(judge(_Answer(ValueError("x" * 5000)), BATCH, _ctx(), name="p",
                               timeout=1))
    assert isinstance(raised, Rejected) and raised.fault == "raised"
    assert raised.message.startswith("interceptor p failed: ValueError: xxx")
    assert len(raised.message) < 1100 and raised.message.endswith("more characters cut)")


def test_the_deadline_sync_and_async() -> None:
    class Slow(ProduceRequestInterceptor):
        async def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
            await asyncio.sleep(5)
            return batch

    timed_out = Rejected(code=7, message="interceptor p did not finish within 50 ms",
                         fault="timeout")
    assert asyncio.run(judge(Slow(), BATCH, _ctx(0.05), name="p", timeout=0.05)) == timed_out
    assert judge_sync(Slow(), BATCH, _ctx(0.05), name="p", timeout=0.05, run=_run) == timed_out
    late = asyncio.run(judge(_Answer(lambda b: b), BATCH, _ctx(-1), name="p", timeout=0.05))
    assert late == timed_out


def test_the_acknowledgement_hook_only_when_overridden() -> None:
    class Acked(_Answer):
        def on_acknowledgement(self, batch: Any, base_offset: int, error: int | None) -> None:
            pass

    assert acknowledgement_hook(_Answer(None)) is None
    plugin = Acked(None)
    assert acknowledgement_hook(plugin) == plugin.on_acknowledgement


def test_one_error_code_enum_and_its_old_spellings() -> None:
    assert ErrorCode.POLICY_VIOLATION == 44 == error_code("policy_violation")
    assert Rejected(code=87, message="").error == "INVALID_RECORD"
    assert Rejected(code=12345, message="").error == "ERROR_12345"


def test_plugin_faults_and_repeated_rejections_are_rate_limited(
        caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]
    log = VerdictLog(logging.getLogger("kiproxy.test.verdicts"), clock=lambda: now[0])
    fault = Rejected(code=87, message="interceptor p returned NoneType, not a RecordBatch",
                     fault="return_type")
    policy = Rejected(code=44, message="closed")
    with caplog.at_level(logging.INFO, "kiproxy.test.verdicts"):
        for _ in range(5):
            log.rejected(fault, "p", "t[0]", "127.0.0.1:1", "c")
            log.rejected(policy, "p", "t[0]", "127.0.0.1:1", "c")
        log.rejected(Rejected(code=7, message="slow", fault="timeout"), "p", "t[0]", "a", "c")
        log.rejected(policy, "p", "t[1]", "127.0.0.1:2", "c")  # another partition: its own line
        now[0] = 11.0
        log.rejected(fault, "p", "t[0]", "127.0.0.1:1", "c")
        log.rejected(policy, "p", "t[0]", "127.0.0.1:3", "c")  # same host, another connection
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert warnings == [
        "rejected t[0] from 127.0.0.1:1 (client_id 'c'): interceptor p returned NoneType, "
        "not a RecordBatch",
        "rejected t[0] from a (client_id 'c'): slow",
        "rejected t[0] from 127.0.0.1:1 (client_id 'c'): interceptor p returned NoneType, "
        "not a RecordBatch (4 more like it in the last 10 s not logged)",
    ]
    # A producer retrying a batch that never passes costs a line per interval, not per try.
    assert infos == [
        "rejected t[0] from 127.0.0.1:1 (client_id 'c'): error 44: closed",
        "rejected t[1] from 127.0.0.1:2 (client_id 'c'): error 44: closed",
        "rejected t[0] from 127.0.0.1:3 (client_id 'c'): error 44: closed "
        "(4 more like it in the last 10 s not logged)",
    ]




def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]

async def test_faults_held_back_are_summarized_without_waiting_for_another(
        caplog: pytest.LogCaptureFixture) -> None:
    """The second fault of a plugin within the interval, on another topic with another
    message, reaches the log once the interval has passed, though no third one comes."""
    log = VerdictLog(logging.getLogger("kiproxy.test.verdicts"), interval=0.05)
    listed = Rejected(code=87, message="interceptor p returned list, not a RecordBatch",
                      fault="return_type")
    none = Rejected(code=87, message="interceptor p returned NoneType, not a RecordBatch",
                    fault="return_type")
    with caplog.at_level(logging.INFO, "kiproxy.test.verdicts"):
        log.rejected(listed, "p", "rawlist[0]", "127.0.0.1:1", "c")
        log.rejected(none, "p", "none[0]", "127.0.0.1:2", "d")
        await asyncio.sleep(0.2)
        log.rejected(none, "p", "none[1]", "127.0.0.1:2", "d")  # a line again, at once
    assert _warnings(caplog) == [
        "rejected rawlist[0] from 127.0.0.1:1 (client_id 'c'): interceptor p returned list, "
        "not a RecordBatch",
        "1 more like it in the last 0.05 s not logged; the last: rejected none[0] from "
        "127.0.0.1:2 (client_id 'd'): interceptor p returned NoneType, not a RecordBatch",
        "rejected none[1] from 127.0.0.1:2 (client_id 'd'): interceptor p returned NoneType, "
        "not a RecordBatch",
    ]


async def test_policy_rejections_name_each_client_and_what_was_held_back_is_summarized(
        caplog: pytest.LogCaptureFixture) -> None:
    """Three clients on one host refused alike each get their line (the page sends an
    aiokafka user, whose client shows no message, to the log); a retry held back reaches
    the log once the interval has passed, though no other line comes."""
    log = VerdictLog(logging.getLogger("kiproxy.test.verdicts"), interval=0.05)
    policy = Rejected(code=44, message="1 record(s) lack 'id'")
    with caplog.at_level(logging.INFO, "kiproxy.test.verdicts"):
        for client, port in (("rdkafka", 1), ("kafka-python", 2), ("aiokafka", 3)):
            log.rejected(policy, "p", "t[0]", f"127.0.0.1:{port}", client)
        log.rejected(policy, "p", "t[0]", "127.0.0.1:3", "aiokafka")  # its retry
        await asyncio.sleep(0.2)
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == [
        f"rejected t[0] from 127.0.0.1:{port} (client_id '{client}'): error 44: "
        "1 record(s) lack 'id'"
        for client, port in (("rdkafka", 1), ("kafka-python", 2), ("aiokafka", 3))] + [
        "1 more like it in the last 0.05 s not logged; the last: rejected t[0] from "
        "127.0.0.1:3 (client_id 'aiokafka'): error 44: 1 record(s) lack 'id'"]


async def test_a_line_written_for_the_key_cancels_its_summary(
        caplog: pytest.LogCaptureFixture) -> None:
    """A plugin failing on every batch: the line after the interval counts what was held
    back, and no summary doubles it."""
    now = [0.0]
    log = VerdictLog(logging.getLogger("kiproxy.test.verdicts"), interval=0.1,
                     clock=lambda: now[0])
    fault = Rejected(code=87, message="interceptor p returned NoneType, not a RecordBatch",
                     fault="return_type")
    with caplog.at_level(logging.INFO, "kiproxy.test.verdicts"):
        log.rejected(fault, "p", "t[0]", "a", "c")
        log.rejected(fault, "p", "t[0]", "a", "c")  # held back: a summary is due
        now[0] = 0.2  # the window has passed on the limiter's clock
        log.rejected(fault, "p", "t[0]", "a", "c")
        await asyncio.sleep(0.3)  # past the summary's time on the loop's clock
        log.rejected(fault, "p", "t[0]", "a", "c")  # within the new window: held back
    assert _warnings(caplog) == [
        "rejected t[0] from a (client_id 'c'): interceptor p returned NoneType, "
        "not a RecordBatch",
        "rejected t[0] from a (client_id 'c'): interceptor p returned NoneType, "
        "not a RecordBatch (1 more like it in the last 0.1 s not logged)",
    ]


THREE = RecordBatch(topic="orders", partition=2, records=tuple(
    Record(value=b"v%d" % i, timestamp=10 + i, offset_delta=i) for i in range(3)))


@pytest.mark.parametrize(("given", "sent", "stray"), [
    # In range and in order: sent as given.
    ([(0, "a"), (2, None)], ((0, "a"), (2, None)), ()),
    # Out of range (as the user's plugin did): left out; the rejection stands.
    ([(99, "x"), (-1, "y")], (), ((99, "x"), (-1, "y"))),
    ([(3, "one past"), (1, "b")], ((1, "b"),), ((3, "one past"),)),
    # Out of order: sorted, as librdkafka reads them alongside its records.
    ([(2, "c"), (0, "a")], ((0, "a"), (2, "c")), ()),
    # A record named twice: one entry, its messages joined.
    ([(1, "rule a"), (0, "z"), (1, None), (1, "rule b")], ((0, "z"), (1, "rule a; rule b")),
     ()),
    # Not an (index, message) pair: left out, as given.
    ([5, (0, "a")], ((0, "a"),), (5,)),
])
def test_record_errors_are_sent_only_for_records_of_the_batch(
        given: list[Any], sent: tuple[tuple[int, str | None], ...],
        stray: tuple[object, ...]) -> None:
    plugin = _Answer(RejectBatch("nope", error="INVALID_RECORD", record_errors=given))
    expected = Rejected(code=87, message="nope", record_errors=sent, stray_record_errors=stray)
    assert asyncio.run(judge(plugin, THREE, _ctx(), name="p", timeout=1)) == expected
    assert judge_sync(plugin, THREE, _ctx(), name="p", timeout=1, run=_run) == expected
    assert not expected.plugin_fault  # a policy rejection still, with the plugin's code


def test_stray_record_errors_are_warned_about_once_per_plugin(
        caplog: pytest.LogCaptureFixture) -> None:
    plugin = _Answer(RejectBatch("nope", record_errors=[(99, "x"), (0, "a"), (-1, "y")]))
    with caplog.at_level(logging.WARNING, "kiproxy.interceptors"):
        for _ in range(3):
            # A name no other test uses: the warning is rate-limited per plugin, process-wide.
            asyncio.run(judge(plugin, THREE, _ctx(), name="strays:Verdict", timeout=1))
    lines = [r.getMessage() for r in caplog.records if "strays:Verdict" in r.getMessage()]
    assert lines == ["interceptor strays:Verdict rejected orders[2] with record_errors naming no "
                     "record of its 3 records (indices 0 to 2): 99, -1; they were left out of "
                     "the answer, the rejection stands"]


def test_an_async_plugin_that_swallows_its_cancellation_is_timed_out() -> None:
    ran_on: list[str] = []

    class Stubborn(ProduceRequestInterceptor):
        async def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
            for _ in range(3):
                try:
                    await asyncio.Event().wait()  # set by no one
                except BaseException:  # the bug under test: the cancellation is swallowed
                    ran_on.append("swallowed")
                    break
            for _ in range(10):
                await asyncio.sleep(0)
            ran_on.append("returned")
            return batch

    async def main() -> Any:
        verdict = await judge(Stubborn(), BATCH, _ctx(0.05), name="p", timeout=0.05)
        assert "returned" not in ran_on  # answered at the deadline, the plugin running on
        while ran_on != ["swallowed", "returned"]:
            await asyncio.sleep(0)
        return verdict

    assert asyncio.run(main()) == Rejected(
        code=7, message="interceptor p did not finish within 50 ms", fault="timeout")


async def test_reject_batch_of_an_exception_gives_its_text() -> None:
    """``raise RejectBatch(exc)`` is common; its message was not a string, and judging
    it raised TypeError, which closed the client's connection."""
    verdict = await judge(_Answer(RejectBatch(ValueError("not a number: 'x'"))), BATCH,
                          _ctx(), name="p", timeout=1)
    assert isinstance(verdict, Rejected)
    assert verdict.message == "not a number: 'x'"
    assert verdict.code == ErrorCode.POLICY_VIOLATION


async def test_reject_batch_without_a_message_is_the_plugins_fault_not_none_sent() -> None:
    class NoReason(ProduceRequestInterceptor):
        def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> RecordBatch:
            raise RejectBatch(None)  # type: ignore[arg-type]

    verdict = await judge(NoReason(), BATCH, _ctx(), name="p", timeout=1)
    assert isinstance(verdict, Rejected) and verdict.fault == "raised"
    assert verdict.code == ErrorCode.INVALID_RECORD
    assert "TypeError: RejectBatch needs a message" in verdict.message


class _AwaitsACancelledFuture(ProduceRequestInterceptor):
    """An async plugin awaiting a future that someone else cancels (a shared lookup
    whose owner was cancelled): the CancelledError is the plugin's, not the proxy's."""

    async def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> Any:
        future = asyncio.get_running_loop().create_future()
        asyncio.get_running_loop().call_soon(future.cancel)
        await future
        return batch


@pytest.mark.parametrize("plugin", [
    _AwaitsACancelledFuture(), _Answer(asyncio.CancelledError()), _Answer(SystemExit(3)),
    _Answer(KeyboardInterrupt()),
], ids=["awaited-cancelled-future", "raises-cancelled", "sys-exit", "keyboard-interrupt"])
async def test_a_plugin_raising_a_base_exception_is_a_fault_of_its_own(plugin: Any) -> None:
    """These escaped the verdict: a CancelledError closed the client's connection with
    no line logged, a SystemExit would stop the event loop."""
    verdict = await judge(plugin, BATCH, _ctx(), name="p", timeout=1)
    assert isinstance(verdict, Rejected)
    assert verdict.fault == "raised"
    assert "interceptor p failed: " in verdict.message


async def test_the_proxys_own_cancellation_still_cancels_an_async_plugin() -> None:
    """A request cancelled by the proxy (its client left, a shutdown) is not a verdict."""
    started = asyncio.Event()

    class _Waits(ProduceRequestInterceptor):
        async def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> Any:
            started.set()
            await asyncio.sleep(10)
            return batch

    task = asyncio.ensure_future(judge(_Waits(), BATCH, _ctx(), name="p", timeout=5))
    await started.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


class _AsyncRaises(ProduceRequestInterceptor):
    def __init__(self, error: BaseException) -> None:
        self.error = error

    async def intercept(self, batch: RecordBatch, ctx: InterceptContext) -> Any:
        raise self.error


@pytest.mark.parametrize("error", [asyncio.CancelledError(), SystemExit(3)],
                         ids=["cancelled", "sys-exit"])
def test_judge_sync_judges_an_async_plugins_base_exception_as_judge_does(
        error: BaseException) -> None:
    """An isolation worker and a dry run judge with judge_sync: the same verdict as in the
    proxy, not a worker that dies or a replay that stops."""
    verdict = judge_sync(_AsyncRaises(error), BATCH, _ctx(), name="p", timeout=1,
                         run=lambda awaitable, seconds: asyncio.run(awaitable))
    assert isinstance(verdict, Rejected) and verdict.fault == "raised"


def test_ctrl_c_in_a_plugin_stops_a_replay() -> None:
    """Outside the proxy (a replay, ``kiproxy check``) SIGINT is Python's own: a
    KeyboardInterrupt that lands in plugin code stops the run, as the user asked, rather
    than being judged a rejection of that batch."""
    with pytest.raises(KeyboardInterrupt):
        judge_sync(_Answer(KeyboardInterrupt()), BATCH, _ctx(), name="p", timeout=1,
                   run=lambda awaitable, seconds: asyncio.run(awaitable))


async def test_an_async_plugins_keyboard_interrupt_is_its_fault_in_the_proxy() -> None:
    verdict = await judge(_AsyncRaises(KeyboardInterrupt()), BATCH, _ctx(), name="p",
                          timeout=1)
    assert isinstance(verdict, Rejected) and verdict.fault == "raised"


def test_a_fault_naming_no_link_is_rate_limited_per_route(
        caplog: pytest.LogCaptureFixture) -> None:
    """A chain of several links whose records cannot be encoded names no link: two
    routes' faults, each the first of its route, are both logged (one route's once held
    the other's back)."""
    from kiproxy.proxy.observe.verdict_log import Subject

    log = VerdictLog(logging.getLogger("kiproxy.test.verdicts"))
    with caplog.at_level(logging.WARNING, "kiproxy.test.verdicts"):
        for route in ("alice", "bob", "alice"):
            log.fault(Subject("t[0]", "127.0.0.1:5", None, None, route, None), "encode",
                      "returned records that cannot be encoded")
    assert [getattr(r, "route", None) for r in caplog.records] == ["alice", "bob"]


def test_a_policy_line_names_the_link_that_refused_and_an_observe_line_what_was_done(
        caplog: pytest.LogCaptureFixture) -> None:
    log = VerdictLog(logging.getLogger("kiproxy.test.verdicts"))
    with caplog.at_level(logging.INFO, "kiproxy.test.verdicts"):
        log.policy(Subject("t[0]", "10.0.0.7:1", "app", None, "orders", "pii:Mask"), 44,
                   "no PII")
        log.policy(Subject("t[1]", "10.0.0.7:1", "app", None, None, "pii:Mask"), 44,
                   "no PII")  # the interceptor: shorthand names no route and no link
        log.policy(Subject("t[2]", "10.0.0.7:1", "app", None, "orders", None), 87,
                   "undecodable")  # the proxy's own refusal names no link
        for route_observes in (True, False):
            log.observed(Subject("t[3]", "10.0.0.7:1", "app", None, "r", "p:P"),
                         "rejected" if route_observes else "transformed", "",
                         route_observes=route_observes)
    assert [r.getMessage() for r in caplog.records] == [
        "rejected t[0] from 10.0.0.7:1 (client_id 'app') on route orders, link pii:Mask: "
        "error 44: no PII",
        "rejected t[1] from 10.0.0.7:1 (client_id 'app'): error 44: no PII",
        "rejected t[2] from 10.0.0.7:1 (client_id 'app') on route orders: error 87: "
        "undecodable",
        "would have rejected t[3] from 10.0.0.7:1 (client_id 'app') on route r, link p:P "
        "(observe mode: forwarded as received)",
        "would have transformed t[3] from 10.0.0.7:1 (client_id 'app') on route r, link p:P "
        "(link in observe mode: its verdict not applied)",
    ]
